"""Conformance, third column: unmodified scripts under ``hf-zeropp launch``.

Scripts that never import hf_zeropp (``tests/launch_scripts``: Accelerate patterns, a Transformers-example-style
Trainer script, and TRL's own ``trl.scripts.sft`` / ``trl.scripts.dpo``) run under the launcher with one YAML file
or one flag, and are compared with the same script ported by hand (import changed: bit for bit) and with the same
script under stock ``accelerate launch`` (DDP: 1e-6 where nothing is quantized). The bad inputs are refused with
one line before any worker starts. Each launch is 4 CPU processes, 2 emulated nodes x 2 ranks where it matters.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import background
import pytest
import torch
import yaml
from launching import BIN, STOCK_CPU, free_port, hf_zeropp_launch, run_launch, stock_launch
from paths import LAUNCH_SCRIPTS, ROOT

from hf_zeropp.integrations.deepspeed_plugin import PLUGIN_VARIABLE
from hf_zeropp.integrations.launch import launch
from hf_zeropp.testing import emulated_network
from hf_zeropp.testing.tiny_models import save_tiny_gpt2_with_tokenizer

ONE_FILE_2X2 = ROOT / "recipes" / "accelerate" / "cpu_2x2.yaml"  # zeropp preset, node_size 2
EXACT = 1e-6


def _close(actual: list[float], expected: list[float], rel: float) -> bool:
    return len(actual) == len(expected) > 0 and all(abs(a - e) <= rel * abs(e) for a, e in zip(actual, expected))


def _logs(folder: Path) -> list[dict]:
    return json.loads((folder / "trainer_state.json").read_text())["log_history"]


def _series(logs: list[dict], key: str) -> list[float]:
    return [entry[key] for entry in logs if key in entry]


def _write_json(path: Path, value: dict) -> Path:
    path.write_text(json.dumps(value))
    return path


def _write_yaml(path: Path, **settings) -> str:
    base = yaml.safe_load(STOCK_CPU.read_text())
    path.write_text(yaml.safe_dump({**base, **settings}))
    return str(path)


# ---------------------------------------------------------------- the one-file YAML: Accelerate patterns, TRL's scripts

TRL_ARGS = ("--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--adam_epsilon", "1e-6", "--bf16",
            "false", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "3", "--report_to", "none",
            "--use_cpu", "--seed", "0", "--max_steps", "3", "--max_length", "32")


def _trl_data(work: Path) -> None:
    """TRL's scripts' base model and datasets, where TRL is installed."""
    if importlib.util.find_spec("trl") is None:
        return
    save_tiny_gpt2_with_tokenizer(work / "base")
    for kind, rows in (("sft", [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"} for i in range(32)]),
                       ("dpo", [{"prompt": f"x{i} =", "chosen": f" {i * 7}", "rejected": " none"} for i in range(32)])):
        (work / f"{kind}_data").mkdir()
        (work / f"{kind}_data" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@background.launches("one_file_runs", prepare=_trl_data)
def _one_file_launches(work: Path) -> dict:
    compiling = work / "cpu_2x2_compiled.yaml"  # the one file with Accelerate's dynamo_config added
    compiling.write_text(yaml.safe_dump({**yaml.safe_load(ONE_FILE_2X2.read_text()),
                                         "dynamo_config": {"dynamo_backend": "EAGER"}}))
    output = hf_zeropp_launch("--config_file", str(compiling), str(LAUNCH_SCRIPTS / "accelerate_patterns.py"),
                              "--output", str(work / "launched"))

    def ported(preset: str, script: str, *args: str, env: tuple[str, ...] = ()) -> str:
        return shlex.join([f"ZEROPP_CONFIG={preset}", "ZEROPP_NODE_SIZE=2", *env, str(LAUNCH_SCRIPTS / script),
                           *args])

    imported = [ported("zeropp", "accelerate_patterns_imported.py", "--output", str(work / "imported"),
                       env=("ACCELERATE_DYNAMO_BACKEND=EAGER",))]
    if (work / "base").is_dir():

        def data(kind: str, way: str) -> list[str]:
            return ["--dataset_name", str(work / f"{kind}_data"), "--output_dir", str(work / f"{kind}_{way}"),
                    "--model_name_or_path", str(work / "base"), *TRL_ARGS]

        hf_zeropp_launch("--config_file", str(ONE_FILE_2X2), str(LAUNCH_SCRIPTS / "run_each.py"),
                          shlex.join(["-m", "trl.scripts.sft", *data("sft", "launched")]),
                          shlex.join(["-m", "trl.scripts.dpo", *data("dpo", "launched"), "--zeropp", "zero3"]))
        imported += [ported(preset, "trl_script_imported.py", kind, *data(kind, "imported"))
                     for kind, preset in (("sft", "zeropp"), ("dpo", "zero3"))]
    stock_launch(str(LAUNCH_SCRIPTS / "run_each.py"), *imported)
    return {"work": work, "output": output}


@pytest.fixture(scope="module")
def one_file_runs() -> dict:
    """The stock scripts under the launcher with the one-file YAML (ZeRO++, 2 emulated nodes x 2 ranks): the
    Accelerate patterns in a launch of their own (rank 0's lines at exit are about its models alone), TRL's own SFT
    script as the YAML says and its DPO script with ``--zeropp zero3`` on its command line (TRL's parser) one after
    the other in one launch (tests/launch_scripts/run_each.py). Then all of them ported by hand (``from hf_zeropp
    import ...``), each with its ``ZEROPP_*`` variables, in one stock ``accelerate launch``. TRL is optional: without
    it only the Accelerate runs are made. Made in the background (tests/background.py)."""
    return background.result("one_file_runs")


@pytest.fixture(scope="module")
def accelerate_runs(one_file_runs) -> dict[str, dict]:
    runs = {name: torch.load(one_file_runs["work"] / name / "results.pt", weights_only=False)
            for name in ("launched", "imported")}
    runs["launched"]["output"] = one_file_runs["output"]
    return runs


def test_accelerate_script_under_the_launcher_equals_the_ported_script_bit_for_bit(accelerate_runs):
    """One-call prepare with accumulation, clipping, a scheduler and gather_for_metrics; split prepare; save_state
    then load_state into a fresh run; save_model: the same numbers as the script with ``from hf_zeropp import
    Accelerator``, and the ported run's meter shows ZeRO++'s three techniques at work. Both compile (the launched
    run as its YAML's ``dynamo_config`` says, the ported one by its variable), with the ``eager`` backend, which keeps
    eager's numbers."""
    launched, imported = accelerate_runs["launched"], accelerate_runs["imported"]
    hf_zeropp_accelerator = "hf_zeropp.integrations.accelerate_integration.Accelerator"
    assert launched["accelerator_class"] == imported["accelerator_class"] == hf_zeropp_accelerator
    for pattern in ("one_call", "split_prepare", "uninterrupted", "resumed"):
        assert launched[pattern] == imported[pattern], pattern
    assert launched["resumed"] == launched["uninterrupted"]
    assert launched["one_call"]["loss"][-1] < launched["one_call"]["loss"][0] - 0.05
    assert launched["evaluated"] == list(range(11))
    assert all(torch.equal(launched["state_dict"][n], imported["state_dict"][n]) for n in imported["state_dict"])
    stats = imported["report"]
    assert stats["fwd_allgather"]["inter_node"] > 0 and "qwZ int8" in stats["implementations"]["fwd_allgather"][0]
    assert stats["bwd_allgather"]["inter_node"] == 0 and stats["bwd_allgather"]["intra_node"] > 0  # hpZ
    assert stats["qgz_inter"]["inter_node"] > 0  # qgZ
    # the YAML's dynamo_config (the ported run: its variable) compiles each FSDP unit, said once on rank 0
    assert "per FSDP unit" in stats["implementations"]["compile"][0], stats["implementations"]["compile"]
    assert accelerate_runs["launched"]["output"].count("hf_zeropp compiles a sharded model per FSDP unit") == 1


def test_rank_0_says_what_was_installed_and_at_exit_what_was_sent(accelerate_runs):
    """One line at start (what was installed, the resolved config, the nodes); at exit one line per model still
    alive, with the bytes rank 0 sent: qwZ's forward gather and qgZ's inter-node hop cross nodes, hpZ's backward
    gather does not."""
    lines = [line for line in accelerate_runs["launched"]["output"].splitlines()
             if line.startswith("hf_zeropp launch:")]
    start, at_exit = lines[0], lines[1:]
    assert "accelerate.Accelerator" in start and "transformers.Trainer" in start
    assert "stage 3, qwZ int8, hpZ over 2 ranks, qgZ int4/int4" in start
    assert "2 node(s) x 2 ranks (node size from node_size in the hf_zeropp config)" in start
    assert 1 <= len(at_exit) <= 3, lines  # the script's three models, those still alive at exit
    for line in at_exit:
        assert line.startswith("hf_zeropp launch: GPT2LMHeadModel: this rank sent"), line
        sent = {kind: tuple(map(float, value.split("/"))) for kind, value in
                (part.rsplit(" ", 1) for part in line.split("per collective: ")[1].rstrip(")").split(", "))}
        assert sent["fwd_allgather"][1] > 0 and sent["qgz_inter"][1] > 0
        assert sent["bwd_allgather"][1] == 0 and sent["bwd_allgather"][0] > 0


# ---------------------------------------------------------------- Trainer

TRAINER_ARGS = ("--max_steps", "6", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                "--learning_rate", "1e-2", "--adam_epsilon", "1e-6", "--max_grad_norm", "1.0", "--eval_strategy",
                "steps", "--eval_steps", "3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                "--use_cpu", "--seed", "0")
TRAINER_FSDP_CONFIG = {"transformer_layer_cls_to_wrap": ["GPT2Attention", "GPT2MLP"], "activation_checkpointing": True,
                       "use_orig_params": True}
# The live-weights and persistence keys at 0: with DeepSpeed's defaults this tiny model would stay whole (every
# parameter under the persistence threshold) and gathered, as under DeepSpeed, and no ZeRO++ technique would show.
DEEPSPEED_ZEROPP = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                          "zero_quantized_gradients": True, "stage3_max_live_parameters": 0,
                                          "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0},
                    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                    "bf16": {"enabled": "auto"}}
# the same as hf_zeropp options: the prefetch depth the config leaves out gets DeepSpeed's default
DEEPSPEED_STAGE3 = {"max_live_parameters": 0, "max_reuse_distance": 0, "persistence_threshold": 0,
                    "prefetch_bucket_size": 5 * 10**7}


def _launch_on_two_machines(*args: str) -> None:
    """``hf-zeropp launch --num_machines 2 ... ARGS`` once per machine, 2 processes each: on the emulated cluster (a
    network namespace per node) where this machine allows it, else as two machines on this host."""
    options = ["--config_file", str(STOCK_CPU), "--num_machines", "2", "--num_processes", "4",
               "--main_process_port", free_port()]
    if emulated_network.namespaces_problem() is None:
        per_node = 'exec "$0" launch --machine_rank "$ZPP_NODE_RANK" --main_process_ip "$ZPP_MASTER_ADDR" "$@"'
        run_launch([sys.executable, "-m", "hf_zeropp.testing.emulated_cluster", "--nodes", "2", "--nproc-per-node", "2",
              "--link", "none", "--raw", "--", "sh", "-c", per_node, str(BIN / "hf-zeropp"), *options, *args])
        return
    env = {**background.environ(), "OMP_NUM_THREADS": "1"}
    machines = [background.popen([str(BIN / "hf-zeropp"), "launch", *options, "--machine_rank", str(rank),
                                  "--main_process_ip", "127.0.0.1", *args], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [machine.communicate(timeout=background.timeout(300))[0] for machine in machines]
    assert all(m.returncode == 0 for m in machines), "\n".join(o[-4000:] for o in outputs)


def _save_scripts_model(folder: Path) -> Path:
    """The model trainer_example.py builds without ``--model_name_or_path`` (its defaults, seed 0), saved."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(folder)
    return folder


@background.launches("trainer_runs", prepare=lambda work: _save_scripts_model(work / "pretrained"))
def _trainer_launches(work: Path) -> dict[str, list[dict]]:
    script = str(LAUNCH_SCRIPTS / "trainer_example.py")
    # stock loads, with from_pretrained, the very weights the script builds itself (seed 0) in the other runs: it
    # is the reference of all of them, and of the zero3 run, whose script loads them too
    pretrained = work / "pretrained"
    stock = stock_launch(script, "--output_dir", str(work / "stock"), "--model_name_or_path", str(pretrained),
                          *TRAINER_ARGS)
    # the one-file YAML asks for zeropp; the launcher's --zeropp overrides it. With --load_in_slices the script's
    # from_pretrained builds the model on meta and each rank reads its slices of the folder stock loads whole
    zero3 = hf_zeropp_launch("--config_file", str(ONE_FILE_2X2), "--zeropp", "zero3", "--load_in_slices", script,
                              "--output_dir", str(work / "zero3"), "--model_name_or_path", str(pretrained),
                              *TRAINER_ARGS)
    deepspeed = work / "ds_config.json"
    deepspeed.write_text(json.dumps(DEEPSPEED_ZEROPP))
    # --deepspeed=FILE on 2 emulated nodes, in a launch of its own: the launcher reads the script's flag; then the
    # FSDP flags
    deepspeed_output = hf_zeropp_launch("--config_file", str(STOCK_CPU), script, "--output_dir", str(
        work / "deepspeed"), f"--deepspeed={deepspeed}", *TRAINER_ARGS, env={"ZEROPP_NODE_SIZE": "2"})
    fsdp = hf_zeropp_launch("--config_file", str(STOCK_CPU), "--dynamo_backend", "eager", script, "--output_dir",
                            str(work / "fsdp"),
                             *TRAINER_ARGS, "--fsdp", "full_shard auto_wrap", "--fsdp_config",
                             json.dumps(TRAINER_FSDP_CONFIG))
    accelerate_deepspeed = _write_yaml(work / "deepspeed.yaml", distributed_type="DEEPSPEED", deepspeed_config={
        "deepspeed_config_file": str(deepspeed), "zero3_init_flag": True})
    accelerate_deepspeed_output = hf_zeropp_launch(
        "--config_file", accelerate_deepspeed, script, "--output_dir", str(work / "accelerate_deepspeed"),
        *TRAINER_ARGS, env={"ZEROPP_NODE_SIZE": "2"})
    # two machines of 2 ranks: the node size comes from the launch itself
    _launch_on_two_machines(script, "--output_dir", str(work / "two_machines"), "--zeropp",
                            json.dumps({"preset": "zeropp", **DEEPSPEED_STAGE3}), *TRAINER_ARGS)
    names = ("stock", "zero3", "deepspeed", "accelerate_deepspeed", "two_machines", "fsdp")
    return {name: _logs(work / name) for name in names} | {"work": work, "fsdp_output": fsdp, "stock_output": stock,
                                                            "deepspeed_output": deepspeed_output,
                                                            "accelerate_deepspeed_output": accelerate_deepspeed_output,
                                                            "zero3_output": zero3}


@pytest.fixture(scope="module")
def trainer_runs() -> dict[str, list[dict]]:
    """The Transformers-example script under stock ``accelerate launch`` and under the launcher in each way a user
    asks for hf_zeropp (made in the background, tests/background.py)."""
    return background.result("trainer_runs")


def test_trainer_script_with_zeropp_zero3_equals_stock_ddp(trainer_runs):
    """The Transformers-example script under the launcher (``--zeropp zero3``, which overrides the YAML's
    ``zeropp:``; ``--load_in_slices``) against the same script under stock ``accelerate launch`` (DDP), both loading
    one pretrained folder: losses, gradient norms and evaluation losses to 1e-6; the saved folders load with plain
    transformers and give the same logits."""
    stock, ours = trainer_runs["stock"], trainer_runs["zero3"]
    assert _series(stock, "loss")[-1] < _series(stock, "loss")[0] - 0.05
    for key in ("loss", "grad_norm", "eval_loss"):
        assert _close(_series(ours, key), _series(stock, key), EXACT), (key, _series(ours, key), _series(stock, key))
    assert "zeropp/fwd_allgather_intra_node_bytes" in ours[0]
    assert "zeropp/fwd_allgather_intra_node_bytes" not in stock[0]
    from transformers import GPT2LMHeadModel

    ids = torch.arange(16).reshape(1, 16) % 64
    logits = {name: GPT2LMHeadModel.from_pretrained(trainer_runs["work"] / name)(input_ids=ids).logits
              for name in ("stock", "zero3")}
    assert torch.allclose(logits["zero3"], logits["stock"], rtol=1e-5, atol=1e-5)


def test_trainer_fsdp_flags_run_on_hf_zeropp_with_their_units_and_equal_stock(trainer_runs):
    """``--fsdp "full_shard auto_wrap" --fsdp_config {...}`` under the launcher: the FSDP settings become hf_zeropp
    options (zero3 on the listed classes, with activation checkpointing) instead of Accelerate's FSDP plugin, and the
    Trainer's losses, gradient norms and evaluation losses equal the stock run's to 1e-6 (stock Accelerate runs its
    FSDP plugin as DDP on CPU, the run above), with each unit compiled as the launch line's ``--dynamo_backend eager``
    asks. The keys that change nothing, and the checkpoint format that differs from FSDP's FULL_STATE_DICT (the
    Trainer's default), are said once, by rank 0."""
    stock, ours = trainer_runs["stock"], trainer_runs["fsdp"]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert _close(_series(ours, key), _series(stock, key), EXACT), (key, _series(ours, key), _series(stock, key))
    assert ours[0]["zeropp/fwd_allgather_intra_node_bytes"] > 0
    output = trainer_runs["fsdp_output"]
    # the launch line's --dynamo_backend eager: the Trainer's Accelerator compiles each FSDP unit (eager's numbers)
    assert output.count("hf_zeropp compiles a sharded model per FSDP unit") == 1
    assert output.count("use_orig_params=True in TrainingArguments' fsdp and fsdp_config: ignored") == 1
    assert output.count("state_dict_type=FULL_STATE_DICT in TrainingArguments' fsdp and fsdp_config") == 1


def test_load_in_slices_loads_the_scripts_pretrained_model_on_meta(trainer_runs):
    """``hf-zeropp launch --load_in_slices``: the script's ``AutoModelForCausalLM.from_pretrained`` returns the model
    on the meta device on every rank and sharding reads each rank's slices of the checkpoint (the zero3 run, whose
    numbers equal stock's, every rank loading the whole model: the test above); under stock it does not."""
    assert "from_pretrained returned a model on the meta device: False" in trainer_runs["stock_output"]
    ours = trainer_runs["zero3_output"]
    assert "from_pretrained returned a model on the meta device: True" in ours
    assert "from_pretrained builds on meta, each rank reads its slices" in ours


def test_trainer_deepspeed_flag_runs_zeropp_and_equals_zeropp_on_two_machines(trainer_runs):
    """``--deepspeed ds.json`` (stage 3 + zero_quantized_weights + zero_hpz_partition_size + zero_quantized_gradients),
    without DeepSpeed installed, equals ``--zeropp zeropp`` with the config's stage-3 knobs launched on two machines of
    2 ranks (``--num_machines 2``) bit for bit, and so does an Accelerate YAML with ``distributed_type: DEEPSPEED``
    naming the same file; the logs show qwZ, hpZ and qgZ at work."""
    deepspeed, two_machines = trainer_runs["deepspeed"], trainer_runs["two_machines"]
    for key in ("loss", "grad_norm", "eval_loss"):
        assert _series(deepspeed, key) == _series(two_machines, key), key
        assert _series(trainer_runs["accelerate_deepspeed"], key) == _series(deepspeed, key), key
    first = deepspeed[0]
    zero3 = trainer_runs["zero3"][0]
    gathered = {name: run["zeropp/fwd_allgather_intra_node_bytes"] + run["zeropp/fwd_allgather_inter_node_bytes"]
                for name, run in (("zeropp", first), ("zero3", zero3))}
    assert first["zeropp/fwd_allgather_inter_node_bytes"] > 0 and gathered["zeropp"] < 0.6 * gathered["zero3"]
    assert first["zeropp/bwd_allgather_inter_node_bytes"] == 0 and first["zeropp/bwd_allgather_intra_node_bytes"] > 0
    assert first["zeropp/qgz_inter_inter_node_bytes"] > 0
    assert _close(_series(deepspeed, "loss"), _series(trainer_runs["stock"], "loss"), 0.02)


def _start_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("hf_zeropp launch: accelerate.Accelerator"))


def test_the_start_line_describes_the_config_the_scripts_deepspeed_flag_gives_its_trainer(trainer_runs):
    """``hf-zeropp launch ... script --deepspeed=ds.json``: the launcher reads the script's flag (the Trainer's) and
    rank 0's start line describes the config the Trainer gets, ZeRO++'s three techniques included, word for word as
    it does when the launch's Accelerate YAML names the same file."""
    line = _start_line(trainer_runs["deepspeed_output"])
    assert "; config: stage 3, qwZ int8, hpZ over 2 ranks, qgZ int4/int4; 2 node(s) x 2 ranks" in line, line
    assert line == _start_line(trainer_runs["accelerate_deepspeed_output"])


# ---------------------------------------------------------------- TRL's own scripts


@pytest.fixture(scope="module")
def trl_runs(one_file_runs) -> dict[str, list[dict]]:
    pytest.importorskip("trl", reason="TRL is optional (pip install hf_zeropp[rlhf]); scripts/setup.sh installs it")
    return {f"{kind}_{way}": _logs(one_file_runs["work"] / f"{kind}_{way}" / "checkpoint-3")
            for kind in ("sft", "dpo") for way in ("launched", "imported")}


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trl_scripts_under_the_launcher_equal_the_ported_scripts(trl_runs, kind):
    """TRL's own ``trl.scripts.sft`` (ZeRO++ from the one-file YAML) and ``trl.scripts.dpo`` (a reference model too;
    ``--zeropp zero3`` parsed by TRL's own argument parser), unmodified: the same losses, bit for bit, as the scripts
    with their trainer ported to hf_zeropp's mixin by hand, and hf_zeropp's bytes in their logs. (The TRL trainers
    behind the mixin against stock TRL: tests/conformance/test_conformance.py.)"""
    launched, imported = trl_runs[f"{kind}_launched"], trl_runs[f"{kind}_imported"]
    assert len(_series(launched, "loss")) == 3
    for key in ("loss", "grad_norm"):
        assert _series(launched, key) == _series(imported, key), key
    first = launched[0]
    if kind == "sft":
        assert first["zeropp/fwd_allgather_inter_node_bytes"] > 0  # qwZ
        assert first["zeropp/bwd_allgather_inter_node_bytes"] == 0  # hpZ
        assert first["zeropp/qgz_inter_inter_node_bytes"] > 0  # qgZ
    else:
        assert first["zeropp/fwd_allgather_intra_node_bytes"] > 0 and "zeropp/qgz_inter_inter_node_bytes" not in first


# ---------------------------------------------------------------- failures


def test_a_failing_worker_ends_the_launch_with_its_traceback(tmp_path):
    """The rank that failed first: its traceback is the last thing printed, below the other ranks' errors."""
    result = subprocess.run([str(BIN / "hf-zeropp"), "launch", "--config_file", str(STOCK_CPU), "--num_processes", "2",
                             "--main_process_port", free_port(), str(LAUNCH_SCRIPTS / "fails_on_rank_1.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    ending = result.stderr[result.stderr.rindex("hf-zeropp launch: the workers failed"):].splitlines()
    # its exit code is 1, or -15 when torchrun's SIGTERM reached it after its traceback was recorded
    assert re.fullmatch(r"hf-zeropp launch: the workers failed; rank 1 failed first \(exit code (1|-15)\):", ending[0])
    assert ending[1].startswith("Traceback") and ending[-1] == "RuntimeError: rank 1 fails on purpose"


FAILS_ON_ONE_RANK = str(LAUNCH_SCRIPTS / "zeropp_fails_on_one_rank.py")
FIRST_FAILURE = "RuntimeError: rank 3 fails on purpose"


def _on_two_machines(command: list[str], machine_rank_flag: str, port_flag: str) -> list[str]:
    """``command SCRIPT`` started once per emulated machine (2 x 2 ranks on this one, rank 3 failing), with the
    machine's rank and a shared port; each one's output."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIL_RANK": "3"}
    machines = [subprocess.Popen([*command, machine_rank_flag, str(machine), port_flag, port, FAILS_ON_ONE_RANK],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for machine in range(2)]
    outputs = [machine.communicate(timeout=180)[0] for machine in machines]
    assert all(machine.returncode != 0 for machine in machines), outputs
    return outputs


def _summary_ends_with_first_failure(output: str, first_failure: str = FIRST_FAILURE) -> None:
    """torchrun's summary ends with its root cause's traceback: the first failure's, whichever rank it names."""
    root_cause = output[output.rindex("Root Cause (first observed failure)"):].rstrip("=\n ").splitlines()
    assert root_cause[-1].strip() == first_failure, "\n".join(root_cause)
    assert "To enable traceback" not in "\n".join(root_cause)


def test_a_failure_before_the_process_group_exists_writes_its_own_traceback(tmp_path):
    """No store to order failures by: the error file holds this rank's traceback, and the exception still prints."""
    error_file = tmp_path / "error.json"
    result = subprocess.run([sys.executable, "-c", "import hf_zeropp\nraise ValueError('bad data path')"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert result.returncode == 1 and result.stderr.strip().endswith("ValueError: bad data path")
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: bad data path" and "first_failed_rank" not in message["extraInfo"]
    assert message["extraInfo"]["py_callstack"].strip().endswith("ValueError: bad data path")


def test_under_stock_torchrun_every_machine_ends_with_the_first_failures_traceback():
    """Machine 0's ranks only fail because rank 3 (machine 1) died: torchrun names one of them as its root cause, and
    hf_zeropp's error file makes it end with rank 3's traceback."""
    outputs = _on_two_machines([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
                                "2", "--master_addr", "127.0.0.1"], "--node_rank", "--master_port")
    assert "Rank 3 failed before this rank; its traceback:" in outputs[0]
    for output in outputs:
        _summary_ends_with_first_failure(output)


def test_under_stock_accelerate_launch_the_summary_ends_with_the_failing_ranks_traceback():
    result = subprocess.run([str(BIN / "accelerate"), "launch", "--config_file", str(STOCK_CPU), "--num_processes", "2",
                             "--main_process_port", free_port(), FAILS_ON_ONE_RANK], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                         "ACCELERATE_USE_CPU": "true", "FAIL_RANK": "1"})
    assert result.returncode != 0
    _summary_ends_with_first_failure(result.stderr, "RuntimeError: rank 1 fails on purpose")


def test_the_launcher_on_two_machines_names_the_first_failure_on_both():
    outputs = _on_two_machines([str(BIN / "hf-zeropp"), "launch", "--config_file", str(STOCK_CPU), "--num_processes",
                                "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1"], "--machine_rank",
                               "--main_process_port")
    for machine, output in enumerate(outputs):
        ending = output[output.rindex("hf-zeropp launch: the workers failed"):].strip().splitlines()
        here = "exit code 1" if machine == 1 else r"on another machine; here rank [01] failed after it, exit code -?\d+"
        assert re.fullmatch(rf"hf-zeropp launch: the workers failed; rank 3 failed first \({here}\):", ending[0])
        assert ending[-1] == FIRST_FAILURE


def _refused(capsys, *argv: str) -> str:
    """``hf-zeropp launch ARGV`` in this process: status 2 and one line naming the problem, no worker started."""
    code = launch(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("hf-zeropp launch: error: "), (code, err)
    return err[0]


def test_bad_input_is_one_line_before_any_worker_starts(tmp_path, capsys):
    script = str(LAUNCH_SCRIPTS / "trainer_example.py")
    line = _refused(capsys, "--config_file", _write_yaml(tmp_path / "a.yaml", zeropp={"stage": 3, "qwz": True}),
                    script)
    assert "unknown hf_zeropp option(s) ['qwz']" in line
    line = _refused(capsys, "--config_file", _write_yaml(tmp_path / "b.yaml", distributed_type="MEGATRON_LM"), script)
    assert "distributed_type MEGATRON_LM conflicts" in line
    line = _refused(capsys, "--config_file", str(STOCK_CPU), "--use_megatron_lm", script)
    assert "distributed_type MEGATRON_LM conflicts" in line
    line = _refused(capsys, "--config_file", _write_yaml(
        tmp_path / "c.yaml", distributed_type="DEEPSPEED",
        deepspeed_config={"zero_stage": 3, "offload_param_device": "nvme", "offload_param_nvme_path": "/nvme"}), script)
    assert "zero_optimization.offload_param.device='nvme' (NVMe offload) is not supported by hf_zeropp; use" in line
    lamb = tmp_path / "lamb.json"
    lamb.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Lamb", "params": {}}}))
    line = _refused(capsys, "--config_file", _write_yaml(
        tmp_path / "d.yaml", distributed_type="DEEPSPEED", deepspeed_config={"deepspeed_config_file": str(lamb)}),
        script)
    assert "optimizer.type 'Lamb' is DeepSpeed's FusedLamb" in line and "use type 'AdamW'" in line
    line = _refused(capsys, "--config_file", str(STOCK_CPU), script, "--deepspeed", str(lamb))
    assert "optimizer.type 'Lamb'" in line
    line = _refused(capsys, "--config_file", _write_yaml(
        tmp_path / "e.yaml", distributed_type="DEEPSPEED", deepspeed_config={"deepspeed_config_file": str(
            _write_json(tmp_path / "batch.json", {"zero_optimization": {"stage": 2}, "train_batch_size": 64,
                                                   "train_micro_batch_size_per_gpu": 2}))}), script)
    assert ("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 64 != 2 * 1 * 4"
            in line)
    line = _refused(capsys, "--config_file", str(STOCK_CPU), str(tmp_path / "missing.py"))
    assert "missing.py' does not exist" in line
    line = _refused(capsys, "--config_file", str(STOCK_CPU), "-m", "no_such_module_here")
    assert "module 'no_such_module_here' (-m) is not importable" in line
    line = _refused(capsys, "--config_file", str(STOCK_CPU), "--zeropp", "zero4", script)
    assert "zero4" in line and "neither a preset" in line
    line = _refused(capsys, "--config_file", str(STOCK_CPU), "--max_restarts", "1", script)
    assert "--max_restarts 1 needs --rdzv_backend c10d" in line


def test_the_scripts_deepspeed_config_is_refused_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    """A config the script's ``--deepspeed`` gives its Trainer (both spellings) is checked against the launch here,
    as a config the launch names is: DeepSpeed's batch-size rule at the launch's 4 ranks, the key named with the fix;
    so is what the Trainer would refuse or silently not apply beside it."""
    script = str(LAUNCH_SCRIPTS / "trainer_example.py")
    batch = _write_json(tmp_path / "batch.json", {**DEEPSPEED_ZEROPP, "train_batch_size": 64,
                                                  "train_micro_batch_size_per_gpu": 2,
                                                  "gradient_accumulation_steps": 1})
    for flag in (["--deepspeed", str(batch)], [f"--deepspeed={batch}"]):
        line = _refused(capsys, "--config_file", str(STOCK_CPU), script, "--output_dir", "x", *flag)
        assert line.endswith("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size "
                             "64 != 2 * 1 * 4: set train_batch_size and train_micro_batch_size_per_gpu to \"auto\", "
                             "or make them agree"), line
    good = str(_write_json(tmp_path / "good.json", DEEPSPEED_ZEROPP))
    line = _refused(capsys, "--config_file", str(STOCK_CPU), script, "--zeropp", "zero3", "--deepspeed", good)
    assert "the script is given both --deepspeed and --zeropp; its Trainer takes one config" in line
    line = _refused(capsys, "--config_file", _write_yaml(tmp_path / "f.yaml", distributed_type="FSDP"), script,
                    "--deepspeed", good)
    assert f"the Accelerate config's FSDP settings and the script's --deepspeed {good} both configure" in line
    monkeypatch.setenv("ZEROPP_STAGE", "2")
    line = _refused(capsys, "--config_file", str(STOCK_CPU), script, "--deepspeed", good)
    assert f"ZEROPP_STAGE set in the environment would not apply: the script's --deepspeed {good} is the config" in line


def test_restarts_get_a_fresh_store_per_round_and_stock_torchrun_is_told_how(tmp_path):
    """The launcher asks torchrun for a fresh rendezvous store per round when workers may restart; a worker under
    stock torchrun that may restart without one names the fix (a restarted worker would read stale addresses)."""
    from hf_zeropp.engine.failure_report import restart_problem
    from hf_zeropp.integrations.launch import parser, prepare

    args = parser().parse_args(["--config_file", str(STOCK_CPU), "--max_restarts", "1", "--rdzv_backend", "c10d",
                                str(LAUNCH_SCRIPTS / "trainer_example.py")])
    assert prepare(args, tmp_path)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    args = parser().parse_args(["--config_file", str(STOCK_CPU), str(LAUNCH_SCRIPTS / "trainer_example.py")])
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in prepare(args, tmp_path)
    assert restart_problem({"TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert restart_problem({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}) is None
    problem = restart_problem({"TORCHELASTIC_MAX_RESTARTS": "2"})
    assert "TORCHELASTIC_MAX_RESTARTS=2" in problem and "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem
    assert "--rdzv-backend c10d" in problem


def test_the_console_script_refuses_before_starting_workers(tmp_path):
    result = subprocess.run([str(BIN / "hf-zeropp"), "launch", "--config_file", str(STOCK_CPU),
                             str(tmp_path / "missing.py")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"hf-zeropp launch: error: script '{tmp_path / 'missing.py'}' does not exist (working directory {os.getcwd()})"]


# ---------------------------------------------------------------- import alone changes nothing

_CHECK_INSTALL = """
import accelerate, transformers
from transformers import HfArgumentParser, Trainer, TrainingArguments
stock = (accelerate.Accelerator, Trainer.__init__, HfArgumentParser.__init__, TrainingArguments.__post_init__)
import hf_zeropp
from hf_zeropp.integrations import dropin
now = lambda: (accelerate.Accelerator, Trainer.__init__, HfArgumentParser.__init__, TrainingArguments.__post_init__)
assert now() == stock, "import hf_zeropp changed a stock name"
dropin.install()
assert accelerate.Accelerator is hf_zeropp.Accelerator and all(a is not b for a, b in zip(now()[1:], stock[1:]))
parser = HfArgumentParser(TrainingArguments)
(args,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--zeropp", "zero3", "--use_cpu"])
assert args.zeropp == "zero3"
dropin.uninstall()
assert now() == stock, "uninstall left a change"
print("ok")
"""


_CHECK_INSTALL_BEFORE_IMPORT = """
import sys
from hf_zeropp.integrations import dropin
dropin.install()
deferred = ("transformers.trainer", "transformers.training_args", "transformers.hf_argparser")
assert not any(name in sys.modules for name in deferred), [name for name in deferred if name in sys.modules]
import importlib.util
assert importlib.util.find_spec("transformers.trainer") is not None  # found, not imported: still to be changed
from transformers import HfArgumentParser, Trainer, TrainingArguments
changed = lambda: [f.__code__.co_filename == dropin.__file__ for f in (Trainer.__init__, HfArgumentParser.__init__,
                                                                         TrainingArguments.__post_init__)]
assert changed() == [True, True, True]
(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", "x", "--zeropp", "zero2",
                                                                           "--use_cpu"])
assert args.zeropp == "zero2"
dropin.uninstall()
assert changed() == [False, False, False]
print("ok")
"""


@pytest.mark.parametrize("check", [_CHECK_INSTALL, _CHECK_INSTALL_BEFORE_IMPORT], ids=["imported", "not-yet-imported"])
def test_import_installs_nothing_and_uninstall_restores_stock(check):
    """Installed where the script has imported transformers' Trainer already, and where it has not: then the Trainer,
    its arguments and the argument parser change when the script first imports them, and a script that never does
    is spared the import."""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


def test_prepare_rewrites_the_yaml_and_hands_the_resolved_config_to_the_workers(tmp_path):
    """What reaches Accelerate and the workers: the YAML without ``zeropp:`` and DeepSpeed, MULTI_GPU with
    ``ACCELERATE_USE_CPU`` on a machine without GPUs, ``python -m hf_zeropp.integrations.dropin SCRIPT ARGS``, and the
    config as JSON with ``--zeropp`` over the YAML."""
    from hf_zeropp import ZeroPPConfig
    from hf_zeropp.integrations.launch import parser, prepare

    script = str(LAUNCH_SCRIPTS / "trainer_example.py")
    config_file = _write_yaml(tmp_path / "in.yaml", distributed_type="MULTI_CPU", use_cpu=True,
                              zeropp={"preset": "zeropp", "node_size": 2})
    args = parser().parse_args(["--config_file", config_file, script, "--max_steps", "1"])
    environment = prepare(args, tmp_path)
    written = yaml.safe_load(Path(args.config_file).read_text())
    assert "zeropp" not in written and written["num_processes"] == 4
    if not torch.cuda.is_available():
        assert (written["distributed_type"], written["use_cpu"], environment["ACCELERATE_USE_CPU"]) == (
            "MULTI_GPU", False, "true")
    assert (args.training_script, args.module) == ("hf_zeropp.integrations.dropin", True)
    assert args.training_script_args == [script, "--max_steps", "1"]
    resolved = ZeroPPConfig.from_dict(json.loads(environment["ZEROPP_CONFIG"]))
    assert resolved == ZeroPPConfig.preset("zeropp", node_size=2)
    assert environment["PYTHONPATH"].split(os.pathsep)[0] == str(LAUNCH_SCRIPTS)

    args = parser().parse_args(["--config_file", config_file, "--zeropp", "zero2", script])
    assert json.loads(prepare(args, tmp_path)["ZEROPP_CONFIG"]) == ZeroPPConfig.preset("zero2").to_dict()

    deepspeed = tmp_path / "ds.json"
    deepspeed.write_text(json.dumps(DEEPSPEED_ZEROPP))
    args = parser().parse_args(["--config_file", _write_yaml(
        tmp_path / "ds.yaml", distributed_type="DEEPSPEED", deepspeed_config={"deepspeed_config_file": str(deepspeed),
                                                                              "zero3_save_16bit_model": True}), script])
    environment = prepare(args, tmp_path)
    written = yaml.safe_load(Path(args.config_file).read_text())
    assert "deepspeed_config" not in written and written["distributed_type"] == "MULTI_GPU" and not args.use_deepspeed
    mapped = ZeroPPConfig.from_dict(json.loads(environment["ZEROPP_CONFIG"]))
    assert mapped == ZeroPPConfig(stage=3, quantized_weights=True, hpz_partition_size=2, quantized_gradients=True,
                                  **DEEPSPEED_STAGE3,
                                  deepspeed_training={key: DEEPSPEED_ZEROPP[key] for key in (
                                      "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16")})
    # the DeepSpeed config, as Accelerate's plugin makes it, for scripts that read accelerator.state.deepspeed_plugin
    assert json.loads(environment[PLUGIN_VARIABLE]) == DEEPSPEED_ZEROPP

    # the script's own --deepspeed replaces the YAML's zeropp:, as its Trainer will: the workers describe that one
    args = parser().parse_args(["--config_file", config_file, script, "--deepspeed", str(deepspeed)])
    environment = prepare(args, tmp_path)
    assert ZeroPPConfig.from_dict(json.loads(environment["ZEROPP_CONFIG"])) == ZeroPPConfig.coerce(str(deepspeed))
    assert PLUGIN_VARIABLE not in environment  # the Trainer's accelerator shows no plugin
