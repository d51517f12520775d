"""Generation that gathers the weights once per call (``generation_gather``, ``gathered_for_inference``) and frozen
reference models sharded with plain ``shard_model(frozen=True)``.

4 ranks = 2 emulated nodes x 2, fp32 so that every path can be compared exactly: the per-call path must give the
same tokens and scores as FSDP's per-token path (and as an unsharded model), before and after optimizer steps —
also a step taken inside the block — hold the whole model only during the call, and gather once per call."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import global_batch, tiny_gpt2

WORLD, NODE = 4, 2
NEW_TOKENS = 6


def _model(preset: str):
    model = tiny_gpt2(n_embd=64)
    if preset != "zeropp-lora":
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _prompts(rank: int) -> torch.Tensor:
    return global_batch(rank, size=2, length=4)


def _generate(model, prompts, peaks: list) -> dict:
    from transformers import LogitsProcessor

    import hf_zeropp

    class RecordHeldBytes(LogitsProcessor):  # called once per generated token, inside generate()
        def __call__(self, input_ids, scores):
            peaks.append(hf_zeropp.gathered_parameter_bytes(model))
            return scores

    with torch.no_grad():
        out = model.generate(input_ids=prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                             logits_processor=[RecordHeldBytes()])
    return {"tokens": out.sequences, "scores": torch.stack(out.scores)}


def _run(preset: str, gather: str, block: bool) -> dict:
    """generate; a training step; generate again — inside one ``gathered_for_inference`` block if ``block``."""
    import contextlib

    import torch.distributed as dist

    import hf_zeropp
    from hf_zeropp.comm.hpz import reshard_all

    rank = dist.get_rank()
    model = _model(preset)
    hf_zeropp.shard_model(model, {"preset": preset, "node_size": NODE, "generation_gather": gather})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    prompts, batch = _prompts(rank), global_batch(10 + rank, size=2)
    with torch.no_grad():  # what one forward over the prompts gathers
        model(input_ids=prompts)
    one_forward = hf_zeropp.comm_stats(model, reset=True)
    reshard_all(model)  # what that forward left gathered (FSDP's root keeps its weights)
    results = []
    with hf_zeropp.gathered_for_inference(model) if block else contextlib.nullcontext():
        for step in range(2):
            peaks: list = []
            result = _generate(model, prompts, peaks)
            result["stats"] = hf_zeropp.comm_stats(model, reset=True)
            result["peak_held"], result["held_after"] = max(peaks), hf_zeropp.gathered_parameter_bytes(model)
            results.append(result)
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            hf_zeropp.comm_stats(model, reset=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {"generations": results, "one_forward": one_forward,
            "held_after_block": hf_zeropp.gathered_parameter_bytes(model),
            "trainable_sharded": bool(trainable) and all(hasattr(p, "to_local") for p in trainable),
            "full_model_bytes": sum(p.numel() * 4 for p in _model(preset).parameters())}


def _stock_generation() -> dict:
    """The unsharded model (same seed) on rank 0's prompts: step 0 only (no training)."""
    model = tiny_gpt2(n_embd=64)
    return _generate(model, _prompts(0), [])


CASES = [("zero3", "per_call", False), ("zero3", "per_token", False), ("zero3", "per_token", True),
         ("zeropp-lora", "per_call", False), ("zeropp-lora", "per_token", False), ("zeropp-lora", "per_token", True)]


def _all_cases() -> dict:
    return {case: _run(*case) for case in CASES}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all_cases, WORLD, node_size=NODE)


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["scores"], b["scores"])


@pytest.mark.parametrize("preset", ["zero3", "zeropp-lora"])
def test_per_call_gathering_gives_the_same_tokens_and_scores_as_per_token(runs, preset):
    """Exactly equal on every rank, before and after optimizer steps (no stale weights), and also when the step is
    taken inside a gathered_for_inference block; the step changed the scores."""
    for rank_results in runs:
        per_call = rank_results[(preset, "per_call", False)]["generations"]
        per_token = rank_results[(preset, "per_token", False)]["generations"]
        in_block = rank_results[(preset, "per_token", True)]["generations"]
        for step in range(2):
            assert _same(per_call[step], per_token[step]), (preset, step)
            assert _same(in_block[step], per_token[step]), (preset, step)
        assert not torch.equal(per_token[0]["scores"], per_token[1]["scores"])


def test_sharded_generation_equals_the_unsharded_model(runs):
    stock = _stock_generation()
    ours = runs[0][("zero3", "per_call", False)]["generations"][0]
    assert torch.equal(ours["tokens"], stock["tokens"])
    assert torch.allclose(ours["scores"], stock["scores"], atol=1e-5, rtol=0), \
        float((ours["scores"] - stock["scores"]).abs().max())


