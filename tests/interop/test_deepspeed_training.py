"""A DeepSpeed config trains under hf_zeropp as DeepSpeed trains it: its optimizer, scheduler, clipping,
accumulation, batch sizes and fp16 loss scaling, with "auto" filled where Transformers and Accelerate fill it, and
its offload as FSDP2's CPUOffloadPolicy.

The reference is DeepSpeed 0.19.8 itself, through fixtures it wrote (scripts/deepspeed_reference): the same stock
Trainer and Accelerate scripts (tests/launch_scripts/deepspeed_*.py) run under DeepSpeed and under ``hf-zeropp
launch``, on 4 CPU ranks; the learning rate must be DeepSpeed's at every step, the losses and gradient norms within
DeepSpeed's own distance from a single process (or 1e-6, fp32's floor) of DeepSpeed run with torch's Adam, and
within the distance between DeepSpeed's two Adam kernels of DeepSpeed run with its own. The DeepSpeed lane
(``-m deepspeed``) checks the "auto" rules, the loss scaler and these fixtures against Transformers' and DeepSpeed's
own code live.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import background
import pytest
import torch
from launching import hf_zeropp_launch
from paths import DEEPSPEED_FIXTURES, ROOT

import hf_zeropp
from hf_zeropp.interop.deepspeed.config import STAGE3_DEFAULTS, deepspeed_key_table, options_from_deepspeed
from hf_zeropp.interop.deepspeed.training import (DeepSpeedLossScaler, check_batch_sizes, fill_from_accelerator,
                                                  fill_from_training_arguments)
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import full_parameters, make_optimizer, tiny_gpt2, train

CONFIGS = DEEPSPEED_FIXTURES / "configs"
RUNS = json.loads((DEEPSPEED_FIXTURES / "training_runs.json").read_text())
EXAMPLE = json.loads((DEEPSPEED_FIXTURES / "accelerate_example.json").read_text())
FP32_FLOOR = 1e-6


def _config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def _training(name: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ignored tuning keys
        return options_from_deepspeed(_config(name))["deepspeed_training"]


def _arguments(**overrides):
    from transformers import TrainingArguments

    values = dict(output_dir="unused", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  learning_rate=1e-3, weight_decay=0.01, max_grad_norm=0.5, warmup_steps=3, adam_beta2=0.95,
                  use_cpu=True, report_to="none")
    return TrainingArguments(**{**values, **overrides})


# ---------------------------------------------------------------- the config, key by key


def test_transformers_docs_configs_map_stage_offload_and_the_training_loop():
    """The Transformers documentation's ZeRO-3 and ZeRO-2 examples: the stage, their CPU offloads as
    ``cpu_offload``, every training-loop section carried (through the launcher's JSON too), and one warning that
    names exactly the DeepSpeed-only tuning keys it ignores."""
    with pytest.warns(UserWarning) as caught:
        zero3 = hf_zeropp.ZeroPPConfig.coerce(str(CONFIGS / "zero3_docs.json"))
    ignored = [str(w.message) for w in caught if "ignores DeepSpeed-only tuning keys" in str(w.message)]
    assert len(ignored) == 1 and all(key in ignored[0] for key in (
        "zero_optimization.overlap_comm", "zero_optimization.offload_param.pin_memory", "steps_per_print",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save")), ignored
    assert "wall_clock_breakdown" not in ignored[0]  # false: nothing asked
    assert (zero3.stage, zero3.cpu_offload, zero3.mixed_precision) == (3, True, "no")
    assert set(zero3.deepspeed_training) == {"optimizer", "scheduler", "gradient_clipping",
                                             "gradient_accumulation_steps", "train_batch_size",
                                             "train_micro_batch_size_per_gpu", "fp16", "bf16"}
    assert hf_zeropp.ZeroPPConfig.from_env({"ZEROPP_CONFIG": json.dumps(zero3.to_dict())}) == zero3
    with pytest.warns(UserWarning, match="ignores DeepSpeed-only tuning keys"):
        zero2 = hf_zeropp.ZeroPPConfig.coerce(_config("zero2_docs"))
    assert (zero2.stage, zero2.cpu_offload) == (2, True)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["zero_optimization"].update(offload_param={"device": "nvme", "nvme_path": "/nvme"}),
     r"zero_optimization.offload_param.device='nvme' \(NVMe offload\) is not supported by hf_zeropp; use device "
     r"'cpu'"),
    (lambda c: c["zero_optimization"]["offload_optimizer"].update(ratio=0.3),
     r"zero_optimization.offload_optimizer.ratio=0.3 offloads part of the optimizer state"),
    (lambda c: c.update(amp={"enabled": True}), r"DeepSpeed config key 'amp' \(apex AMP; use fp16 or bf16"),
    (lambda c: c.update(bfloat16={"enabled": True}), r"'bfloat16' section is the old spelling of 'bf16'"),
    (lambda c: c.update(data_types={"grad_accum_dtype": "bf16"}), r"'data_types' \(DeepSpeed's gradient-accumul"),
    (lambda c: c["optimizer"].update(type="Lamb"), r"optimizer.type 'Lamb' is DeepSpeed's FusedLamb"),
    (lambda c: c["scheduler"].update(type="Plateau"), r"scheduler"),
    (lambda c: c["fp16"].update(fp16_master_weights_and_grads=True), r"fp16 has keys \['fp16_master_weights_and_"),
    (lambda c: c.update(gradient_clipping="1.0"), r"gradient_clipping='1.0' must be a number or \"auto\""),
    (lambda c: c.update(communication_data_type="int8"), r"communication_data_type='int8' is not one of"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_key(change, message):
    config = _config("zero2_docs")
    change(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=message):
            hf_zeropp.ZeroPPConfig.coerce(config)


def test_switched_off_sections_and_dtypes_map_quietly():
    """A section with ``enabled: false`` asks nothing (refused sections included); ``communication_data_type`` is
    the reduction dtype."""
    config = {"zero_optimization": {"stage": 3}, "amp": {"enabled": False}, "compile": {"enabled": False},
              "communication_data_type": "bf16"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert options_from_deepspeed(config) == {"stage": 3, "reduce_dtype": "bf16", **STAGE3_DEFAULTS}


def test_shard_model_refuses_a_training_loop_it_would_not_run():
    model = tiny_gpt2()
    config = hf_zeropp.ZeroPPConfig.coerce({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}})
    with pytest.raises(ValueError, match=r"the DeepSpeed config's optimizer belong to the training loop, which "
                                         r"shard_model does not run: train with the Trainer integration or "
                                         r"hf_zeropp.Accelerator"):
        hf_zeropp.shard_model(model, config)


def test_docs_list_every_deepspeed_key():
    assert deepspeed_key_table() in (ROOT / "docs" / "design.md").read_text()


# ---------------------------------------------------------------- "auto" as Transformers and Accelerate fill it


def test_trainer_fills_auto_from_training_arguments_as_transformers_does():
    args = _arguments()
    loop = fill_from_training_arguments(_training("zero3_docs"), args, num_training_steps=40)
    assert loop.optimizer["params"] == {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    assert loop.scheduler["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}
    assert (loop.gradient_clipping, loop.gradient_accumulation_steps) == (0.5, 2)
    assert (loop.sections["train_micro_batch_size_per_gpu"], loop.sections["train_batch_size"]) == (2, 4)
    assert loop.sections["fp16"]["enabled"] is False and loop.sections["bf16"]["enabled"] is False
    decay = fill_from_training_arguments(_training("warmup_decay"), _arguments(warmup_steps=0), 40)
    assert decay.scheduler["params"]["total_num_steps"] == 40
    assert decay.scheduler["params"]["warmup_num_steps"] == 1  # Transformers keeps it positive (DeepSpeed >= 0.19.6)


def test_trainer_refuses_explicit_values_that_disagree_with_transformers_message():
    sections = _training("zero3_docs")
    sections["optimizer"]["params"].update(lr=3e-5, betas=[0.9, 0.999])
    sections["scheduler"]["params"]["warmup_num_steps"] = 10
    sections["gradient_clipping"] = 1.0
    with pytest.raises(ValueError) as raised:
        fill_from_training_arguments(sections, _arguments(), 40)
    assert str(raised.value) == (
        "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
        "- ds gradient_clipping=1.0 vs hf max_grad_norm=0.5\n"
        "- ds optimizer.params.lr=3e-05 vs hf learning_rate=0.001\n"
        "- ds optimizer.params.betas=[0.9, 0.999] vs hf adam_beta1+adam_beta2=[0.9, 0.95]\n"
        "- ds scheduler.params.warmup_num_steps=10 vs hf warmup_steps=3\n"
        "The easiest method is to set these DeepSpeed config values to 'auto'.")


def _accelerate_fill(name, **placeholders):
    return fill_from_accelerator(_training(name), gradient_accumulation_steps=2, mixed_precision="no",
                                 num_processes=4, split_batches=False, micro_batch_size=2, **placeholders)


def test_accelerator_fills_auto_from_dummy_optim_and_scheduler_as_accelerate_does():
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    optimizer = DummyOptim([torch.nn.Parameter(torch.ones(2))], lr=0.02, weight_decay=0.1)
    loop = _accelerate_fill("accelerate_zero3_offload", optimizer=optimizer,
                            scheduler=DummyScheduler(optimizer, total_num_steps=48, warmup_num_steps=0))
    assert loop.optimizer["params"] == {"lr": 0.02, "weight_decay": 0.1}
    assert loop.scheduler["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 1,
                                        "total_num_steps": 12}  # per process: the engine steps it once per step
    assert (loop.gradient_clipping, loop.gradient_accumulation_steps) == (1.0, 1)  # the config's 1, not 2
    assert (loop.sections["train_micro_batch_size_per_gpu"], loop.sections["train_batch_size"]) == (2, 8)


def test_accelerator_refuses_what_accelerate_refuses_with_its_messages():
    """The Transformers docs' "auto" betas (only the Trainer fills them), and the script's objects against the
    config's sections; the first message is Accelerate's own (its DeepSpeedPlugin, run here without DeepSpeed)."""
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    params = [torch.nn.Parameter(torch.ones(2))]
    plugin = DeepSpeedPlugin(hf_ds_config=_config("zero3_docs"))
    plugin.set_mixed_precision("no")  # what the Accelerator does first
    with pytest.raises(ValueError) as accelerates:  # then what its prepare fills in
        plugin.deepspeed_config_process(must_match=False, **{"optimizer.params.lr": 1e-3, "gradient_clipping": 1.0,
                                                             "optimizer.params.weight_decay": 0.0})
    with pytest.raises(ValueError) as ours:
        _accelerate_fill("zero3_docs", optimizer=DummyOptim(params))
    assert str(ours.value) == str(accelerates.value)
    with pytest.raises(ValueError, match="You cannot specify an optimizer in the config file and in the code"):
        _accelerate_fill("warmup_decay", optimizer=torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="You cannot create a `DummyOptim` without specifying an optimizer"):
        _accelerate_fill("trainer_optimizer", optimizer=DummyOptim(params))
    with pytest.raises(ValueError, match="Either specify a scheduler in the config file or pass in the "
                                         "`lr_scheduler_callable`"):
        _accelerate_fill("trainer_optimizer", scheduler=DummyScheduler(torch.optim.SGD(params, lr=0.1)))


def test_batch_sizes_follow_deepspeeds_rule():
    check_batch_sizes({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": 2}, world_size=4)
    with pytest.raises(ValueError, match=r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step "
                                         r"\* world_size 64 != 2 \* 2 \* 4"):
        check_batch_sizes({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                           "gradient_accumulation_steps": 2}, world_size=4)


# ---------------------------------------------------------------- fp16 loss scaling


@pytest.fixture(scope="module")
def one_rank_group():
    """The sharded scaler agrees on overflows over its process group: one rank here."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _our_scales(fp16: dict, pattern: list[int], scaler: DeepSpeedLossScaler | None = None
                ) -> tuple[list[float], int | None, DeepSpeedLossScaler]:
    """Drive DeepSpeedLossScaler through real scaled backward passes, overflowing (an inf gradient) where asked;
    returns the scale after each update, the step that stopped the run (or None) and the scaler."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = scaler or DeepSpeedLossScaler(fp16, device="cpu")
    scales = []
    for step, overflow in enumerate(pattern):
        loss = model(torch.ones(1, 2)).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        try:
            scaler.update()
        except FloatingPointError:
            return scales, step, scaler
        scales.append(scaler.get_scale())
        optimizer.zero_grad()
    return scales, None, scaler


def test_loss_scaler_follows_deepspeeds_rule(one_rank_group):
    fixture = json.loads((DEEPSPEED_FIXTURES / "loss_scale.json").read_text())
    for name, case in fixture["cases"].items():
        scales, stops_at, _ = _our_scales(case["fp16"], fixture["pattern"])
        assert (scales, stops_at) == (case["scales"], case["stops_at"]), name


def test_accelerator_scales_fp16_losses_by_the_configs_rule():
    """A DeepSpeed config's fp16 section gives hf_zeropp's Accelerator DeepSpeed's scaler with its keys."""
    config = _config("zero2_docs")
    config["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 3, "loss_scale_window": 50,
                      "min_loss_scale": 8}
    config["bf16"] = {"enabled": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ignored tuning keys
        accelerator = hf_zeropp.Accelerator(zeropp=config, cpu=True)
    scaler = accelerator.scaler
    assert isinstance(scaler, DeepSpeedLossScaler)
    assert (scaler.get_scale(), scaler.delayed_shift, scaler._growth_interval, scaler.min_scale) == (4096.0, 3, 50, 8)


def test_loss_scaler_resumes_mid_hysteresis_from_its_state(one_rank_group):
    """A checkpoint taken between two overflows of a hysteresis resumes on the same scales."""
    fp16 = {"initial_scale_power": 8, "loss_scale_window": 4, "hysteresis": 3}
    pattern = [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1]
    whole, _, _ = _our_scales(fp16, pattern)
    _, _, first = _our_scales(fp16, pattern[:3])
    resumed = DeepSpeedLossScaler(fp16, device="cpu")
    resumed.load_state_dict(first.state_dict())
    assert _our_scales(fp16, pattern[3:], resumed)[0] == whole[3:]


# ---------------------------------------------------------------- the same scripts under DeepSpeed and hf_zeropp


def _distance(first: list[float], second: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(first, second))


def _own_distance(reference: dict, quantity: str) -> list[float]:
    """How far DeepSpeed's 4-rank run lies from its own single process at its worst step, at each step at least
    fp32's floor (1e-6 of the value)."""
    four = reference["world4"][quantity]
    spread = _distance(four, reference["world1"][quantity])
    return [max(spread, FP32_FLOOR * abs(value)) for value in four]


def _off_by(ours: list[float], theirs: list[float], tolerance: list[float]) -> float:
    """The largest amount by which ``ours`` leaves ``theirs`` ± ``tolerance`` (<= 0: within at every step)."""
    assert len(ours) == len(theirs) > 0
    return max(abs(a - b) - t for a, b, t in zip(ours, theirs, tolerance))


@pytest.fixture(scope="module")
def launched(deepspeed_config_runs) -> dict[str, dict]:
    return {path: json.loads((deepspeed_config_runs / f"{path}.json").read_text())
            for path in ("trainer", "accelerate")}


CASES = [(path, name) for path in ("trainer", "accelerate") for name in sorted(RUNS[path])]


@pytest.mark.parametrize("path, name", CASES)
def test_learning_rate_is_deepspeeds_at_every_step(launched, path, name):
    """The learning rate each optimizer step applies, and on the Trainer path the one it logs (after the step's
    scheduler step, as under DeepSpeed): DeepSpeed's, for every scheduler and both "auto" rules."""
    ours, reference = launched[path][name], RUNS[path][name]["world4"]
    assert len(ours["applied_lr"]) == len(reference["applied_lr"]) == RUNS["steps"]
    assert ours["applied_lr"] == pytest.approx(reference["applied_lr"], rel=1e-12, abs=0)
    if path == "trainer":
        assert ours["logged_lr"] == pytest.approx(reference["logged_lr"], rel=1e-12, abs=0)


@pytest.mark.parametrize("path, name", CASES)
def test_losses_and_gradient_norms_equal_deepspeed_with_torchs_adam_within_its_own_distance(launched, path, name):
    """DeepSpeed run with ``torch_adam: true`` steps torch's Adam/AdamW, the kernel hf_zeropp steps: hf_zeropp's
    losses and gradient norms lie within DeepSpeed's own distance from a single process (at least 1e-6)."""
    ours, reference = launched[path][name], RUNS[path][name]
    for quantity in ("loss", "grad_norm"):
        off = _off_by(ours[quantity], reference["world4_torch_adam"][quantity], _own_distance(reference, quantity))
        assert off <= 0, (quantity, ours[quantity], reference["world4_torch_adam"][quantity])


@pytest.mark.parametrize("path, name", CASES)
def test_losses_and_gradient_norms_equal_deepspeeds_own_adam_within_the_distance_of_its_two_adams(launched, path,
                                                                                                  name):
    """Against DeepSpeed with its own fused Adam kernel, whose rounding differs from torch's by about 2e-7 of a
    weight per step (tests/interop/test_deepspeed_optim.py) and, through Adam's division by the root of the second
    moment, moves gradient norms by up to 5e-6 over 12 steps: hf_zeropp lies within DeepSpeed's own distance between its
    two Adam kernels, plus its distance from a single process."""
    ours, reference = launched[path][name], RUNS[path][name]
    for quantity in ("loss", "grad_norm"):
        kernels = _distance(reference["world4"][quantity], reference["world4_torch_adam"][quantity])
        tolerance = [kernels + own for own in _own_distance(reference, quantity)]
        off = _off_by(ours[quantity], reference["world4"][quantity], tolerance)
        assert off <= 0, (quantity, ours[quantity], reference["world4"][quantity])


@background.launches("accelerate_example_run")
def _accelerate_example_launch(work: Path) -> dict:
    hf_zeropp_launch("--config_file", str(DEEPSPEED_FIXTURES / "accelerate_example" / "accelerate.yaml"),
                     EXAMPLE["script"], *EXAMPLE["arguments"], "--record", str(work / "record.json"))
    return json.loads((work / "record.json").read_text())


@pytest.fixture(scope="module")
def accelerate_example_run() -> dict:
    """Accelerate's own DeepSpeed example shape (tests/launch_scripts/accelerate_deepspeed_example.py) under
    ``hf-zeropp launch`` with the Accelerate YAML DeepSpeed ran it with (distributed_type DEEPSPEED, a DeepSpeed config
    file with optimizer and scheduler sections; made in the background, tests/background.py): its record."""
    return background.result("accelerate_example_run")


def test_accelerates_deepspeed_example_trains_with_the_configs_optimizer_and_schedule(accelerate_example_run):
    """The script reads ``accelerator.state.deepspeed_plugin.deepspeed_config`` to choose ``DummyOptim`` /
    ``DummyScheduler`` and its accumulation steps, as under DeepSpeed, while ``distributed_type`` is Accelerate's
    MULTI_CPU (hf_zeropp.integrations.deepspeed_plugin says why). It then trains with the config's AdamW and WarmupCosineLR, its
    "auto" filled from them as Accelerate fills it (total steps divided by the process count): the learning rate
    DeepSpeed 0.19.8 applied at every step, and losses within fp32's floor (1e-6) of DeepSpeed run with torch's AdamW
    (the kernel hf_zeropp steps), and within the distance between DeepSpeed's two Adam kernels of DeepSpeed with its
    own (tests/fixtures/deepspeed/accelerate_example.json)."""
    ours, deepspeed, torch_adam = accelerate_example_run, EXAMPLE["deepspeed_adam"], EXAMPLE["torch_adam"]
    assert deepspeed["seen"]["distributed_type"] == "DEEPSPEED"
    assert ours["seen"] == {**deepspeed["seen"], "distributed_type": "MULTI_CPU", "deepspeed": False}
    assert ours["seen"]["optimizer_class"] == "DummyOptim" and ours["seen"]["scheduler_class"] == "DummyScheduler"
    assert len(ours["applied_lr"]) == len(deepspeed["applied_lr"]) == 16
    assert ours["applied_lr"] == pytest.approx(deepspeed["applied_lr"], rel=1e-12, abs=0)
    assert deepspeed["applied_lr"][0] == 0.0 and deepspeed["applied_lr"][-1] == pytest.approx(1e-3)  # the schedule
    assert max(deepspeed["applied_lr"]) > 9e-3  # warmed up to the script's 1e-2 and decayed by its cosine
    for quantity in ("loss", "eval_loss"):
        floor = [FP32_FLOOR * abs(value) for value in torch_adam[quantity]]
        assert _off_by(ours[quantity], torch_adam[quantity], floor) <= 0, (quantity, ours[quantity])
        kernels = _distance(deepspeed[quantity], torch_adam[quantity])
        assert _off_by(ours[quantity], deepspeed[quantity], [kernels + f for f in floor]) <= 0, quantity
    assert ours["loss"][-1] < ours["loss"][0] - 0.5


# ---------------------------------------------------------------- offload


def _train_offloaded(configs: dict[str, dict]) -> dict:
    out = {}
    for name, options in configs.items():
        model = tiny_gpt2()
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig.from_dict(options))
        optimizer = make_optimizer(model)
        losses = train(model, optimizer, range(4))
        out[name] = {"losses": losses, "params": full_parameters(model),
                     "offload": hf_zeropp.comm_stats(model)["implementations"].get("cpu_offload")}
    return out


