"""DeepSpeed checkpoints both ways, against what DeepSpeed 0.19.8 itself did, without DeepSpeed installed.

The fixtures in tests/fixtures/deepspeed/checkpoints were written by DeepSpeed (``python -m
scripts.deepspeed_reference.checkpoints`` in .venv-deepspeed): ZeRO-1, 2 and 3 partitions from 2 and 4 ranks in fp32,
bf16 and fp16, DeepSpeed's own scheduler, a universal checkpoint made by ``ds_to_universal``, and a Trainer
``checkpoint-6`` from a stock Trainer script under DeepSpeed ZeRO-3. Each records what DeepSpeed's own resume gave
over the next steps. hf_zeropp resumes each on another world size and preset and must give the same learning rates
and, for losses and final weights, stay within twice DeepSpeed's own distance from one process training the same
steps unsharded (the bound when hf_zeropp is as close to that process as DeepSpeed is; fp32 runs have a floor of
1e-6). The live comparisons with DeepSpeed running are in tests/checkpoint/test_deepspeed_checkpoint_lane.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from paths import DEEPSPEED_FIXTURES, ROOT

from hf_zeropp.interop.deepspeed.checkpoint import find_deepspeed_folder, read_deepspeed_checkpoint
from hf_zeropp.checkpoint.deepspeed_convert import convert_deepspeed_checkpoint
from hf_zeropp.interop.deepspeed.files import DeepSpeedCheckpointError, load_file as load_deepspeed_file
from hf_zeropp.checkpoint.deepspeed_restore import load_deepspeed_checkpoint
from hf_zeropp.testing.spawn import run_distributed
from scripts.deepspeed_reference import recipe

FIXTURES = DEEPSPEED_FIXTURES / "checkpoints"
TRAINER = FIXTURES / "trainer_zero3_bf16_w4"
SAVED_AT = recipe.STEPS_BEFORE_SAVE
FLOOR = 1e-6

# fixture -> (hf_zeropp preset, precision) per launch: each DeepSpeed world size resumed on the other one
ON_FOUR_RANKS = {"zero1_fp32_w2": "zero2", "zero2_bf16_w2": "zero3", "zero3_fp32_w2": "hybrid",
                 "zero2_fp16_w2": "zero3", "zero2_fp32_w2_warmupdecay": "zero1",
                 "zero1_bf16_fp32_accumulation_w2": "zero3"}
ON_TWO_RANKS = {"zero1_bf16_w4": "zero1", "zero2_fp32_w4": "zero3", "zero3_bf16_w4": "zero3",
                "universal_from_zero2_fp32_w4": "zero2"}


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def tolerance(name: str, key: str) -> float:
    """Twice DeepSpeed's own distance from one unsharded process (the universal fixture: its source's)."""
    record = expected(name)
    distance = record.get("distance") or expected(record["source"])["distance"]
    return 2 * distance[key] + FLOOR


# ---------------------------------------------------------------- reading the files, one process


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file()))
def test_every_fixture_reads_as_deepspeed_wrote_it(name):
    record = expected(name)
    checkpoint = read_deepspeed_checkpoint(FIXTURES / name / "checkpoint")
    assert checkpoint.layout == ("universal" if record.get("universal") else "zero")
    written_by = expected(record["source"])["world"] if "source" in record else record["world"]
    assert (checkpoint.stage, checkpoint.world_size) == (record["stage"], written_by)
    assert checkpoint.global_steps == SAVED_AT and checkpoint.ds_version == "0.19.8"
    assert len(checkpoint.parameters) == 28 and checkpoint.shared == {"lm_head.weight": "transformer.wte.weight"}
    assert {entry.step for entry in checkpoint.parameters.values()} == {float(SAVED_AT)}
    assert all(set(entry.state) == {"exp_avg", "exp_avg_sq"} for entry in checkpoint.parameters.values())
    assert [group["weight_decay"] for group in checkpoint.param_groups] == [recipe.WEIGHT_DECAY, 0.0]
    schedule = checkpoint.lr_scheduler
    if "scheduler" in record:  # DeepSpeed's own scheduler
        assert schedule == {"last_batch_iteration": SAVED_AT - 1}
    elif record.get("accelerate"):  # Accelerate keeps the script's scheduler itself, stepped once per process
        assert schedule is None
        own = torch.load(FIXTURES / name / "checkpoint" / "scheduler.bin", weights_only=True)
        assert own["last_epoch"] == SAVED_AT * record["world"]
    else:  # the script's scheduler, which DeepSpeed's engine steps
        assert schedule["last_epoch"] == SAVED_AT


def _full(checkpoint, name: str, key: str = "fp32") -> torch.Tensor:
    entry = checkpoint.parameters[name]
    pieces = entry.fp32 if key == "fp32" else entry.state[key]
    return pieces.read(0, pieces.numel).reshape(entry.shape)


def test_zero2_partitions_read_exactly_as_deepspeeds_own_universal_conversion():
    """universal_from_zero2_fp32_w4 is DeepSpeed's ``ds_to_universal`` of zero2_fp32_w4's partitions: reading the
    partitions gives every parameter's fp32 weights, moments and step bit for bit as DeepSpeed's converter did."""
    partitions = read_deepspeed_checkpoint(FIXTURES / "zero2_fp32_w4" / "checkpoint")
    universal = read_deepspeed_checkpoint(FIXTURES / "universal_from_zero2_fp32_w4" / "checkpoint")
    assert partitions.parameters.keys() == universal.parameters.keys()
    for name in partitions.parameters:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(partitions, name, key), _full(universal, name, key)), (name, key)
        assert partitions.parameters[name].step == universal.parameters[name].step


def test_the_fp32_master_weights_are_read_not_the_16_bit_copy():
    """ZeRO-1/2 files also hold the model's 16-bit copy, and a Trainer checkpoint a consolidated 16-bit
    model.safetensors: in bf16 the fp32 partitions differ from them below bf16's resolution only; in fp32 the copy
    is the master itself."""
    fp32 = read_deepspeed_checkpoint(FIXTURES / "zero1_fp32_w2" / "checkpoint")
    module = load_deepspeed_file(fp32.folder / "mp_rank_00_model_states.pt")["module"]
    assert all(torch.equal(_full(fp32, name), module[name]) for name in fp32.parameters)
    for checkpoint, copy in (
            (read_deepspeed_checkpoint(FIXTURES / "zero2_bf16_w2" / "checkpoint"),
             load_deepspeed_file(FIXTURES / "zero2_bf16_w2" / "checkpoint" / "global_step3" /
                                 "mp_rank_00_model_states.pt")["module"]),
            (read_deepspeed_checkpoint(TRAINER / "checkpoint-6"), load_file(str(TRAINER / "checkpoint-6" /
                                                                                "model.safetensors")))):
        differing = 0
        for name in checkpoint.parameters:
            master, low = _full(checkpoint, name), copy[name]
            assert low.dtype == torch.bfloat16 and torch.equal(master.to(torch.bfloat16), low), name
            differing += int((master != low.float()).sum())
        assert differing > 0.9 * sum(p.shape.numel() for p in checkpoint.parameters.values())


def test_convert_then_export_round_trips_every_tensor(tmp_path):
    """DeepSpeed ZeRO-3 partitions -> hf_zeropp's DCP checkpoint (``hf-zeropp from-deepspeed``) -> DeepSpeed's
    universal layout (``hf-zeropp to-deepspeed``): every weight, moment and step comes back bit for bit, with the
    groups' hyperparameters and the scheduler state."""
    source = FIXTURES / "zero3_bf16_w4" / "checkpoint"
    hf = tmp_path / "hf_zeropp"
    assert _cli("from-deepspeed", str(source), str(hf)) == f"wrote {hf}"
    assert json.loads((hf / "zeropp_meta.json").read_text())["step"] == SAVED_AT
    assert _cli("to-deepspeed", str(hf), str(tmp_path / "universal")).endswith("global_step3")
    original, back = read_deepspeed_checkpoint(source), read_deepspeed_checkpoint(tmp_path / "universal")
    assert back.layout == "universal" and back.parameters.keys() == original.parameters.keys()
    for name in original.parameters:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(original, name, key), _full(back, name, key)), (name, key)
        assert back.parameters[name].step == original.parameters[name].step
        assert back.parameters[name].group == original.parameters[name].group
    assert [g["weight_decay"] for g in back.param_groups] == [g["weight_decay"] for g in original.param_groups]
    assert back.lr_scheduler == original.lr_scheduler and back.global_steps == SAVED_AT