def test_per_call_generation_gathers_once_and_frees_everything_after(runs):
    """ZeRO-3: a per-call generate moves what one forward moves; per token, about one forward per token. The whole
    model is held (fp32 here) during the call, nothing after; per token, never more than part of it."""
    for rank_results in runs:
        per_call = rank_results[("zero3", "per_call", False)]
        per_token = rank_results[("zero3", "per_token", False)]
        one = per_call["one_forward"]["fwd_allgather"]
        for step in range(2):
            call_stats, token_stats = per_call["generations"][step]["stats"], per_token["generations"][step]["stats"]
            assert call_stats["fwd_allgather"] == one, (call_stats["fwd_allgather"], one)
            assert token_stats["fwd_allgather"]["inter_node"] >= (NEW_TOKENS - 1) * one["inter_node"]
            assert call_stats["implementations"]["inference"] == [
                "weights gathered once per call (generate() or gathered_for_inference), freed after it"]
            assert "per_token" in token_stats["implementations"]["inference"][0]
            assert per_call["generations"][step]["peak_held"] >= per_call["full_model_bytes"]
            assert per_call["generations"][step]["held_after"] == 0
            assert per_token["generations"][step]["peak_held"] < per_call["full_model_bytes"]
        assert rank_results[("zero3", "per_token", True)]["held_after_block"] == 0


def test_frozen_int8_generation_gathers_inside_the_node_once_per_call(runs):
    """Frozen INT8 + hpZ with LoRA: the frozen matrices are gathered (INT8, inside the node) once per call, all in
    one collective, and held dequantized during it; the adapters stay trainable and sharded."""
    for rank_results in runs:
        per_call = rank_results[("zeropp-lora", "per_call", False)]
        per_token = rank_results[("zeropp-lora", "per_token", False)]
        assert per_call["trainable_sharded"]
        one = per_call["one_forward"]["frozen_allgather"]
        for step in range(2):
            call_stats, token_stats = per_call["generations"][step]["stats"], per_token["generations"][step]["stats"]
            # every frozen matrix gathered once, in one packed collective per call
            assert {**call_stats["frozen_allgather"], "calls": one["calls"]} == one and one["calls"] > 1
            assert call_stats["frozen_allgather"]["calls"] == 1
            assert call_stats["frozen_allgather"]["inter_node"] == 0 and one["intra_node"] > 0
            assert token_stats["frozen_allgather"]["intra_node"] == NEW_TOKENS * one["intra_node"]
            assert per_call["generations"][step]["held_after"] == 0
            assert per_call["generations"][step]["peak_held"] > per_token["generations"][step]["peak_held"]


def _uneven_run(preset: str) -> dict:
    """Ranks that run different numbers of forwards: generation with a different length per rank (greedy, so the
    per-call and per-token paths must agree exactly), counting ``dist.all_reduce`` calls inside generate(); and a
    gathered_for_inference block in which rank r runs r + 1 forwards, metered after the entry."""
    import torch.distributed as dist

    import hf_zeropp

    rank = dist.get_rank()
    prompts = _prompts(rank)
    result: dict = {}
    for gather in ("per_call", "per_token"):
        model = hf_zeropp.shard_model(_model(preset), {"preset": preset, "node_size": NODE,
                                                        "generation_gather": gather})
        all_reduce, calls = dist.all_reduce, []
        dist.all_reduce = lambda *args, **kwargs: calls.append(1) or all_reduce(*args, **kwargs)
        try:
            with torch.no_grad():
                tokens = model.generate(input_ids=prompts, max_new_tokens=2 + 3 * rank, do_sample=False,
                                        pad_token_id=0)
        finally:
            dist.all_reduce = all_reduce
        result[gather] = {"tokens": tokens, "all_reduce_calls": len(calls)}
    hf_zeropp.comm_stats(model, reset=True)
    with hf_zeropp.gathered_for_inference(model), torch.no_grad():
        entry = hf_zeropp.comm_stats(model, reset=True)["total"]
        for _ in range(rank + 1):
            model(input_ids=prompts)
        result["in_block"] = hf_zeropp.comm_stats(model, reset=True)["total"]
    result["entry"] = entry
    return result


@pytest.mark.parametrize("preset", ["zero3", "zeropp-lora"])
def test_inside_the_block_ranks_may_run_different_numbers_of_forwards(preset):
    """Everything is gathered on entry, so forwards inside the block communicate nothing and ranks need not stay in
    step: generate() runs without synced_gpus on the per-call path (no per-token all-reduce of the 'finished' flag,
    which crosses the nodes) and gives the per-token path's tokens (where transformers keeps the ranks in step);
    a block in which each rank runs a different number of forwards completes (a collective inside would hang)."""
    results = run_distributed(_uneven_run, WORLD, preset, node_size=NODE, pg_timeout=60)
    for rank, result in enumerate(results):
        per_call, per_token = result["per_call"], result["per_token"]
        assert per_call["tokens"].shape[1] == _prompts(rank).shape[1] + 2 + 3 * rank
        assert torch.equal(per_call["tokens"], per_token["tokens"]), rank
        assert per_call["all_reduce_calls"] == 0
        assert per_token["all_reduce_calls"] >= 2 + 3 * (WORLD - 1)  # one per forward, until the last rank is done
        assert result["entry"]["intra_node"] > 0
        assert result["in_block"] == {"intra_node": 0, "inter_node": 0}, result["in_block"]