def test_cpu_offload_trains_exactly_as_without_it_with_every_technique():
    """FSDP2's CPUOffloadPolicy on a CPU-only run moves nothing, so offloaded training must equal the same run
    without it (here bit for bit, within the 1e-6 the rules ask), for ZeRO-1, ZeRO-3, ZeRO++ (qwZ, hpZ, qgZ) and
    hybrid-q, 2 nodes x 2 ranks; comm_stats says what was offloaded."""
    presets = {"zero1": {"stage": 1}, "zero3": {"stage": 3}, "zeropp": {"preset": "zeropp"},
               "hybrid-q": {"preset": "hybrid-q"}}
    configs = {**presets,
               **{f"{name} offloaded": {**options, "cpu_offload": True} for name, options in presets.items()}}
    result = run_distributed(_train_offloaded, 4, configs, node_size=2)[0]
    for name in presets:
        plain, offloaded = result[name], result[f"{name} offloaded"]
        assert offloaded["losses"] == pytest.approx(plain["losses"], rel=FP32_FLOOR, abs=0), name
        for key, value in plain["params"].items():
            assert torch.allclose(offloaded["params"][key], value, rtol=FP32_FLOOR, atol=0), (name, key)
        assert plain["offload"] is None
        assert offloaded["offload"] == ["FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state "
                                        "in CPU memory, optimizer step on the CPU (a CPU-only run: the compute device "
                                        "is the CPU too, so nothing moves)"]