def _cli(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "hf_zeropp", *args], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------- resuming them, two launches


def _resume_one(name: str, preset: str) -> dict:
    return recipe.resume_under_hf_zeropp(FIXTURES / name / "checkpoint", expected(name), preset)


def _accelerator_load_state(name: str, once_per_step: bool) -> dict:
    """``Accelerator.load_state`` on the folder DeepSpeed's ``save_checkpoint`` wrote (the scheduler stepping once
    per optimizer step, as DeepSpeed's engine steps it), or Accelerate's ``save_state`` under DeepSpeed (stepping as
    Accelerate steps it, once per process)."""
    import hf_zeropp

    accelerator = hf_zeropp.Accelerator(zeropp="zero3", step_scheduler_with_optimizer=not once_per_step)
    model = recipe.tiny_gpt2(seed=5)
    optimizer = recipe.make_optimizer(model)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, recipe.make_scheduler(optimizer))
    accelerator.load_state(str(FIXTURES / name / "checkpoint"))
    return recipe.train_after_save(model, optimizer, scheduler)


def _bad_checkpoint_message() -> str:
    """A checkpoint of another model: every rank raises the same error before any collective."""
    import hf_zeropp
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=recipe.VOCAB, n_positions=recipe.SEQUENCE, n_embd=32, n_layer=3,
                                       n_head=2))
    hf_zeropp.shard_model(model, "zero3")
    try:
        load_deepspeed_checkpoint(FIXTURES / "zero3_bf16_w4" / "checkpoint", model, recipe.make_optimizer(model))
    except DeepSpeedCheckpointError as error:
        return str(error)
    return "no error"


