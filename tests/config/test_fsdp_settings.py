"""Accelerate FSDP configs and the Trainer's ``--fsdp`` on hf_zeropp: the user's FSDP settings keep their meaning.

An Accelerate YAML with ``distributed_type: FSDP`` runs under ``hf-zeropp launch`` with its wrap policy as the units,
its resharding as the stage, and its offload, activation checkpointing and CPU-RAM-efficient loading; ``zeropp:``
adds ZeRO++ on top. Compared with stock FSDP2 given the same settings (on CPU, where Accelerate's FSDP plugin cannot
run, its own ``fsdp2_prepare_model`` applied by the stock script: ``tests/launch_scripts/fsdp_accelerate.py``), on 4
gloo processes. Every other setting is mapped, warned about or refused by a unit test here, without workers.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import socket
import sys
from pathlib import Path

import background
import pytest
import torch
import yaml
from paths import LAUNCH_SCRIPTS, ROOT

from hf_zeropp import ZeroPPConfig
from hf_zeropp.config import fsdp_settings
from hf_zeropp.integrations.dropin import describe
from hf_zeropp.config import fsdp_keys
from hf_zeropp.config.fsdp_keys import (ACCELERATE_KEYS, IGNORED, MAPPED, REFUSED_KEYS, REFUSED_VALUES, TRAINER_KEYS,
                                        key_table)
from hf_zeropp.config.fsdp_settings import CONFIG_GIVEN_VARIABLE, SETTINGS_VARIABLE, FsdpSettings
from hf_zeropp.integrations.launch import LOAD_IN_SLICES, launch, parser, prepare
from hf_zeropp.testing.tiny_models import tiny_gpt2
from hf_zeropp.comm.topology import Topology

SCRIPT = LAUNCH_SCRIPTS / "fsdp_accelerate.py"
TRAINER_SCRIPT = str(LAUNCH_SCRIPTS / "trainer_example.py")
BIN = Path(sys.executable).parent
STOCK_CPU = ROOT / "recipes" / "accelerate" / "cpu_4proc.yaml"
EXACT = 1e-6
# the user's settings: units other than the model's own (_no_split_modules is GPT2Block), offload, recomputation,
# rank 0's weights sent at prepare (stock) or per-rank slices (hf_zeropp), sharded checkpoints, and one key FSDP2
# has no use for
FSDP_CONFIG = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
               "fsdp_transformer_layer_cls_to_wrap": "GPT2Attention,GPT2MLP", "fsdp_reshard_after_forward": True,
               "fsdp_offload_params": True, "fsdp_activation_checkpointing": True,
               "fsdp_cpu_ram_efficient_loading": True, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
               "fsdp_use_orig_params": True}
UNITS = ["GPT2Attention", "GPT2MLP"]


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    """No hf_zeropp variable of the caller's environment in a test, and this process's FSDP settings
    (:func:`hf_zeropp.config.fsdp_settings.remember`) and environment restored after it, so that no later model in this
    process records them."""
    monkeypatch.setattr(fsdp_settings, "_remembered", [])
    for name in [n for n in os.environ if n.startswith(("ZEROPP_", "HF_ZEROPP_"))]:
        monkeypatch.delenv(name)
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update(before)


def _fsdp_yaml(path: Path, fsdp_config: dict | None = None, **settings) -> str:
    base = yaml.safe_load(STOCK_CPU.read_text())
    path.write_text(yaml.safe_dump({**base, "distributed_type": "FSDP",
                                    "fsdp_config": FSDP_CONFIG if fsdp_config is None else fsdp_config, **settings}))
    return str(path)


# ---------------------------------------------------------------- the tables


def test_every_fsdp_key_is_mapped_ignored_or_refused_and_the_docs_list_each():
    """Every key Accelerate's launcher and the Trainer read has one treatment here (a key a newer Accelerate or
    Transformers adds fails this test), and docs/design.md carries the table."""
    from accelerate.commands.launch import launch_command_parser
    from transformers import TrainingArguments

    launch_keys = {action.dest.removeprefix("fsdp_") for action in launch_command_parser()._actions
                   if action.dest.startswith("fsdp_")} | {"ignored_modules"}  # read from the YAML's fsdp_config
    assert launch_keys == set(ACCELERATE_KEYS)
    source = inspect.getsource(TrainingArguments._process_fsdp_args)
    trainer_keys = set(re.findall(r'(?<!xla_)fsdp_config(?:\.get\(|\.setdefault\(|\[)\s*"(\w+)"', source))
    assert trainer_keys == set(TRAINER_KEYS)
    refused_values = {key for key, _ in REFUSED_VALUES}
    for key in {*ACCELERATE_KEYS, *TRAINER_KEYS}:
        assert (key in MAPPED) + (key in IGNORED) + (key in REFUSED_KEYS) + (key in refused_values - set(MAPPED)) == 1
    assert key_table() in (ROOT / "docs" / "design.md").read_text()


# ---------------------------------------------------------------- the launcher, without workers


def _prepared(tmp_path: Path, *argv: str) -> tuple[dict, dict, ZeroPPConfig]:
    """What ``hf-zeropp launch ARGV`` hands Accelerate (the rewritten YAML) and the workers (environment, config)."""
    args = parser().parse_args([*argv, str(SCRIPT)])
    environment = prepare(args, tmp_path)
    written = yaml.safe_load(Path(args.config_file).read_text()) if args.config_file else {}
    return written, environment, ZeroPPConfig.from_dict(json.loads(environment["ZEROPP_CONFIG"]))


def test_an_fsdp_yaml_runs_as_zero3_with_the_users_settings_and_no_fsdp_variable_reaches_a_worker(tmp_path, capsys):
    """Without ``zeropp:``: zero3 on the YAML's units, with its offload and activation checkpointing, slices loaded per
    rank, the settings handed to the workers (rank 0's start line says so) and no FSDP setting left for Accelerate.
    ``zeropp: zero3`` resolves to the same config; the ignored key is said once, by the launcher."""
    written, environment, config = _prepared(tmp_path, "--config_file", _fsdp_yaml(tmp_path / "a.yaml"))
    assert config == ZeroPPConfig(stage=3, wrap_modules=UNITS, cpu_offload=True, activation_checkpointing=True)
    assert "fsdp_config" not in written and written["distributed_type"] == "MULTI_GPU"
    assert environment[LOAD_IN_SLICES] == "1" and environment[CONFIG_GIVEN_VARIABLE] == ""
    assert not any(name.startswith("FSDP_") or name.endswith("_FSDP") for name in environment)
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == ["hf-zeropp launch: warning: fsdp_state_dict_type=SHARDED_STATE_DICT in the Accelerate config's "
                      "fsdp_config: " + fsdp_keys.CHECKPOINT_DIFFERENCES["SHARDED_STATE_DICT"],
                      "hf-zeropp launch: warning: fsdp_use_orig_params=True in the Accelerate config's fsdp_config: "
                      "ignored: FSDP2 always keeps the original parameters"]
    settings = FsdpSettings.from_json(environment[SETTINGS_VARIABLE])
    line = describe(config, Topology.from_config(config, 4, local_world_size=4), True, settings, None)
    assert ("FSDP settings from the Accelerate config's fsdp_config kept (units GPT2Attention, GPT2MLP; stage 3; CPU "
            "offload; activation checkpointing; from_pretrained in per-rank slices; SHARDED_STATE_DICT as hf_zeropp's "
            "checkpoints), no hf_zeropp config named: zero3 with these settings") in line
    _, _, named = _prepared(tmp_path, "--config_file", _fsdp_yaml(tmp_path / "b.yaml", zeropp="zero3"))
    assert named == config


@pytest.mark.parametrize(("fsdp_config", "options"), [
    ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, {"stage": 2, "wrap_modules": []}),
    ({"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, {"stage": 2, "wrap_modules": []}),
    ({"sharding_strategy": 2, "reshard_after_forward": "shard_grad_op"}, {"stage": 2, "wrap_modules": []}),
    ({"fsdp_sharding_strategy": "NO_SHARD"}, {"stage": 0, "wrap_modules": []}),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2", "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
     {"stage": 2, "shard_group": "node"}),
    ({"fsdp_auto_wrap_policy": "transformer_based_wrap", "fsdp_cpu_ram_efficient_loading": False}, {}),
    ({"fsdp_auto_wrap_policy": "NO_WRAP", "fsdp_offload_params": "true"}, {"wrap_modules": [], "cpu_offload": True}),
])
def test_resharding_wrap_policy_and_offload_become_the_stage_units_and_cpu_offload(tmp_path, fsdp_config, options):
    """Both FSDP versions' spellings (bools, strategy names in any case, ShardingStrategy's numbers, keys with or
    without the prefix); Accelerate's default policy NO_WRAP makes no layer a unit, as under stock FSDP2;
    TRANSFORMER_BASED_WRAP without classes takes the model's ``_no_split_modules``, hf_zeropp's default."""
    _, environment, config = _prepared(tmp_path, "--config_file", _fsdp_yaml(tmp_path / "f.yaml", fsdp_config))
    assert config == ZeroPPConfig(**options)
    assert (LOAD_IN_SLICES in environment) == (fsdp_config.get("fsdp_cpu_ram_efficient_loading", True) is True)


def test_the_launch_options_override_the_yaml_and_use_fsdp_needs_no_yaml(tmp_path):
    """``--fsdp_*`` options win over the YAML's keys, as in ``accelerate launch``; ``--use_fsdp`` with options alone
    is FSDP too."""
    _, _, config = _prepared(tmp_path, "--config_file", _fsdp_yaml(tmp_path / "o.yaml"),
                             "--fsdp_reshard_after_forward", "false", "--fsdp_activation_checkpointing", "false")
    assert (config.stage, config.activation_checkpointing, config.wrap_modules) == (2, False, UNITS)
    _, _, config = _prepared(tmp_path, "--config_file", str(STOCK_CPU), "--use_fsdp", "--fsdp_auto_wrap_policy",
                             "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block")
    assert config == ZeroPPConfig(wrap_modules=["GPT2Block"])


def test_zeropp_adds_its_techniques_on_the_users_units_and_a_contradiction_names_both(tmp_path, capsys):
    """``zeropp: zeropp`` keeps the YAML's units, offload and recomputation; a config that says another stage or
    shard group than the FSDP settings is refused naming both, as is a combination the config forbids."""
    _, _, config = _prepared(tmp_path, "--config_file", _fsdp_yaml(tmp_path / "z.yaml", zeropp="zeropp"))
    assert config == ZeroPPConfig.preset("zeropp", wrap_modules=UNITS, cpu_offload=True, activation_checkpointing=True)
    _, _, config = _prepared(tmp_path, "--config_file", _fsdp_yaml(
        tmp_path / "h.yaml", {"fsdp_sharding_strategy": "HYBRID_SHARD"}, zeropp="hybrid"))
    assert config == ZeroPPConfig.preset("hybrid", wrap_modules=[])
    capsys.readouterr()
    line = _refused(capsys, "--config_file", _fsdp_yaml(tmp_path / "s.yaml", {"fsdp_reshard_after_forward": False},
                                                        zeropp="zeropp"))
    assert ("fsdp_reshard_after_forward=False in the Accelerate config's fsdp_config means stage=2, but `zeropp: "
            "\"zeropp\"` in the Accelerate config sets stage=3") in line
    line = _refused(capsys, "--config_file", _fsdp_yaml(tmp_path / "t.yaml", {"fsdp_reshard_after_forward": True}),
                    "--zeropp", '{"stage": 2}')
    assert "means stage=3, but --zeropp {\"stage\": 2} sets stage=2" in line
    line = _refused(capsys, "--config_file", _fsdp_yaml(tmp_path / "u.yaml", {"fsdp_sharding_strategy": "FULL_SHARD"},
                                                        zeropp="hybrid"))
    assert "fsdp_sharding_strategy='FULL_SHARD'" in line and "means shard_group='world'" in line
    line = _refused(capsys, "--config_file", _fsdp_yaml(tmp_path / "v.yaml", {"fsdp_sharding_strategy": "HYBRID_SHARD"},
                                                        zeropp="zeropp"))
    assert ("fsdp_sharding_strategy='HYBRID_SHARD' in the Accelerate config's fsdp_config with `zeropp: \"zeropp\"`"
            in line)
    assert "shard_group='node' (hybrid sharding) with quantized_weights" in line


def _refused(capsys, *argv: str) -> str:
    """``hf-zeropp launch ARGV SCRIPT`` in this process: status 2 and one line naming the problem, no worker started."""
    code = launch([*argv, str(SCRIPT)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("hf-zeropp launch: error: "), (code, err)
    return err[0]


@pytest.mark.parametrize(("fsdp_config", "message"), [
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000},
     "fsdp_auto_wrap_policy=SIZE_BASED_WRAP in the Accelerate config's fsdp_config: hf_zeropp's units are layer "
     "classes, not parameter counts; use TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap"),
    ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"},
     "fsdp_state_dict_type=LOCAL_STATE_DICT in the Accelerate config's fsdp_config: FSDP2 has no local state dict; "
     "use SHARDED_STATE_DICT"),
    ({"fsdp_activation_checkpointing_offload": True}, "fsdp_activation_checkpointing_offload=True in the Accelerate "
                                                      "config's fsdp_config: hf_zeropp recomputes activations"),
    ({"fsdp_ignored_modules": "lm_head"}, "fsdp_ignored_modules='lm_head' in the Accelerate config's fsdp_config: "
                                          "hf_zeropp shards every parameter of the model; remove it"),
    ({"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"},
     "names the units of TRANSFORMER_BASED_WRAP, but the wrap policy is NO_WRAP (Accelerate would ignore the classes); "
     "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"),
    ({"fsdp_reshard_after_forwards": True}, "key 'fsdp_reshard_after_forwards' is not an FSDP setting hf_zeropp "
                                            "knows; use fsdp_version, fsdp_reshard_after_forward"),
    ({"fsdp_reshard_after_forward": "sometimes"}, "fsdp_reshard_after_forward='sometimes' in the Accelerate config's "
                                                  "fsdp_config is neither true/false nor a sharding strategy"),
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_reshard_after_forward": True},
     "fsdp_sharding_strategy='SHARD_GRAD_OP' and fsdp_reshard_after_forward=True in the Accelerate config's "
     "fsdp_config disagree"),
    ({"fsdp_version": 3}, "fsdp_version=3 in the Accelerate config's fsdp_config is not an FSDP version; use 1 or 2"),
    ({"fsdp_offload_params": "maybe"}, "fsdp_offload_params='maybe' in the Accelerate config's fsdp_config is not a "
                                       "bool; use true or false"),
    ({"fsdp_sharding_strategy": "NO_SHARD", "fsdp_offload_params": True},
     "fsdp_sharding_strategy='NO_SHARD', fsdp_offload_params=True in the Accelerate config's fsdp_config with zero3: "
     "cpu_offload needs stage 1 or 2 or 3"),
])
def test_an_fsdp_setting_hf_zeropp_cannot_honour_is_one_line_naming_it_and_the_alternative(tmp_path, capsys,
                                                                                           fsdp_config, message):
    line = _refused(capsys, "--config_file", _fsdp_yaml(tmp_path / "bad.yaml", fsdp_config))
    assert message in line, line


def test_refused_fsdp_launches_beside_the_keys(tmp_path, capsys):
    """HSDP/TP/CP degrees (``parallelism_config``), two distributed types at once, and the script's own Trainer
    flags, which are read at launch as the Trainer will read them."""
    line = _refused(capsys, "--config_file", _fsdp_yaml(tmp_path / "p.yaml", parallelism_config={
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}))
    assert "parallelism_config: FSDP2's replicate, shard, tensor and context parallel degrees" in line
    assert "fsdp_sharding_strategy: HYBRID_SHARD (or `zeropp: hybrid`)" in line
    line = _refused(capsys, "--config_file", str(STOCK_CPU), "--use_fsdp", "--use_deepspeed")
    assert "--use_fsdp and --use_deepspeed are both given" in line
    code = launch(["--config_file", str(STOCK_CPU), TRAINER_SCRIPT, "--fsdp", "full_shard", "--fsdp_config",
                   json.dumps({"xla": True})])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["hf-zeropp launch: error: xla=True in TrainingArguments' fsdp and fsdp_config: XLA's "
                                 "FSDP runs on TPUs, which hf_zeropp does not; launch without hf_zeropp"]
    code = launch(["--config_file", str(STOCK_CPU), TRAINER_SCRIPT, "--fsdp", "full_shard offlaod"])
    assert code == 2 and "'offlaod' is not an FSDP option" in capsys.readouterr().err


# ---------------------------------------------------------------- TrainingArguments, in this process


def test_trainer_fsdp_arguments_become_the_zeropp_config_and_set_no_fsdp_plugin_or_variable(tmp_path, recwarn):
    """``fsdp="full_shard offload auto_wrap"`` with an ``fsdp_config`` (keys with and without the prefix): zero3 on
    the listed classes with offload and recomputation, in ``args.zeropp``; the Trainer sees no FSDP (no plugin
    arguments, no ``FSDP_*`` / ``ACCELERATE_USE_FSDP`` variable); the keys FSDP2 ignores and the checkpoint format
    are warned about once. Under the launcher (dropin installed) ``cpu_ram_efficient_loading`` makes every later
    ``from_pretrained`` load per-rank slices."""
    from transformers import PreTrainedModel, TrainingArguments

    from hf_zeropp.integrations import dropin
    from hf_zeropp.integrations.trainer import ZeroPPTrainingArguments

    args = ZeroPPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                   fsdp="full_shard offload auto_wrap",
                                   fsdp_config={"fsdp_transformer_layer_cls_to_wrap": "GPT2MLP",
                                                "activation_checkpointing": "true",
                                                "backward_prefetch": "BACKWARD_PRE"})
    assert ZeroPPConfig.coerce(args.zeropp) == ZeroPPConfig(wrap_modules=["GPT2MLP"], cpu_offload=True,
                                                            activation_checkpointing=True)
    assert not args.fsdp and args.fsdp_plugin_args is None
    assert not any(name.startswith("FSDP_") or name.endswith("_FSDP") for name in os.environ)
    said = [str(w.message) for w in recwarn if str(w.message).startswith("hf_zeropp:")]
    assert said == ["hf_zeropp: state_dict_type=FULL_STATE_DICT in TrainingArguments' fsdp and fsdp_config: "
                    + fsdp_keys.CHECKPOINT_DIFFERENCES["FULL_STATE_DICT"],
                    "hf_zeropp: backward_prefetch='BACKWARD_PRE' in TrainingArguments' fsdp and fsdp_config: ignored: "
                    "FSDP2 prefetches one unit ahead in backward (BACKWARD_PRE's order), whatever this says"]
    with pytest.raises(ValueError, match=r"fsdp='shard_grad_op' in TrainingArguments' fsdp and fsdp_config means "
                                         r"stage=2, but zeropp='zeropp' sets stage=3"):
        ZeroPPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp="shard_grad_op", zeropp="zeropp")
    with pytest.raises(ValueError, match="fsdp=True and deepspeed='ds.json' are both set"):
        ZeroPPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True, deepspeed="ds.json")
    os.environ[SETTINGS_VARIABLE] = FsdpSettings("the Accelerate config's fsdp_config").to_json()  # a launch's
    with pytest.raises(ValueError, match="fsdp=True is set, and the launch's Accelerate config has FSDP settings too"):
        ZeroPPTrainingArguments(output_dir=str(tmp_path), use_cpu=True, fsdp=True)
    del os.environ[SETTINGS_VARIABLE]
    stock_from_pretrained = PreTrainedModel.__dict__["from_pretrained"]
    dropin.install()
    try:
        os.environ[CONFIG_GIVEN_VARIABLE] = ""  # as under hf-zeropp launch
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp=True,
                                 fsdp_config=json.dumps({"cpu_ram_efficient_loading": True, "reshard_after_forward":
                                                         False}))
        assert ZeroPPConfig.coerce(args.zeropp) == ZeroPPConfig(stage=2)
        assert PreTrainedModel.__dict__["from_pretrained"] is not stock_from_pretrained
    finally:
        dropin.uninstall()
    assert PreTrainedModel.__dict__["from_pretrained"] is stock_from_pretrained


# ---------------------------------------------------------------- launched: stock FSDP2 beside hf_zeropp


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(command: list[str], env: dict[str, str]) -> str:
    full_env = {name: value for name, value in background.environ().items() if not name.startswith("ZEROPP_")}
    result = background.run(command, 300, cwd=ROOT, env={**full_env, "OMP_NUM_THREADS": "1", **env})
    output = result.stdout + result.stderr
    # stock scripts may abort as gloo finalizes after they finished (tests/integrations/test_launch.py, EXIT_ABORT); the
    # results are written before, and compared in full
    aborted = "terminate called without an active exception" in output and "ACCELERATE_USE_CPU" in env
    assert result.returncode == 0 or aborted, output[-6000:]
    return output


def _save_pretrained(work: Path) -> None:
    tiny_gpt2(0).save_pretrained(work / "pretrained")


@background.launches("fsdp_runs", prepare=_save_pretrained)
def _fsdp_launches(work: Path) -> dict[str, dict]:
    common = [str(SCRIPT), "--pretrained", str(work / "pretrained")]
    outputs = {"stock": _run([str(BIN / "accelerate"), "launch", "--config_file", _fsdp_yaml(work / "stock.yaml"),
                              "--main_process_port", _port(), *common, "--output", str(work / "stock")],
                             {"ACCELERATE_USE_CPU": "true"})}
    for name, env in (("zero3", {}), ("zeropp", {"ZEROPP_NODE_SIZE": "2"})):
        outputs[name] = _run([str(BIN / "hf-zeropp"), "launch", "--config_file", _fsdp_yaml(
            work / f"{name}.yaml", zeropp=name), "--main_process_port", _port(), *common, "--output", str(work / name)],
            env)
    return {name: {**torch.load(work / name / "results.pt", weights_only=False), "output": output}
            for name, output in outputs.items()}


@pytest.fixture(scope="module")
def fsdp_runs() -> dict[str, dict]:
    """The stock script three times on 4 CPU processes (made in the background, tests/background.py): stock
    ``accelerate launch`` with the FSDP YAML (FSDP2 applied as Accelerate's plugin would), and ``hf-zeropp launch``
    with the same YAML plus ``zeropp: zero3``, then plus ``zeropp: zeropp`` on 2 emulated nodes x 2 ranks."""
    return background.result("fsdp_runs")


def _relative(actual: list[float], expected: list[float]) -> float:
    assert len(actual) == len(expected) > 0
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


def test_an_fsdp_yaml_with_zeropp_zero3_equals_stock_fsdp2_given_the_same_settings(fsdp_runs):
    """Losses and gradient norms to 1e-6 relative, and the final weights: the whole model to 1e-6 relative (L2), and
    no element further than 1e-6 of the largest weight from stock's (an element-wise relative bound means nothing for
    the attention key biases, whose gradient is zero in exact arithmetic: both runs move them by rounding noise
    only). Both sharded on the YAML's classes; under CPU-RAM-efficient loading stock sends rank 0's weights to the
    others at prepare, hf_zeropp builds the model on the meta device and loads each rank's slices; no FSDP variable
    reaches hf_zeropp's workers; save_state writes sharded DCP checkpoints."""
    stock, ours = fsdp_runs["stock"], fsdp_runs["zero3"]
    assert stock["loss"][-1] < stock["loss"][0] - 0.05
    for key in ("loss", "grad_norm"):
        assert _relative(ours[key], stock[key]) <= EXACT, (key, ours[key], stock[key])
    assert set(ours["state_dict"]) == set(stock["state_dict"])
    difference = torch.cat([(ours["state_dict"][n] - w).flatten() for n, w in stock["state_dict"].items()])
    weights = torch.cat([w.flatten() for w in stock["state_dict"].values()])
    assert difference.norm() <= EXACT * weights.norm() and difference.abs().max() <= EXACT * weights.abs().max()
    assert ours["units"] == UNITS and set(UNITS) <= set(stock["units"])
    assert ours["loaded_on_meta"] == [True] * 4 and stock["fsdp_variables"]["FSDP_CPU_RAM_EFFICIENT_LOADING"] == "true"
    assert stock["fsdp_variables"]["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "GPT2Attention,GPT2MLP"
    assert ours["fsdp_variables"] == {}
    assert "zeropp_model_0" in ours["saved_state"]
    implementations = ours["comm_stats"]["implementations"]
    assert "cpu_offload" in implementations and implementations["fwd_allgather"] == ["all_gather torch.float32"]
    assert implementations["fsdp_settings"] == [
        "from the Accelerate config's fsdp_config: stage=3 (fsdp_reshard_after_forward=True), wrap_modules=["
        "'GPT2Attention', 'GPT2MLP'] (fsdp_transformer_layer_cls_to_wrap='GPT2Attention,GPT2MLP'), cpu_offload=True "
        "(fsdp_offload_params=True), activation_checkpointing=True (fsdp_activation_checkpointing=True)"]
    assert implementations["fsdp_use_orig_params=True"] == [
        "the Accelerate config's fsdp_config: ignored: FSDP2 always keeps the original parameters"]


def test_an_fsdp_yaml_with_zeropp_zeropp_runs_zeropp_on_the_users_units(fsdp_runs):
    """On 2 emulated nodes x 2 ranks: the YAML's classes are the units, the meter shows qwZ (INT8 forward gathers
    across nodes), hpZ (no backward gather crosses nodes) and qgZ (the INT4 inter-node hop), the losses stay within
    quantization error of stock FSDP2's, and rank 0's start line and the launcher's one warning say what ran."""
    stock, ours = fsdp_runs["stock"], fsdp_runs["zeropp"]
    assert ours["units"] == UNITS
    stats = ours["comm_stats"]
    assert stats["fwd_allgather"]["inter_node"] > 0 and "qwZ int8" in stats["implementations"]["fwd_allgather"][0]
    assert stats["bwd_allgather"]["inter_node"] == 0 and stats["bwd_allgather"]["intra_node"] > 0
    assert stats["qgz_inter"]["inter_node"] > 0
    assert _relative(ours["loss"], stock["loss"]) < 0.01
    output = ours["output"]
    assert output.count("hf-zeropp launch: warning: fsdp_use_orig_params=True") == 1
    start = next(line for line in output.splitlines() if line.startswith("hf_zeropp launch: accelerate.Accelerator"))
    assert "config: stage 3, qwZ int8, hpZ over 2 ranks, qgZ int4/int4; FSDP settings from the Accelerate config's " \
           "fsdp_config kept (units GPT2Attention, GPT2MLP; stage 3; CPU offload; activation checkpointing" in start
    assert 'on `zeropp: "zeropp"` in the Accelerate config; 2 node(s) x 2 ranks' in start


def test_an_fsdp_plugin_made_in_the_script_is_refused_naming_the_config_keys():
    """Accelerate would run a script's own FullyShardedDataParallelPlugin as DDP on CPU and hf_zeropp would shard
    as zero3 without its settings: instead, one error that names where the settings go."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    import hf_zeropp

    with pytest.raises(ValueError, match=r"does not read a FullyShardedDataParallelPlugin made in the script; put its "
                                         r"settings in the Accelerate config's fsdp_config"):
        hf_zeropp.Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), cpu=True)