# ---------------------------------------------------------------- against Transformers' and DeepSpeed's own code


@pytest.mark.deepspeed
@pytest.mark.parametrize("overrides", [{}, {"learning_rate": 3e-4, "gradient_accumulation_steps": 1},
                                       {"max_grad_norm": 0.0, "warmup_steps": 0}])
@pytest.mark.parametrize("name", ["zero3_docs", "warmup_decay", "warmup_cosine", "one_cycle"])
def test_trainer_fill_equals_transformers_own(name, overrides):
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args = _arguments(**overrides)
    theirs = HfTrainerDeepSpeedConfig(copy.deepcopy(_config(name)))
    theirs.trainer_config_process(args)
    theirs.trainer_config_finalize(args, tiny_gpt2(), 40)
    ours = fill_from_training_arguments(_training(name), args, 40)
    assert {key: value for key, value in theirs.config.items() if key in ours.sections} == ours.sections


@pytest.mark.deepspeed
def test_trainer_mismatch_message_equals_transformers_own():
    pytest.importorskip("deepspeed")
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = _config("zero3_docs")
    config["optimizer"]["params"].update(lr=3e-5, eps=1e-6)
    config["train_batch_size"] = 64
    args = _arguments()
    theirs = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    theirs.trainer_config_process(args)
    with pytest.raises(ValueError) as expected:
        theirs.trainer_config_finalize(args, tiny_gpt2(), 40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sections = options_from_deepspeed(config)["deepspeed_training"]
    with pytest.raises(ValueError) as raised:
        fill_from_training_arguments(sections, args, 40)
    assert str(raised.value) == str(expected.value)


@pytest.mark.deepspeed
def test_loss_scaler_fixture_is_what_this_deepspeed_writes():
    pytest.importorskip("deepspeed")
    from scripts.deepspeed_reference import loss_scale

    import deepspeed
    import deepspeed.comm

    fixture = json.loads((DEEPSPEED_FIXTURES / "loss_scale.json").read_text())
    if not deepspeed.comm.is_initialized():  # the scaler says on rank 0 what it did
        for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29682", RANK="0", LOCAL_RANK="0",
                                WORLD_SIZE="1").items():
            os.environ.setdefault(name, value)
        deepspeed.init_distributed("gloo")
    for name, case in fixture["cases"].items():
        live = loss_scale.deepspeed_scales(case["fp16"])
        assert (live["scales"], live["stops_at"]) == (case["scales"], case["stops_at"]), name