def _four_ranks() -> dict:
    results = {name: _resume_one(name, preset) for name, preset in ON_FOUR_RANKS.items()}
    results["accelerator:zero3_fp32_w2"] = _accelerator_load_state("zero3_fp32_w2", once_per_step=True)
    return results


def _converted_resume(converted: str) -> dict:
    """hf_zeropp's own load_checkpoint on the DCP checkpoint ``hf-zeropp from-deepspeed`` wrote."""
    import hf_zeropp

    model = recipe.tiny_gpt2(seed=5)
    hf_zeropp.shard_model(model, {"stage": 3, "mixed_precision": "bf16"})
    optimizer = recipe.make_optimizer(model)
    scheduler = recipe.make_scheduler(optimizer)
    hf_zeropp.load_checkpoint(converted, model, optimizer, scheduler)
    return recipe.train_after_save(model, optimizer, scheduler)


def _two_ranks(converted: str) -> dict:
    results = {name: _resume_one(name, preset) for name, preset in ON_TWO_RANKS.items()}
    results["converted:zero3_bf16_w4"] = _converted_resume(converted)
    results["bad"] = _bad_checkpoint_message()
    results["accelerator:accelerate_zero2_fp32_w2"] = _accelerator_load_state("accelerate_zero2_fp32_w2",
                                                                              once_per_step=False)
    return results


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    converted = tmp_path_factory.mktemp("converted") / "zero3_bf16_w4"
    convert_deepspeed_checkpoint(FIXTURES / "zero3_bf16_w4" / "checkpoint", converted)
    four = run_distributed(_four_ranks, 4, node_size=2, timeout=600)
    two = run_distributed(_two_ranks, 2, str(converted), timeout=600)
    return {**four[0], **two[0], "bad_on_every_rank": [r["bad"] for r in two]}


