"""Conformance: every public pattern runs twice — under stock Accelerate / Trainer and under hf_zeropp — and must
give the same result (zero1-3 and hybrid sharding, fp32: 1e-6 relative), or for ZeRO++ and hybrid-q (quantized
collectives) the same behaviour within quantization error, with resume bit-exact in every mode.

Each mode runs in one launch of 4 gloo ranks (2 emulated nodes x 2) that goes through all the patterns (they live in
:mod:`hf_zeropp.testing.conformance`); the test functions compare the modes' results pattern by pattern.
``scripts/conformance_table.py`` prints the table.
"""

from __future__ import annotations

import pytest
import torch

from hf_zeropp.testing import conformance
from hf_zeropp.testing.conformance import NODE_SIZE, WORLD
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import save_tiny_gpt2_with_tokenizer
EXACT_MODES = ("zero1", "zero2", "zero3", "hybrid")
QUANTIZED_MODES = ("zeropp", "hybrid-q")
MODES = ("stock", *EXACT_MODES, *QUANTIZED_MODES)
EXACT = 1e-6  # relative: the same arithmetic up to reduction order
# ZeRO++ (INT8 weights, INT4 gradients) against stock, relative, over these 3 steps: losses; gradient norms (the
# INT4 rounding noise adds to the norm: +7 % measured); the whole model's weights, L2 over all parameters (Adam at
# lr 1e-2 turns rounding noise in small gradients into full-size steps: 7.5 % measured)
QUANTIZED = {"loss": 0.02, "grad_norm": 0.15, "weights": 0.15}


class Runs(dict):
    """Results by mode, each mode launched the first time a test asks for it: ``-k zero3`` runs stock and zero3
    only (the minimum-versions CI lane selects a subset this way)."""

    def __init__(self, launch) -> None:
        super().__init__()
        self.launch = launch

    def __missing__(self, mode: str) -> dict:
        self[mode] = result = self.launch(mode)
        return result


# ---------------------------------------------------------------- Accelerate patterns


@pytest.fixture(scope="module")
def accelerate_results(tmp_path_factory) -> Runs:
    workdir = str(tmp_path_factory.mktemp("accelerate"))
    return Runs(lambda mode: run_distributed(conformance.accelerate_patterns, WORLD, mode, workdir, node_size=NODE_SIZE)[0])


def _close(actual: list[float], expected: list[float], rel: float) -> bool:
    return len(actual) == len(expected) and all(abs(a - e) <= rel * abs(e) for a, e in zip(actual, expected))


def _tolerance(mode: str, measure: str = "loss") -> float:
    return QUANTIZED[measure] if mode in QUANTIZED_MODES else EXACT


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("pattern", ["one_call", "split_prepare", "fsdp2_order"])
def test_losses_equal_stock_accelerate(accelerate_results, mode, pattern):
    stock, ours = accelerate_results["stock"][pattern], accelerate_results[mode][pattern]
    assert stock["loss"][-1] < stock["loss"][0] - 0.05  # the pattern trains under stock Accelerate
    assert _close(ours["loss"], stock["loss"], _tolerance(mode)), (ours["loss"], stock["loss"])


@pytest.mark.parametrize("mode", MODES[1:])
def test_clip_grad_norm_and_gather_for_metrics_equal_stock(accelerate_results, mode):
    stock, ours = accelerate_results["stock"]["one_call"], accelerate_results[mode]["one_call"]
    assert _close(ours["grad_norm"], stock["grad_norm"], _tolerance(mode, "grad_norm")), (ours["grad_norm"],
                                                                                        stock["grad_norm"])
    assert ours["evaluated_samples"] == stock["evaluated_samples"] == list(range(11))


@pytest.mark.parametrize("mode", MODES[1:])
def test_get_state_dict_equals_stock(accelerate_results, mode):
    stock, ours = accelerate_results["stock"]["one_call"], accelerate_results[mode]["one_call"]
    assert set(ours["state_dict"]) == set(stock["state_dict"])
    names = sorted(stock["state_dict"])
    if mode in QUANTIZED_MODES:
        flat = {which: torch.cat([result["state_dict"][n].reshape(-1) for n in names]) for which, result in
                (("stock", stock), ("ours", ours))}
        error = float((flat["ours"] - flat["stock"]).norm() / flat["stock"].norm())
        assert error <= QUANTIZED["weights"], error
        return
    for name in names:
        value = stock["state_dict"][name]
        error = float((ours["state_dict"][name] - value).norm() / value.norm().clamp_min(1e-12))
        assert error <= 1e-5, (name, error)