@pytest.mark.deepspeed
def test_training_runs_fixture_is_what_this_deepspeed_writes(tmp_path):
    """DeepSpeed trains the scripts again (about 7 minutes on 2 cores): the committed fixture is what it writes."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    output = tmp_path / "training_runs.json"
    subprocess.run([sys.executable, "-m", "scripts.deepspeed_reference.training_runs", "--output", str(output)],
                   cwd=ROOT, check=True, capture_output=True)
    live = json.loads(output.read_text())
    for path, name in CASES:
        for run, record in RUNS[path][name].items():
            for quantity, values in record.items():
                assert live[path][name][run][quantity] == pytest.approx(values, rel=FP32_FLOOR), (path, name, run)


@pytest.mark.deepspeed
def test_accelerate_example_fixture_is_what_this_deepspeed_writes(tmp_path):
    """DeepSpeed runs Accelerate's DeepSpeed example shape again (about 2 minutes on 2 cores): the committed fixture
    is what it writes."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    output = tmp_path / "accelerate_example.json"
    subprocess.run([sys.executable, "-m", "scripts.deepspeed_reference.accelerate_example", "--output", str(output)],
                   cwd=ROOT, check=True, capture_output=True)
    live = json.loads(output.read_text())
    for run in ("deepspeed_adam", "torch_adam"):
        assert live[run]["seen"] == EXAMPLE[run]["seen"], run
        for quantity in ("applied_lr", "loss", "eval_loss"):
            assert live[run][quantity] == pytest.approx(EXAMPLE[run][quantity], rel=FP32_FLOOR), (run, quantity)