@pytest.mark.parametrize("run", [*ON_FOUR_RANKS, *ON_TWO_RANKS, "accelerator:zero3_fp32_w2",
                                 "accelerator:accelerate_zero2_fp32_w2", "converted:zero3_bf16_w4"])
def test_resume_gives_deepspeeds_own_resume(resumed, run):
    """The learning rates of DeepSpeed's own resume exactly; its losses and final fp32 weights within twice its own
    distance from an unsharded run."""
    name = run.split(":")[-1]
    got, reference = resumed[run], expected(name)["ds_resumed"]
    assert got["lrs"] == pytest.approx(reference["lrs"], rel=1e-12, abs=0)
    loss_gap = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"]))
    assert loss_gap <= tolerance(name, "loss"), (got["losses"], reference["losses"])
    weights = load_file(str(FIXTURES / name / "ds_resumed_weights.safetensors"))
    weight_gap = max(float((got["weights"][k].float() - weights[k]).abs().max()) for k in weights)
    assert weight_gap <= tolerance(name, "weight"), weight_gap
    if "loss_scale" in got:  # fp16: DeepSpeed's dynamic scale at the save (256) goes on, none of its 3 steps overflowed
        assert got["loss_scale"] == 256.0
        assert any("hysteresis has no counterpart in torch's grad scaler" in line for line in got["not_restored"])
    elif "not_restored" in got:
        assert got["not_restored"] is None


def test_a_checkpoint_of_another_model_is_one_error_on_every_rank(resumed):
    messages = resumed["bad_on_every_rank"]
    assert len(set(messages)) == 1 and "the model's transformer.h.2.ln_1.weight is not in the DeepSpeed" in messages[0]


# ---------------------------------------------------------------- the Trainer, under hf-zeropp launch and converted


def _trainer_steps(log: list[dict]) -> dict[int, dict]:
    return {entry["step"]: entry for entry in log if "loss" in entry}


def _assert_resumed_as_deepspeed(log: list[dict], fixture: Path = TRAINER) -> None:
    """Steps 7-12 after resuming checkpoint-6: DeepSpeed's learning rates, and the losses of DeepSpeed's own resume
    within twice DeepSpeed's distance from the same script in one process; step 7 (DeepSpeed's fp32 weights, one
    bf16 forward on the same batch) equal to it."""
    ours, deepspeed = _trainer_steps(log), _trainer_steps(json.loads((fixture / "resumed.json").read_text()))
    single = _trainer_steps(json.loads((fixture / "single_process.json").read_text()))
    uninterrupted = _trainer_steps(json.loads((fixture / "uninterrupted.json").read_text()))
    assert sorted(ours) == list(range(1, 13))
    distance = max(abs(uninterrupted[s]["loss"] - single[s]["loss"]) for s in range(1, 13))
    for step in range(7, 13):
        assert abs(ours[step]["loss"] - deepspeed[step]["loss"]) <= 2 * distance + FLOOR, (step, ours[step],
                                                                                             deepspeed[step])
        assert ours[step]["learning_rate"] == pytest.approx(deepspeed[step]["learning_rate"], rel=1e-12), step
    assert ours[7]["loss"] == pytest.approx(deepspeed[7]["loss"], rel=1e-6)


def _trainer_resume_run(checkpoint: str, output: str, fixture: str) -> list[dict]:
    """tests/launch_scripts/trainer_resumable.py's model, data and arguments (and the fixture's DeepSpeed config),
    with ZeroPPTrainer, resuming ``checkpoint``."""
    import hf_zeropp
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(7)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"
    starts = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(16)) % 64 for s in starts)]
    args = hf_zeropp.ZeroPPTrainingArguments(
        output_dir=output, max_steps=12, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=True, seed=7, warmup_steps=2, weight_decay=0.01,
        dataloader_drop_last=True, deepspeed=str(Path(fixture) / "ds_config.json"))
    trainer = hf_zeropp.ZeroPPTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer.state.log_history


