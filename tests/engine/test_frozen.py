"""Frozen weights stored INT8: LoRA gradients, the quantization bound, node-local traffic with hpZ
(training and generation), peft adapter save/merge, and the no-frozen-weights warning."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from paths import ROOT

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import global_batch, tiny_gpt2, with_stored_int8_values

BLOCK = 64
WORLD = 4


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model = tiny_gpt2(n_embd=64)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _lora_run(mixed_precision: str, output: str | None):
    from torch.distributed.tensor import DTensor

    import hf_zeropp
    from hf_zeropp.engine.frozen import frozen_weight_bytes

    model = _lora_model()
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad and p.dim() == 2}
    config = hf_zeropp.ZeroPPConfig(stage=3, quantized_nontrainable_weights=True, hpz_partition_size="node",
                                    block_size=BLOCK, mixed_precision=mixed_precision)
    hf_zeropp.shard_model(model, config)
    ids = global_batch(0, 8).chunk(dist.get_world_size())[dist.get_rank()]
    hf_zeropp.comm_stats(model, reset=True)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().clone()
             for n, p in model.named_parameters() if p.requires_grad}
    stats = hf_zeropp.comm_stats(model, reset=True)
    # the stored weights against the originals: within half a quantization step
    bound_ok = True
    for module_name, module in model.named_modules():
        store = getattr(module, "_zeropp_frozen", None)
        name = f"{module_name}.weight"
        if store is None or name not in originals:
            continue
        restored = store.materialize(torch.float32)
        original = originals[name].reshape(-1)
        shard = store.shard_numel
        rows = torch.zeros(WORLD * shard)
        rows[: original.numel()] = original
        step = torch.nn.functional.pad(rows.view(WORLD, shard).abs(), (0, -shard % BLOCK)).view(WORLD, -1, BLOCK)
        step = (step.amax(-1) / 127).repeat_interleave(BLOCK, -1)[:, :shard].reshape(-1)[: original.numel()]
        bound_ok &= bool(((restored.reshape(-1) - original).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all())
    # generation: the frozen weights are gathered from the node-local copy
    hf_zeropp.comm_stats(model, reset=True)  # not the gathers of the bound check above
    with torch.no_grad():
        model.generate(input_ids=ids[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    generation = hf_zeropp.comm_stats(model, reset=True)
    result = {"grads": grads, "stats": stats, "generation": generation, "bound_ok": bound_ok,
              "frozen_bytes": frozen_weight_bytes(model)}
    if output:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        optimizer.step()
        hf_zeropp.save_pretrained(model, output)
        result["adapter"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                             for n, p in model.named_parameters() if p.requires_grad}
    return result


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    output = str(tmp_path_factory.mktemp("adapter"))
    return run_distributed(_lora_run, WORLD, "no", output, node_size=2), output


def test_lora_gradients_equal_a_reference_with_the_dequantized_base(fp32_run):
    results, _ = fp32_run
    reference = with_stored_int8_values(_lora_model(), WORLD, BLOCK)
    ids = global_batch(0, 8)
    reference(input_ids=ids, labels=ids).loss.backward()
    grads = results[0]["grads"]
    assert len(grads) == 12  # A and B of c_attn, attn.c_proj and mlp.c_proj in 2 blocks
    for name, parameter in reference.named_parameters():
        if parameter.requires_grad:
            error = float((grads[name] - parameter.grad).norm() / parameter.grad.norm())
            assert error <= 1e-5, (name, error)


def test_stored_weights_are_within_the_quantization_bound_and_half_the_bf16_bytes(fp32_run):
    results, _ = fp32_run
    assert all(r["bound_ok"] for r in results)
    model = _lora_model()
    head = model.get_output_embeddings().weight
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p.dim() == 2 and p is not head)
    # hpZ keeps the node's 1/k slice (k = 2): INT8 codes plus one fp32 scale per 64 elements
    expected = frozen / 2 * (1 + 4 / BLOCK)
    for result in results:
        assert abs(result["frozen_bytes"] - expected) <= 0.02 * expected, (result["frozen_bytes"], expected)
    bf16_zero3 = frozen * 2 / WORLD
    assert results[0]["frozen_bytes"] <= 1.1 * bf16_zero3


def test_frozen_weight_traffic_stays_in_the_node_in_training_and_generation(fp32_run):
    results, _ = fp32_run
    for result in results:
        for stats in (result["stats"], result["generation"]):
            frozen = stats["frozen_allgather"]
            assert frozen["inter_node"] == 0 and frozen["intra_node"] > 0
            assert "hpZ copy" in " | ".join(stats["implementations"]["frozen_allgather"])
        # generate() gathers the frozen weights once per call (generation_gather="per_call"), not once per token:
        # wpe + 4 matrices x 2 blocks in one packed all-gather
        assert result["generation"]["frozen_allgather"]["calls"] == 1
        assert "9 weights packed" in " | ".join(result["generation"]["implementations"]["frozen_allgather"])


def test_adapter_saves_in_peft_format_and_merges(fp32_run):
    from peft import PeftModel

    results, output = fp32_run
    adapter = results[0]["adapter"]
    loaded = PeftModel.from_pretrained(tiny_gpt2(n_embd=64), output)
    for name, value in loaded.named_parameters():
        if "lora_" in name:
            trained = adapter[name]
            assert torch.equal(value.detach(), trained), name
    ids = global_batch(1, 2)
    with torch.no_grad():
        unmerged = loaded(input_ids=ids).logits
        merged = loaded.merge_and_unload()(input_ids=ids).logits
    assert torch.allclose(unmerged, merged, atol=1e-4)


def test_bf16_compute_tracks_the_reference():
    results = run_distributed(_lora_run, WORLD, "bf16", None, node_size=2)
    reference = with_stored_int8_values(_lora_model(), WORLD, BLOCK)
    ids = global_batch(0, 8)
    reference(input_ids=ids, labels=ids).loss.backward()
    for name, parameter in reference.named_parameters():
        if parameter.requires_grad:
            error = float((results[0]["grads"][name] - parameter.grad).norm() / parameter.grad.norm())
            assert error <= 0.05, (name, error)


def _no_frozen():
    import warnings

    import hf_zeropp

    model = tiny_gpt2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, quantized_nontrainable_weights=True))
    return [str(w.message) for w in caught]


def test_no_frozen_weights_warns_and_changes_nothing():
    messages = run_distributed(_no_frozen, 2)[0]
    assert any("has no frozen Linear/Conv1D/Embedding weights; nothing was quantized" in m for m in messages)


def test_single_gpu_end_to_end_script_equals_stock_on_cpu(tmp_path):
    """scripts/benchmarks/gpu_e2e.py (the GPU check of frozen INT8 LoRA at world size 1) in its CPU dry run: the
    sharded model's
    logits, greedy tokens and losses equal a stock model holding the same INT8 values, on the compiled kernels and
    on the reference ones."""
    import json
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "scripts.benchmarks.gpu_e2e", "--device", "cpu", "--hidden", "64", "--layers",
                    "2", "--batch", "2", "--seq", "32", "--new-tokens", "6", "--train-steps", "3", "--warmup", "0", "--rounds", "1",
                    "--out", str(tmp_path)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    report = json.loads((tmp_path / "gpu_e2e.json").read_text())
    checks = report["correctness"]
    compiled = report["compiled_backend"]
    assert checks["generate: tokens equal to stock"] == {compiled: True, "reference": True}
    for name in (compiled, "reference"):
        assert checks[f"logits ({name}): largest difference to stock / largest stock logit"] <= 1e-6
    assert checks[f"losses ({compiled}): largest difference to stock"] <= 1e-6
    assert checks[f"losses ({compiled}) bit-identical to the reference kernels'"]
    assert all(len(losses) == 3 for losses in checks["losses"].values())
    assert report["timing"]["medians"][compiled]["step_ms"] > 0