@pytest.mark.parametrize("mode", MODES[1:])
@pytest.mark.parametrize("saved", ["no_state_dict", "with_state_dict", "with_own_state_dict", "save_model"])
def test_saved_models_reload_with_plain_transformers(accelerate_results, mode, saved):
    """``unwrap_model(model).save_pretrained(dir, is_main_process=..., save_function=accelerator.save)`` without
    ``state_dict``, with ``accelerator.get_state_dict(model)`` and with the model's own (sharded) ``state_dict()``,
    and ``save_model``: loadable by plain transformers, logits equal to the saved weights', and the same tensors in
    the files as stock writes (the tied embedding/head once)."""
    ours = accelerate_results[mode]["one_call"]
    assert ours["saved_tensors"][saved] == accelerate_results["stock"]["one_call"]["saved_tensors"][saved]
    logits = ours["reloaded_logits"][saved]
    reference = accelerate_results["stock"]["one_call"]["reloaded_logits"][saved]
    if mode in QUANTIZED_MODES:  # compare with this mode's own weights: its training differs from stock by quantization
        reference = ours["reloaded_logits"]["save_model"]
    assert torch.allclose(logits, reference, rtol=1e-5, atol=1e-5), float((logits - reference).abs().max())


@pytest.mark.parametrize("mode", MODES[1:])
def test_load_state_dict_of_full_tensors_into_a_sharded_model(accelerate_results, mode):
    stock = accelerate_results["stock"]["one_call"]["loss_after_loading_initial_weights"]
    ours = accelerate_results[mode]["one_call"]["loss_after_loading_initial_weights"]
    assert abs(ours - stock) <= _tolerance(mode) * stock, (ours, stock)


@pytest.mark.parametrize("mode", MODES)
def test_save_state_load_state_resumes_bit_exactly_in_fsdp2_order(accelerate_results, mode):
    result = accelerate_results[mode]["fsdp2_order"]
    assert result["resumed_loss"] == result["uninterrupted_loss"]


@pytest.mark.parametrize("mode", conformance.COMPILED_MODES[1:])
def test_compiled_units_train_as_stock_compiled_ddp(accelerate_results, mode):
    """Accelerate's dynamo settings compile each FSDP unit: losses and gradient norms equal stock's compiled DDP (1e-5;
    ZeRO++ and hybrid-q within quantization error), through accumulation and a bit-exact save_state / load_state;
    no graph breaks, and no graph compiled after the first step."""
    stock, ours = accelerate_results["stock"]["compiled"], accelerate_results[mode]["compiled"]
    assert stock["loss"][-1] < stock["loss"][0] - 0.05
    exact = mode not in QUANTIZED_MODES
    assert _close(ours["loss"], stock["loss"], 1e-5 if exact else QUANTIZED["loss"]), (ours["loss"], stock["loss"])
    assert _close(ours["grad_norm"], stock["grad_norm"], 1e-5 if exact else QUANTIZED["grad_norm"]), (
        ours["grad_norm"], stock["grad_norm"])
    assert ours["resumed_loss"] == ours["uninterrupted_loss"]
    assert stock["resumed_loss"] == stock["uninterrupted_loss"]
    assert ours["graph_breaks"] == 0, ours["graph_breaks"]
    first_step, end = ours["graphs"]
    assert first_step == end == 2, ours["graphs"]  # one per block, none added by later steps or the resume
    assert ours["model_class"] == "GPT2LMHeadModel"  # compiled in place: the model object the script holds
    assert "per FSDP unit" in ours["compile"][0], ours["compile"]


# ---------------------------------------------------------------- Trainer patterns


TRAINER_MODES = ("stock", "zero3", "zeropp", "hybrid", "hybrid-q")


@pytest.fixture(scope="module")
def trainer_workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def trainer_results(trainer_workdir) -> Runs:
    return Runs(lambda mode: run_distributed(conformance.trainer_patterns, WORLD, mode, trainer_workdir, node_size=NODE_SIZE)[0])


@pytest.fixture(scope="module")
def trainer_resumed(trainer_results, trainer_workdir) -> Runs:
    def launch(mode: str) -> dict:
        trainer_results[mode]  # writes the checkpoint this run resumes from
        return run_distributed(conformance.trainer_resume_on_two_ranks, 2, mode, trainer_workdir)[0]

    return Runs(launch)


@pytest.mark.parametrize("mode", TRAINER_MODES[1:])
def test_trainer_losses_equal_stock(trainer_results, mode):
    stock, ours = trainer_results["stock"], trainer_results[mode]
    assert stock["loss"][-1] < stock["loss"][0] - 0.05
    assert _close(ours["loss"], stock["loss"], _tolerance(mode)), (ours["loss"], stock["loss"])
    if mode in EXACT_MODES:  # ZeRO++'s gradient norms drift from stock's with its trajectory (+-25 % by step 6)
        assert _close(ours["grad_norm"], stock["grad_norm"], EXACT), (ours["grad_norm"], stock["grad_norm"])
    assert sorted(ours["eval_loss"]) == sorted(stock["eval_loss"]) == [2, 4, 6]
    assert _close([ours["eval_loss"][s] for s in (2, 4, 6)], [stock["eval_loss"][s] for s in (2, 4, 6)],
                  _tolerance(mode))