def test_converted_trainer_checkpoint_resumes_as_deepspeed_resumed_it(tmp_path):
    """``hf-zeropp from-deepspeed checkpoint-6``: an hf_zeropp Trainer checkpoint (fp32 model.safetensors,
    ``zeropp_optimizer/``, the Trainer's own files), which ZeroPPTrainer resumes as DeepSpeed resumed the original."""
    converted = convert_deepspeed_checkpoint(TRAINER / "checkpoint-6", tmp_path / "checkpoint-6")
    names = {p.name for p in converted.iterdir()}
    assert {"model.safetensors", "zeropp_optimizer", "trainer_state.json", "rng_state_3.pth"} <= names
    assert not names & {"global_step6", "latest"}
    assert load_file(str(converted / "model.safetensors"))["transformer.wte.weight"].dtype == torch.float32
    _assert_resumed_as_deepspeed(run_distributed(_trainer_resume_run, 4, str(converted), str(tmp_path / "out"),
                                                 str(TRAINER), timeout=600)[0])


def test_converting_a_checkpoint_of_deepspeeds_own_adamw_keeps_its_decoupled_weight_decay(tmp_path):
    """DeepSpeed's FusedAdam keeps AdamW's decoupled weight decay outside its parameter groups: the converted groups
    get the keys of the optimizer hf_zeropp builds from the same config section (torch AdamW's), not Adam's."""
    from hf_zeropp.checkpoint.deepspeed_convert import _read_dcp

    converted = convert_deepspeed_checkpoint(FIXTURES / "trainer_zero3_bf16_w4_ds_optimizer" / "checkpoint-6",
                                             tmp_path / "checkpoint-6")
    (group,) = _read_dcp(converted / "zeropp_optimizer")["optimizer"]["param_groups"]
    assert group["decoupled_weight_decay"] is True and group["weight_decay"] == 0.01 and len(group["params"]) == 28
    assert group["amsgrad"] is False and tuple(group["betas"]) == (0.9, 0.999)


def test_trainer_checkpoint_with_deepspeeds_optimizer_and_scheduler_resumes_as_deepspeed_resumed_it(tmp_path):
    """The docs' config with its optimizer (AdamW) and scheduler (WarmupLR) sections: ZeroPPTrainer builds them as
    DeepSpeed does and resumes DeepSpeed's checkpoint-6 into them (DeepSpeed's optimizer state, its
    ``{"last_batch_iteration": 5}`` scheduler state) as DeepSpeed resumed it."""
    fixture = FIXTURES / "trainer_zero3_bf16_w4_ds_optimizer"
    assert read_deepspeed_checkpoint(fixture / "checkpoint-6").lr_scheduler == {"last_batch_iteration": 5}
    _assert_resumed_as_deepspeed(run_distributed(_trainer_resume_run, 4, str(fixture / "checkpoint-6"),
                                                 str(tmp_path / "out"), str(fixture), timeout=600)[0], fixture)


@pytest.fixture(scope="module")
def trainer_resumed(deepspeed_config_runs) -> list[dict]:
    """The stock Trainer script resumed from DeepSpeed's ZeRO-3 checkpoint-6 with its own command line, under
    ``hf-zeropp launch`` on the same 4 CPU ranks (tests/conftest.py)."""
    return json.loads((deepspeed_config_runs / "resumed" / "trainer_state.json").read_text())["log_history"]


def test_deepspeed_trainer_checkpoint_resumes_under_the_launcher_as_deepspeed_resumed_it(trainer_resumed):
    _assert_resumed_as_deepspeed(trainer_resumed)


# ---------------------------------------------------------------- bad input: one clear error, naming the file


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name / "checkpoint", target)
    return target


def _single_process_resume(path: Path, **model_config) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = {"vocab_size": recipe.VOCAB, "n_positions": recipe.SEQUENCE, "n_embd": 32, "n_layer": 2, "n_head": 2,
              **model_config}
    model = GPT2LMHeadModel(GPT2Config(**config))
    optimizer = recipe.make_optimizer(model)
    load_deepspeed_checkpoint(path, model, optimizer, recipe.make_scheduler(optimizer))