def _reference_model_run() -> dict:
    """A frozen reference model through plain shard_model: frozen INT8 + hpZ, two no-grad forwards."""
    import torch.distributed as dist

    import hf_zeropp

    ids = _prompts(dist.get_rank())
    with torch.no_grad():
        expected = tiny_gpt2(n_embd=64)(input_ids=ids).logits
    model = hf_zeropp.shard_model(tiny_gpt2(n_embd=64), {"preset": "zeropp-lora", "node_size": NODE}, frozen=True)
    forwards = []
    for _ in range(2):
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        forwards.append({"logits": logits, "stats": hf_zeropp.comm_stats(model, reset=True)})
    return {"expected": expected, "forwards": forwards, "trainable": [n for n, p in model.named_parameters()
                                                                      if p.requires_grad],
            "parameter_bytes": hf_zeropp.state_bytes(model)["parameters"],
            "full_fp32_bytes": sum(p.numel() * 4 for p in tiny_gpt2(n_embd=64).parameters())}


def test_a_reference_model_sharded_frozen_is_int8_node_local_and_close_to_the_original():
    """shard_model(frozen=True): nothing trainable, about 1/8 of the fp32 bytes per rank (INT8 node copy split in
    two, the tied embedding/head in fp32 over 4 ranks), the first forward's only cross-node bytes are the FSDP
    units' world gather, the second forward stays inside the node, and the logits are within the INT8 error."""
    for result in run_distributed(_reference_model_run, WORLD, node_size=NODE):
        assert result["trainable"] == []
        assert result["parameter_bytes"] < result["full_fp32_bytes"] / 4, result["parameter_bytes"]
        first, second = (forward["stats"] for forward in result["forwards"])
        assert first["frozen_allgather"]["inter_node"] == 0 < first["frozen_allgather"]["intra_node"]
        assert second["total"]["inter_node"] == 0 < second["total"]["intra_node"]
        for forward in result["forwards"]:
            error = float((forward["logits"] - result["expected"]).norm() / result["expected"].norm())
            assert error < 2e-2, error


def _digits(completions: list[str], **_) -> list[float]:
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def test_trl_ds3_gather_for_generation_false_selects_per_token_gathering(tmp_path):
    """TRL's per-forward gathering switch (for DeepSpeed ZeRO-3) is honoured, with a warning saying so."""
    pytest.importorskip("trl", reason="TRL is optional (pip install hf_zeropp[rlhf]); scripts/setup.sh installs it")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import hf_zeropp
    from hf_zeropp.testing.tiny_models import save_tiny_gpt2_with_tokenizer

    save_tiny_gpt2_with_tokenizer(tmp_path / "base")
    trainer_class = type("ZeroPPGRPOTrainer", (hf_zeropp.ZeroPPTrainerMixin, GRPOTrainer), {})
    data = Dataset.from_dict({"prompt": [f"Value {i}:" for i in range(8)]})
    for gather, expected in ((True, "per_call"), (False, "per_token")):
        args = hf_zeropp.with_zeropp_field(GRPOConfig)(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, use_cpu=True, report_to="none", bf16=False, zeropp="zero3",
            ds3_gather_for_generation=gather)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = trainer_class(model=str(tmp_path / "base"), args=args, train_dataset=data, reward_funcs=_digits)
        said = [str(w.message) for w in caught if "ds3_gather_for_generation" in str(w.message)]
        assert trainer.zeropp_config.generation_gather == expected
        assert len(said) == (0 if gather else 1), said


def test_gathered_for_inference_on_an_unsharded_model_is_a_no_op_and_on_a_part_of_a_sharded_one_an_error():
    """One process (hf_zeropp.Accelerator shards nothing there): the same script runs unchanged. A submodule of a
    sharded model is refused, naming what to pass instead (here a stock fully_shard'ed module stands in for it)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import hf_zeropp

    model = tiny_gpt2()
    with hf_zeropp.gathered_for_inference(model) as inside, torch.no_grad():
        assert inside is model
        model(input_ids=_prompts(0))
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fully_shard(model.transformer.h[0])
        with pytest.raises(ValueError, match="part of a sharded model .*pass the model that shard_model"):
            with hf_zeropp.gathered_for_inference(model):
                pass
    finally:
        dist.destroy_process_group()