@pytest.mark.parametrize("mode", TRAINER_MODES)
def test_trainer_load_best_model_at_end_restores_the_best_checkpoint(trainer_results, mode):
    """``load_best_model_at_end=True``: the model train() leaves evaluates exactly as the best checkpoint did."""
    result = trainer_results[mode]
    best_step = int(result["best_checkpoint"].removeprefix("checkpoint-"))
    assert result["eval_loss"][best_step] == max(result["eval_loss"].values())  # greater_is_better=True
    assert best_step < 6  # the model is rolled back, not left as trained
    assert result["final_eval_loss"] == pytest.approx(result["eval_loss"][best_step], rel=1e-6)
    if mode in EXACT_MODES:
        assert result["best_checkpoint"] == trainer_results["stock"]["best_checkpoint"]


@pytest.mark.parametrize("mode", TRAINER_MODES)
def test_trainer_save_model_reloads_with_plain_transformers(trainer_results, mode):
    """``save_model`` after load_best_model_at_end writes the best checkpoint's weights (which evaluate exactly as the
    model did at that step: test above), and under zero3 the weights stock training reaches; the folder holds the
    tensors stock writes (the tied embedding/head once)."""
    result = trainer_results[mode]
    assert torch.equal(result["reloaded_logits"], result["best_checkpoint_logits"])
    assert result["saved_tensors"] == trainer_results["stock"]["saved_tensors"]
    if mode in EXACT_MODES:
        ours, stock = result["reloaded_logits"], trainer_results["stock"]["reloaded_logits"]
        assert torch.allclose(ours, stock, rtol=1e-5, atol=1e-5), float((ours - stock).abs().max())


@pytest.mark.parametrize("mode", TRAINER_MODES[1:])
def test_trainer_resumes_on_another_world_size_as_stock(trainer_resumed, mode):
    """Also the Trainer's ``--torch_compile``: hf_zeropp's resumed run compiles each FSDP unit (aot_eager)."""
    stock, ours = trainer_resumed["stock"], trainer_resumed[mode]
    assert len(stock["loss"]) == len(ours["loss"]) == 4  # steps 3-6 after checkpoint-2
    assert _close(ours["loss"], stock["loss"], _tolerance(mode)), (ours["loss"], stock["loss"])
    assert "backend='aot_eager'" in ours["compile"][0] and "per FSDP unit" in ours["compile"][0], ours["compile"]


# ---------------------------------------------------------------- TRL trainers behind the mixin


TRL_MODES = ("stock", "zero3", "zeropp", "hybrid-q", "zeropp-lora")


@pytest.fixture(scope="module")
def trl_results(tmp_path_factory) -> Runs:
    pytest.importorskip("trl", reason="TRL is optional (pip install hf_zeropp[rlhf]); scripts/setup.sh installs it")
    workdir = tmp_path_factory.mktemp("trl")
    save_tiny_gpt2_with_tokenizer(workdir / "base")
    return Runs(lambda mode: run_distributed(conformance.trl_patterns, WORLD, mode, str(workdir), node_size=NODE_SIZE)[0])


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
@pytest.mark.parametrize("mode", TRL_MODES[1:4])
def test_trl_trainers_behind_the_mixin_equal_stock(trl_results, kind, mode):
    stock, ours = trl_results["stock"][kind], trl_results[mode][kind]
    assert ours["sharded"] and not stock["sharded"]
    assert len(ours["loss"]) == len(stock["loss"]) > 0
    assert _close(ours["loss"], stock["loss"], _tolerance(mode)), (ours["loss"], stock["loss"])
    if kind == "grpo":
        assert _close(ours["reward"], stock["reward"], _tolerance(mode)), (ours["reward"], stock["reward"])
    if kind == "grpo" and mode == conformance.COMPILED_TRL_MODE:  # generated and trained on the compiled units
        assert "per FSDP unit" in ours["compile"][0] and "backend='eager'" in ours["compile"][0], ours["compile"]


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_trl_reference_models_are_sharded(trl_results, kind):
    """Per rank, after training: stock holds the whole reference model; ZeRO-3 a quarter (world 4); ZeRO++ a quarter
    plus hpZ's node-local secondary shard, which a frozen model keeps between forwards so that every gather after
    the first stays in the node (1/2 of the model at 2 ranks per node); with frozen INT8 (``zeropp-lora``) the
    frozen matrices' node-local share is stored as INT8 codes instead (the tied embedding/head, biases and
    LayerNorms stay with FSDP in fp32); hybrid sharding holds the node's share (1/2) and gathers nothing across
    nodes."""
    reference = {mode: trl_results[mode][kind]["reference_bytes"] for mode in TRL_MODES}
    assert not trl_results["stock"][kind]["reference_sharded"]
    assert all(trl_results[mode][kind]["reference_sharded"] for mode in TRL_MODES[1:])
    full = reference["stock"]
    assert reference["zero3"] <= full / WORLD * 1.1, reference
    assert reference["zeropp"] <= (full / WORLD + full / NODE_SIZE) * 1.1, reference
    assert reference["zeropp-lora"] < reference["zeropp"] * 0.6, reference
    assert reference["hybrid-q"] <= full / NODE_SIZE * 1.1, reference