def test_a_missing_or_truncated_partition_file_is_named(tmp_path):
    folder = _copy("zero2_bf16_w2", tmp_path)
    partition = folder / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = partition.read_bytes()
    partition.write_bytes(data[: len(data) // 2])
    with pytest.raises(DeepSpeedCheckpointError, match=f"{partition}.*truncated or corrupt"):
        _single_process_resume(folder)
    partition.unlink()
    with pytest.raises(DeepSpeedCheckpointError, match=f"{partition} is missing: .*written by 2 ranks"):
        _single_process_resume(folder)


def test_latest_naming_a_missing_tag_is_named(tmp_path):
    folder = _copy("zero3_fp32_w2", tmp_path)
    (folder / "latest").write_text("global_step9")
    with pytest.raises(DeepSpeedCheckpointError, match=r"latest names the tag 'global_step9', but .*global_step9 "
                                                        r"does not exist"):
        _single_process_resume(folder)


def test_a_parameter_the_model_lacks_or_shapes_apart_are_named():
    with pytest.raises(DeepSpeedCheckpointError, match=r"holds parameter transformer.h.1.attn.c_attn.weight \(and 11 "
                                                        r"more\), which is not in the model"):
        _single_process_resume(FIXTURES / "zero1_fp32_w2" / "checkpoint", n_layer=1)
    with pytest.raises(DeepSpeedCheckpointError, match=r"transformer.wpe.weight: .* holds shape \(16, 32\), the "
                                                        r"model \(32, 32\)"):
        _single_process_resume(FIXTURES / "zero1_fp32_w2" / "checkpoint", n_positions=32)


def test_layouts_that_cannot_be_read_are_refused(tmp_path):
    """Partition files from another save (another world size), and tensor/pipeline-parallel checkpoints."""
    mixed = _copy("zero2_fp32_w4", tmp_path)
    other = FIXTURES / "zero1_fp32_w2" / "checkpoint" / "global_step3"
    for rank in (0, 1):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        shutil.copy(other / name, mixed / "global_step3" / name)
    with pytest.raises(DeepSpeedCheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt records a "
                                                        r"partition count of \[2, 2\], but the checkpoint was written "
                                                        r"by 4 ranks"):
        _single_process_resume(mixed)
    parallel = _copy("zero1_fp32_w2", tmp_path)
    shutil.copy(parallel / "global_step3" / "mp_rank_00_model_states.pt",
                parallel / "global_step3" / "mp_rank_01_model_states.pt")
    with pytest.raises(DeepSpeedCheckpointError, match="tensor, pipeline or expert parallelism"):
        _single_process_resume(parallel)


def _rewrite(path: Path, change) -> None:
    """Rewrite a DeepSpeed file with ``change`` applied, its DeepSpeed objects kept as plain dicts."""
    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    data = plain(load_deepspeed_file(path, mmap=False))
    change(data)
    torch.save(data, path)


def test_optimizer_state_that_cannot_be_mapped_is_refused(tmp_path):
    """A state tensor without one value per element (a factored second moment), and an optimizer here whose state
    differs from the checkpoint's (SGD's momentum for Adam's moments)."""
    folder = _copy("zero3_fp32_w2", tmp_path)
    first = folder / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def factored(data):
        state = data["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
        state["exp_avg_sq"] = state["exp_avg_sq"][:64].reshape(8, 8).clone()

    _rewrite(first, factored)
    with pytest.raises(DeepSpeedCheckpointError, match=f"{first}: optimizer state 'exp_avg_sq' of flat group 0 has "
                                                        r"shape \(8, 8\)"):
        _single_process_resume(folder)
    model = recipe.tiny_gpt2()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(DeepSpeedCheckpointError, match=r"holds optimizer state \['exp_avg', 'exp_avg_sq'\] per "
                                                        r"parameter, but SGD here holds \['momentum_buffer'\]"):
        load_deepspeed_checkpoint(FIXTURES / "zero2_fp32_w4" / "checkpoint", model, sgd)


def test_a_foreign_object_in_a_file_is_refused_naming_its_class(tmp_path):
    folder = _copy("zero1_fp32_w2", tmp_path)
    model_states = folder / "global_step3" / "mp_rank_00_model_states.pt"
    _rewrite(model_states, lambda data: data.update(client_state=argparse_namespace()))
    with pytest.raises(DeepSpeedCheckpointError, match=f"{model_states} holds the class argparse.Namespace, which "
                                                        "hf_zeropp does not read"):
        _single_process_resume(folder)


def argparse_namespace():
    import argparse

    return argparse.Namespace(lr=0.1)


def test_a_scheduler_that_cannot_take_the_saved_state_is_refused():
    from hf_zeropp.interop.deepspeed.optim import build_scheduler

    model = recipe.tiny_gpt2()
    optimizer = recipe.make_optimizer(model)
    with pytest.raises(DeepSpeedCheckpointError, match=r"DeepSpeed's scheduler state \{'last_batch_iteration': 2\}, "
                                                        r"which LambdaLR cannot take"):
        load_deepspeed_checkpoint(FIXTURES / "zero2_fp32_w2_warmupdecay" / "checkpoint", model, optimizer,
                                  recipe.make_scheduler(optimizer))
    section = expected("zero2_fp32_w2_warmupdecay")["scheduler"]
    with pytest.raises(DeepSpeedCheckpointError, match="which WarmupDecayLR cannot take .*keeps "
                                                        r"\['last_batch_iteration'\]"):
        load_deepspeed_checkpoint(FIXTURES / "zero1_fp32_w2" / "checkpoint", model, optimizer,
                                  build_scheduler(optimizer, section))


def test_paths_that_would_drop_the_optimizer_state_refuse_a_deepspeed_checkpoint():
    """hf_zeropp's own load_checkpoint (which reads its DCP layout only) names the DeepSpeed entry points instead of
    failing on a missing metadata file; the Trainer and Accelerate entry points resume it (tests above)."""
    import hf_zeropp

    model = recipe.tiny_gpt2()
    with pytest.raises(FileNotFoundError, match="is a DeepSpeed checkpoint, not an hf_zeropp one: resume it with "
                                                "hf_zeropp.load_deepspeed_checkpoint"):
        hf_zeropp.load_checkpoint(FIXTURES / "zero1_fp32_w2" / "checkpoint", model)
    assert find_deepspeed_folder(TRAINER / "checkpoint-6").name == "global_step6"
    assert find_deepspeed_folder(TRAINER) is None


def test_frozen_weights_the_checkpoint_left_out_keep_the_models_values(tmp_path):
    """A checkpoint saved without frozen parameters (the Trainer saves PEFT models so): the model's frozen weights
    keep their values, as under DeepSpeed's own resume, and the warning says so; the rest is restored."""
    folder = tmp_path / "universal"
    shutil.copytree(FIXTURES / "universal_from_zero2_fp32_w4" / "checkpoint", folder)
    shutil.rmtree(folder / "global_step3" / "zero" / "transformer.wpe.weight")
    _rewrite(folder / "global_step3" / "mp_rank_00_model_states.pt",
             lambda data: [group.pop("transformer.wpe.weight", None) for group in data["param_shapes"]])
    model = recipe.tiny_gpt2(seed=5)
    model.transformer.wpe.weight.requires_grad_(False)
    frozen = model.transformer.wpe.weight.detach().clone()
    optimizer = recipe.make_optimizer(model)
    with pytest.warns(UserWarning, match=r"1 frozen weights \(transformer.wpe.weight, ...\) are not in the "
                                         r"checkpoint .* keep the model's values"):
        load_deepspeed_checkpoint(folder, model, optimizer, recipe.make_scheduler(optimizer))
    assert torch.equal(model.transformer.wpe.weight, frozen)
    saved = read_deepspeed_checkpoint(FIXTURES / "universal_from_zero2_fp32_w4" / "checkpoint")
    assert torch.equal(model.transformer.wte.weight, _full(saved, "transformer.wte.weight"))
