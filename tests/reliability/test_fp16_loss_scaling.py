"""fp16 loss scaling: ``hf_zeropp.Accelerator(mixed_precision="fp16")`` installs torch's ``ShardedGradScaler`` (also
on CPU), skips a step whose gradient is non-finite on one rank on every rank, keeps training, and clips unscaled
gradients. The tests pin fixes (their docstrings say what used to go wrong): the loss scaler on CPU and
``clip_grad_norm_`` on scaled gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_zeropp
from faults import ZEROPP, inject_non_finite_gradient
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import full_parameters, local_batch, make_optimizer, mean_over_ranks, tiny_gpt2

FP16_STEPS, BAD_STEP = 6, 2


def _fp16_loss_scaling_run():
    """hf_zeropp.Accelerator(mixed_precision="fp16") with ZeRO++ on 2 nodes x 2; rank 1's gradient is NaN at step
    BAD_STEP. Uses the loss scaler the Accelerator installs itself (Accelerate creates none on CPU; hf_zeropp must
    install torch's ShardedGradScaler); if there is none, installs one so that the skip logic is still exercised
    (``test_accelerator_installs_a_loss_scaler_for_fp16`` then fails)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    accelerator = hf_zeropp.Accelerator(mixed_precision="fp16", zeropp=ZEROPP)
    installed = type(accelerator.scaler).__name__ if accelerator.scaler is not None else None
    if accelerator.scaler is None:
        accelerator.scaler = ShardedGradScaler(device="cpu")
        accelerator.native_amp = True  # Accelerate's unscale_gradients only unscales when native_amp is set
    model = tiny_gpt2()
    model, optimizer = accelerator.prepare(model, make_optimizer(model))
    steps = []
    for step in range(FP16_STEPS):
        before = full_parameters(model)
        scale_before = float(accelerator.scaler.get_scale())
        handle = inject_non_finite_gradient(model, float("nan")) if step == BAD_STEP and dist.get_rank() == 1 else None
        ids = local_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if handle is not None:
            handle.remove()
        after = full_parameters(model)
        steps.append({"skipped": optimizer.step_was_skipped, "loss": mean_over_ranks(loss), "norm": float(norm),
                      "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                      "scale_before": scale_before, "scale_after": float(accelerator.scaler.get_scale())})
    return {"installed": installed, "mixed_precision": accelerator.zeropp_config.mixed_precision, "steps": steps}


@pytest.fixture(scope="module")
def fp16_run():
    return run_distributed(_fp16_loss_scaling_run, 4, node_size=2, timeout=240)


@pytest.mark.timeout(300)
def test_fp16_loss_scaling_skips_the_non_finite_step_on_every_rank_and_training_continues(fp16_run):
    """The step with rank 1's NaN is skipped on all 4 ranks (parameters bit-identical, scale halved: the scalers'
    found-inf is all-reduced); every skipped step halves the scale, every other step updates the parameters with
    the scale unchanged; the last steps train normally."""
    for rank, result in enumerate(fp16_run):
        assert result["mixed_precision"] == "fp16"
        steps = result["steps"]
        bad = steps[BAD_STEP]
        assert bad["skipped"] and bad["unchanged"], (rank, bad)
        assert bad["scale_after"] == bad["scale_before"] / 2, (rank, bad)
        assert not torch.isfinite(torch.tensor(bad["norm"]))
        for step, record in enumerate(steps):
            assert record["skipped"] == record["unchanged"], (rank, step, record)
            expected_scale = record["scale_before"] / 2 if record["skipped"] else record["scale_before"]
            assert record["scale_after"] == expected_scale, (rank, step, record)
            assert torch.isfinite(torch.tensor(record["loss"])), (rank, step, record)
        assert not any(record["skipped"] for record in steps[BAD_STEP + 1:]), (rank, steps)

    def agreed(result):  # the norm of the bad step is NaN, and NaN != NaN: compare the rest
        return [{k: v for k, v in record.items() if k != "norm"} for record in result["steps"]]

    assert all(agreed(r) == agreed(fp16_run[0]) for r in fp16_run), "ranks disagree"


@pytest.mark.timeout(300)
def test_accelerator_installs_a_loss_scaler_for_fp16(fp16_run):
    """Accelerate creates no grad scaler on CPU (its fp16 branch needs device.type != 'cpu'); hf_zeropp's
    Accelerator must install ShardedGradScaler itself, or fp16 on CPU trains without loss scaling."""
    assert all(r["installed"] == "ShardedGradScaler" for r in fp16_run), [r["installed"] for r in fp16_run]


@pytest.mark.timeout(300)
def test_fp16_clip_grad_norm_sees_unscaled_gradients(fp16_run):
    """Accelerate's unscale_gradients only unscales when native_amp is set; without it clip_grad_norm_ measured and
    clipped the *scaled* gradients (norm 60687 instead of 0.926 at scale 2**16), shrinking every update."""
    for rank, result in enumerate(fp16_run):
        for step, record in enumerate(result["steps"]):
            if not record["skipped"]:  # the true norm of the tiny GPT-2's gradient is O(1); the scale is 2**16
                assert record["norm"] * 100 < record["scale_before"], (rank, step, record)
