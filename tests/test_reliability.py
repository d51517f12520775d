"""Reliability (issue H): bad input, non-finite values, rank failure, atomic checkpoints and exact resume.

Items and where they are tested:

1. bad input — ``tests/test_config.py``, ``tests/test_integrations.py::test_bad_inputs_of_the_integrations`` and
   ``tests/test_kernels.py::test_bad_inputs_name_the_value_and_the_fix`` hold most of the table; the cases they
   miss are here (``MORE_BAD_CONFIGS``, ``test_bad_inputs_outside_the_config``);
2. kernel fuzzing — ``tests/test_kernel_fuzz.py``;
3. non-finite values through qgZ and qwZ, and fp16 loss scaling — ``test_*non_finite*``, ``test_fp16_*``;
4. a rank killed mid-step (SIGKILL) or hung (SIGSTOP) — ``test_*rank*``, using plain per-rank processes
   (:mod:`rank_launcher`) so that every survivor's own exit code and exit time are observed;
5. atomic checkpoints — SIGKILL at each point of ``save_checkpoint`` (forked single process, cheap) and in the
   middle of a 4-rank save, and what the Trainer does with a partial ``checkpoint-<step>``;
6. exact resume — 20 steps, checkpoint at 10, killed at 15, resumed from 10: steps 11-20 bit-identical, for
   ZeRO-3, ZeRO++ (2 emulated nodes x 2) and ZeRO++ with stochastic rounding;
7. the soak is ``scripts/soak.py`` (not a test: it runs for minutes).

Several tests pin fixes found by this work (their docstrings say what used to go wrong): the DeepSpeed bf16+fp16
clash, the wrap_modules and ZEROPP_NODE_SIZE messages, the fp16 loss scaler on CPU, Trainer resume with ``True``,
and the timeout of hf_zeropp's node groups.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hf_zeropp
from hf_zeropp import ZeroPPConfig
from hf_zeropp.spawn import run_distributed
from rank_launcher import launch, last_error_line
from tiny_models import full_parameters, local_batch, make_optimizer, mean_over_ranks, tiny_gpt2, train

HERE = Path(__file__).resolve().parent
WORKER = HERE / "reliability_worker.py"
TRAINER_WORKER = HERE / "trainer_worker.py"
ZEROPP = {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True}
PG_TIMEOUT = 20  # seconds: the process-group timeout of the fault tests
EXIT_MARGIN = 30  # seconds on top of it for a survivor to notice, raise and tear its interpreter down (shared CPU)


# ============================================================================================ 1. bad input

MORE_BAD_CONFIGS = [
    # stage
    (dict(stage=-1), ValueError, "stage=-1 is invalid; use 0 (data parallel), 1, 2 or 3"),
    (dict(stage=True), TypeError, "stage=True has type bool; expected int"),
    (dict(stage=3.0), TypeError, "stage=3.0 has type float; expected int"),
    # bits
    (dict(weight_bits=16), ValueError, "weight_bits=16 is not supported; use 8 or 4"),
    (dict(weight_bits="8"), TypeError, "weight_bits='8' has type str; expected int"),
    (dict(gradient_intra_bits=0), ValueError, "gradient_intra_bits=0 is not supported; use 8, 4 or None"),
    # block sizes
    (dict(block_size=-16), ValueError, "block_size=-16 must be a positive multiple of 8"),
    (dict(block_size=64.0), TypeError, "block_size=64.0 has type float; expected int"),
    (dict(gradient_block_size=4), ValueError, "gradient_block_size=4 must be a positive multiple of 8"),
    # hpZ / node sizes
    (dict(node_size=-2), ValueError, "node_size=-2 must be >= 1 (or None to detect it from the launch)"),
    (dict(node_size=2.0), TypeError, "node_size=2.0 has type float; expected int or None"),
    (dict(hpz_partition_size=2.5), TypeError, "hpz_partition_size=2.5 has type float; expected int or str"),
    (dict(qgz_pipeline_stages=-3), ValueError, "qgz_pipeline_stages=-3 must be >= 1"),
    # techniques on stages that cannot use them
    (dict(stage=1, hpz_partition_size=2), ValueError, "hpz_partition_size needs stage 3, but stage=1"),
    (dict(stage=0, hpz_partition_size="node"), ValueError, "hpz_partition_size needs stage 3, but stage=0"),
    (dict(stage=0, quantized_nontrainable_weights=True), ValueError,
     "quantized_nontrainable_weights needs stage 1 or 2 or 3, but stage=0"),
    # schedules
    (dict(quantized_weights_until=1.5), ValueError,
     "quantized_weights_until=1.5 must be a fraction of max_steps in (0, 1], e.g. 0.5"),
    (dict(hpz_until=0), ValueError, "hpz_until=0.0 must be a fraction of max_steps in (0, 1]"),
    (dict(quantized_gradients_until="half"), TypeError,
     "quantized_gradients_until='half' has type str; expected float or None"),
    # other wrong types and values
    (dict(stochastic_rounding=1), TypeError, "stochastic_rounding=1 has type int; expected bool"),
    (dict(seed=1.5), TypeError, "seed=1.5 has type float; expected int"),
    (dict(kernel_backend="CPP"), ValueError, "kernel_backend='CPP' is invalid; use one of ('reference', 'cpp'"),
    (dict(mixed_precision="bfloat16"), ValueError, "mixed_precision='bfloat16' is invalid; use one of"),
    # unknown keys and presets
    ({"preset": "zero4"}, ValueError, "unknown preset 'zero4'; choose one of"),
    ({"preset": "zeropp", "bogus": 1}, ValueError, "unknown hf_zeropp option(s) ['bogus']; valid options:"),
    # DeepSpeed configs
    ({"zero_optimization": [1]}, TypeError, "zero_optimization must be a mapping, got list"),
    ({"zero_optimization": {"stage": 4}}, ValueError, "stage=4 is invalid"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, ValueError,
     "zero_optimization.offload_param.device='nvme' (CPU/NVMe offload) is not supported by hf_zeropp; remove"),
    ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {}}}, ValueError,
     "zero_optimization.zeropp_loco_param has no hf_zeropp equivalent; remove it"),
    ({"zero_optimization": {"stage": 0, "zero_quantized_gradients": True}}, ValueError,
     "quantized_gradients needs stage 1 or 2 or 3, but stage=0"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, ValueError,
     "hpz_partition_size=0 must be >= 1 (1 turns hpZ off)"),
    ({"zero_optimization": {"stage": 3}, "moe": {"enabled": True}}, ValueError,
     "DeepSpeed config key 'moe' cannot be mapped to hf_zeropp; remove it"),
    # not a mapping at all
    ([1, 2], TypeError, "a ZeroPPConfig needs a mapping, got list"),
]


@pytest.mark.parametrize("values,error,message", MORE_BAD_CONFIGS, ids=[str(c[0])[:60] for c in MORE_BAD_CONFIGS])
def test_more_bad_configs_name_the_value_and_the_fix(values, error, message):
    with pytest.raises(error) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ZeroPPConfig.from_dict(values)
    assert message in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    "config,world,local,message",
    [
        (dict(hpz_partition_size=3), 4, 4, "hpz_partition_size=3 must divide the world size 4"),
        (dict(node_size=4), 2, 2, "node_size=4 does not divide the world size 2"),
        (dict(hpz_partition_size=2, node_size=1), 4, 4,
         "hpz_partition_size=2 does not fit in a node of 1 ranks: its backward all-gather would cross nodes"),
    ],
)
def test_more_bad_launch_combinations(config, world, local, message):
    with pytest.raises(ValueError) as raised:
        ZeroPPConfig(**config).resolve(world, local)
    assert message in str(raised.value)


def test_bad_inputs_outside_the_config(tmp_path, monkeypatch):
    """Entry points other than ZeroPPConfig: shard_model, the environment, the Accelerate helper, checkpoints. All
    of these fail before any process group exists."""
    from hf_zeropp.accelerate_integration import as_zeropp_config

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="config must be a ZeroPPConfig, a preset name, a file path or None; got int"):
        hf_zeropp.shard_model(model, 42)
    with pytest.raises(FileNotFoundError, match="'/nonexistent/z.yaml' does not exist; check the path"):
        hf_zeropp.shard_model(model, "/nonexistent/z.yaml")
    with pytest.raises(RuntimeError, match="shard_model needs torch.distributed initialised: launch with torchrun"):
        hf_zeropp.shard_model(model, "zero3")
    with pytest.raises(FileNotFoundError, match="'/nonexistent/z.yaml' does not exist"):
        ZeroPPConfig.from_env({"ZEROPP_CONFIG": "/nonexistent/z.yaml"})
    with pytest.raises(ValueError, match="block_size=100 must be a positive multiple of 8"):
        ZeroPPConfig.from_env({"ZEROPP_BLOCK_SIZE": "100"})
    with pytest.raises(ValueError, match="ZEROPP_QUANTIZED_WEIGHTS_UNTIL='half' is not a number"):
        ZeroPPConfig.from_env({"ZEROPP_QUANTIZED_WEIGHTS_UNTIL": "half"})
    with pytest.raises(TypeError, match="zeropp must be a ZeroPPConfig, preset name, path, dict or None; got int"):
        as_zeropp_config(42)
    monkeypatch.setenv("ZEROPP_NODE_SIZE", "0")
    with pytest.raises(ValueError, match="node_size=0 must be >= 1"):
        as_zeropp_config("zero3")
    (tmp_path / "stage.yaml").write_text("stage: '3'\n")  # a quoted YAML number is a string
    with pytest.raises(TypeError, match="stage='3' has type str; expected int"):
        ZeroPPConfig.from_file(tmp_path / "stage.yaml")
    # a folder that is not a complete checkpoint (here: a crashed save's partial folder)
    partial = tmp_path / ".checkpoint-5.partial"
    partial.mkdir()
    with pytest.raises(FileNotFoundError, match="is not a complete hf_zeropp checkpoint \\(no zeropp_meta.json\\); "
                                                "pick one returned by latest_checkpoint"):
        hf_zeropp.load_checkpoint(partial, model)
    assert hf_zeropp.latest_checkpoint(tmp_path) is None
    assert hf_zeropp.latest_checkpoint(tmp_path / "missing") is None


def test_deepspeed_config_with_both_bf16_and_fp16_enabled_is_rejected():
    """from_deepspeed used to map bf16, then fp16, so such a config silently became fp16 (DeepSpeed rejects it)."""
    with pytest.raises(ValueError, match="bf16.*fp16"):
        ZeroPPConfig.from_dict({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "fp16": {"enabled": True}})


def test_wrap_modules_as_a_string_says_a_list_is_expected():
    """The type message used to describe list[str] | None as 'str or None': "has type str; expected str"."""
    with pytest.raises(TypeError) as raised:
        ZeroPPConfig(wrap_modules="GPT2Block")
    assert "list" in str(raised.value), str(raised.value)


def test_bad_zeropp_node_size_variable_is_named(monkeypatch):
    """as_zeropp_config used to call int() on it unchecked: "invalid literal for int() with base 10: 'two'"."""
    from hf_zeropp.accelerate_integration import as_zeropp_config

    monkeypatch.setenv("ZEROPP_NODE_SIZE", "two")
    with pytest.raises(ValueError, match="ZEROPP_NODE_SIZE"):
        as_zeropp_config("zero3")


# ============================================================================================ 3. non-finite values

BLOCK = 64
SHARD = 301  # elements of each rank's reduce-scatter shard: prime, so neither blocks nor stages divide it
# (rank that holds the bad value, owner rank of the chunk it sits in, element, values): one rank's NaN; one rank's
# +Inf in the tail block; +Inf on one rank and -Inf on another at the same element (exact sum: NaN)
GRADIENT_FAULTS = {
    "nan": [(1, 2, 5, float("nan"))],
    "inf": [(3, 0, 300, float("inf"))],
    "inf-inf": [(0, 1, 100, float("inf")), (3, 1, 100, -float("inf"))],
}


def _qgz_with_non_finite_inputs():
    """qgZ's reduce-scatter on inputs where one rank's chunk for one owner holds a NaN/Inf, against the exact
    (unquantized) reduce-scatter of the same inputs."""
    from hf_zeropp.comm_meter import CommMeter, reduce_scatter_single
    from hf_zeropp.qgz import QuantizedReduceScatter
    from hf_zeropp.topology import get_topology

    world, rank = dist.get_world_size(), dist.get_rank()
    topology = get_topology(ZeroPPConfig(node_size=2).resolve(world), "cpu")
    meter = CommMeter(topology)
    out = {}
    for case, faults in GRADIENT_FAULTS.items():
        for stages in (1, 2):
            for intra_bits, inter_bits in ((4, 4), (8, 4)):
                grads = torch.randn(world, SHARD, generator=torch.Generator().manual_seed(100 + rank))
                for holder, owner, element, value in faults:
                    if rank == holder:
                        grads[owner, element] = value
                exact = torch.empty(SHARD)
                reduce_scatter_single(exact, grads.reshape(-1).clone(), group=None, op=dist.ReduceOp.SUM)
                comm = QuantizedReduceScatter(meter, topology, intra_bits, inter_bits, BLOCK, stages, False, 0)
                got = torch.empty(SHARD)
                comm(got, grads.reshape(-1).clone(), dist.group.WORLD, dist.ReduceOp.SUM)
                out[(case, stages, intra_bits)] = {"exact_bad": ~torch.isfinite(exact), "qgz_bad": ~torch.isfinite(got)}
    return out


def _inject_non_finite_gradient(model, value: float):
    """On this rank only: the gradient reaching the last block's output gets ``value`` at one position."""

    def forward_hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output

        def poison(grad):
            grad = grad.clone()
            grad[0, 3, 5] = value
            return grad

        hidden.register_hook(poison)

    return model.transformer.h[-1].register_forward_hook(forward_hook)


def _model_with_non_finite_gradients():
    """ZeRO++ (qwZ + hpZ + qgZ) on a GPT-2: rank 1's backward produces a NaN/Inf. The same batch and weights run
    once with qgZ off (the exact reduce-scatter) and once with qgZ on."""
    out = {}
    for kind, value in (("nan", float("nan")), ("inf", float("inf"))):
        model = tiny_gpt2()
        hf_zeropp.shard_model(model, ZeroPPConfig(**ZEROPP))
        ids = local_batch(0)
        handle = _inject_non_finite_gradient(model, value) if dist.get_rank() == 1 else None
        record = {}
        for qgz in (False, True):
            hf_zeropp.set_techniques(model, quantized_gradients=qgz)
            model(input_ids=ids, labels=ids).loss.backward()
            record[qgz] = {
                "local_bad": {n: ~torch.isfinite(p.grad.to_local()) for n, p in model.named_parameters()},
                "norm": float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))),
            }
            model.zero_grad()
        if handle is not None:
            handle.remove()
        out[kind] = record
    return out


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _model_with_a_non_finite_weight():
    """qwZ (stage 3, 2 nodes x 2, so the forward gather crosses nodes and is quantized): rank 1 puts a NaN/Inf into
    its shard of one weight; every rank records the gathered weight its forward computes with."""
    out = {}
    for kind, value in (("nan", float("nan")), ("inf", float("inf"))):
        model = tiny_gpt2()
        hf_zeropp.shard_model(model, ZeroPPConfig(stage=3, quantized_weights=True))
        target = model.transformer.h[0].mlp.c_fc
        with torch.no_grad():
            if dist.get_rank() == 1:
                target.weight.to_local()[0, 1] = value
        poisoned = ~torch.isfinite(target.weight.full_tensor())  # where the bad value sits in the full weight
        captured = {}
        target.register_forward_pre_hook(lambda module, args: captured.update(weight=module.weight.detach().clone()))
        ids = local_batch(0)
        hf_zeropp.comm_stats(model, reset=True)
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        gathers = hf_zeropp.comm_stats(model)["implementations"]["fwd_allgather"]
        out[kind] = {"poisoned": poisoned, "gathered_bad": ~torch.isfinite(captured["weight"]),
                     "loss": float(loss), "gather": " | ".join(gathers)}
    return out


def _non_finite_runs():
    return {"qgz": _qgz_with_non_finite_inputs(), "model_grads": _model_with_non_finite_gradients(),
            "weights": _model_with_a_non_finite_weight()}


@pytest.fixture(scope="module")
def non_finite():
    return run_distributed(_non_finite_runs, 4, node_size=2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(GRADIENT_FAULTS))
def test_qgz_never_masks_a_non_finite_gradient(non_finite, case):
    """Wherever the exact reduce-scatter is non-finite, qgZ's is too, on the owning rank; the damage stays in the
    owner's one quantization block (at most BLOCK elements) and never reaches another rank's shard."""
    owners = {owner for _, owner, _, _ in GRADIENT_FAULTS[case]}
    for rank, result in enumerate(non_finite):
        for (name, stages, intra_bits), masks in result["qgz"].items():
            if name != case:
                continue
            exact_bad, qgz_bad = masks["exact_bad"], masks["qgz_bad"]
            where = (case, stages, intra_bits, rank)
            assert bool(qgz_bad[exact_bad].all()), f"qgZ masked a non-finite value {where}"
            if rank in owners:
                assert 1 <= int(qgz_bad.sum()) <= BLOCK, (where, int(qgz_bad.sum()))
            else:
                assert not qgz_bad.any() and not exact_bad.any(), f"non-finite values leaked to rank {rank} {where}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_non_finite_gradient_on_one_rank_makes_the_global_grad_norm_non_finite(non_finite, kind):
    bad_ranks = {True: set(), False: set()}
    for rank, result in enumerate(non_finite):
        record = result["model_grads"][kind]
        for qgz in (False, True):
            assert not torch.isfinite(torch.tensor(record[qgz]["norm"])), (kind, qgz, rank, record[qgz]["norm"])
            if any(bool(m.any()) for m in record[qgz]["local_bad"].values()):
                bad_ranks[qgz].add(rank)
        for name, exact_bad in record[False]["local_bad"].items():  # qgZ is non-finite wherever exact is
            assert bool(record[True]["local_bad"][name][exact_bad].all()), (kind, rank, name)
    assert bad_ranks[False] and bad_ranks[False] <= bad_ranks[True], bad_ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_non_finite_weight_shard_comes_out_non_finite_on_every_rank_through_qwz(non_finite, kind):
    for rank, result in enumerate(non_finite):
        record = result["weights"][kind]
        assert "qwZ int8" in record["gather"], record["gather"]
        poisoned, gathered_bad = record["poisoned"], record["gathered_bad"]
        assert int(poisoned.sum()) == 1
        assert bool(gathered_bad[poisoned].all()), f"rank {rank}: qwZ turned the bad weight finite"
        assert int(gathered_bad.sum()) <= 256, "one quantization block (256 elements) at most"
        assert not torch.isfinite(torch.tensor(record["loss"])), (rank, record["loss"])


# ---------------------------------------------------------------------------------------- fp16 loss scaling

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
        handle = _inject_non_finite_gradient(model, float("nan")) if step == BAD_STEP and dist.get_rank() == 1 else None
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


# ============================================================================================ 5. atomic save

def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _save_and_die(root: str, name: str, where: str, model, optimizer, scheduler) -> None:
    """In a forked child: train one more step, then save ``root/name`` and SIGKILL ourselves at ``where``."""
    import pathlib

    from torch.distributed.checkpoint import filesystem

    from hf_zeropp import checkpoint

    torch.set_num_threads(1)  # a forked child must not touch the parent's OpenMP pool
    train(model, optimizer, range(5, 6))
    if where == "dcp_write":  # this rank's shard file is written, DCP's .metadata is not
        original_write = filesystem._FileSystemWriter.write_data

        def write_data(self, plan, planner):
            original_write(self, plan, planner).wait()
            _die()

        filesystem._FileSystemWriter.write_data = write_data
    elif where == "after_dcp":  # all model/optimizer shards and .metadata written; no RNG, no zeropp_meta.json
        original_save = checkpoint.dcp.save
        checkpoint.dcp.save = lambda *args, **kwargs: (original_save(*args, **kwargs), _die())
    elif where == "before_commit":  # the partial folder is complete, but not yet renamed into place
        checkpoint._commit = lambda partial, directory: _die()
    elif where == "between_renames":  # overwriting: the old folder was moved aside, the new one not yet in place
        original_rename = pathlib.Path.rename

        def rename(self, target):
            result = original_rename(self, target)
            if str(target).endswith(".replaced"):
                _die()
            return result

        pathlib.Path.rename = rename
    hf_zeropp.save_checkpoint(Path(root) / name, model, optimizer, scheduler, step=6)
    raise SystemExit(0)  # not reached


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["dcp_write", "after_dcp", "before_commit", "between_renames"])
def test_sigkill_during_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, where):
    """One process (no process group: DCP's single-process path) SIGKILLed at each point of save_checkpoint.
    ``between_renames`` overwrites the same folder — the case where a crash could leave no folder of that name."""
    model = tiny_gpt2()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train(model, optimizer, range(5))
    scheduler.step()
    hf_zeropp.save_checkpoint(tmp_path / "checkpoint-5", model, optimizer, scheduler, step=5)
    saved = full_parameters(model)
    name = "checkpoint-5" if where == "between_renames" else "checkpoint-6"
    child = multiprocessing.get_context("fork").Process(
        target=_save_and_die, args=(str(tmp_path), name, where, model, optimizer, scheduler))
    child.start()
    child.join(timeout=90)
    assert child.exitcode == -signal.SIGKILL, child.exitcode

    latest = hf_zeropp.latest_checkpoint(tmp_path)
    expected = ".checkpoint-5.replaced" if where == "between_renames" else "checkpoint-5"
    assert latest is not None and latest.name == expected, (latest, sorted(p.name for p in tmp_path.iterdir()))
    assert not (tmp_path / "checkpoint-6").exists()
    fresh = tiny_gpt2(seed=1)
    fresh_optimizer = make_optimizer(fresh)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=2, gamma=0.5)
    meta = hf_zeropp.load_checkpoint(latest, fresh, fresh_optimizer, fresh_scheduler)
    assert meta["step"] == 5
    restored = full_parameters(fresh)
    assert all(torch.equal(restored[n], saved[n]) for n in saved)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()

    # the next save of the same name succeeds and cleans up what the crash left
    hf_zeropp.save_checkpoint(tmp_path / name, model, optimizer, scheduler, step=6 if name == "checkpoint-6" else 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"checkpoint-5", name})
    assert hf_zeropp.latest_checkpoint(tmp_path).name == name


# ------------------------------------------------------------------------------- Trainer checkpoints (item 5)

@pytest.fixture(scope="module")
def trainer_crash(tmp_path_factory):
    """ZeroPPTrainer on 2 ranks saving every 2 steps; rank 1 is SIGKILLed while checkpoint-4 is written (weights
    on disk, optimizer shards not). Then two resumes: ``resume_from_checkpoint=True``, and the path
    ``hf_zeropp.checkpoint.latest_trainer_checkpoint`` picks."""
    from hf_zeropp.checkpoint import latest_trainer_checkpoint
    from transformers.trainer_utils import get_last_checkpoint

    work = tmp_path_factory.mktemp("trainer")
    out = work / "out"
    base = {"output_dir": str(out), "max_steps": 6, "save_steps": 2, "pg_timeout": PG_TIMEOUT}
    crash = launch(TRAINER_WORKER, {**base, "kill_at_save": 4, "result": str(work / "crash.json")}, work / "crash",
                   2, 2, timeout=400)
    contents = {d.name: sorted(p.name for p in d.iterdir()) for d in out.iterdir() if d.is_dir()}
    picked = {"transformers": get_last_checkpoint(str(out)), "hf_zeropp": latest_trainer_checkpoint(out)}
    resume_true = launch(TRAINER_WORKER, {**base, "resume": True, "result": str(work / "resume_true.json")},
                         work / "resume_true", 2, 2, timeout=400)
    resume_path = launch(TRAINER_WORKER, {**base, "resume": str(picked["hf_zeropp"]),
                                          "result": str(work / "resume_path.json")}, work / "resume_path", 2, 2,
                         timeout=400)

    def result(name):
        path = work / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    return {"crash": (crash, result("crash")), "contents": contents, "picked": picked,
            "resume_true": (resume_true, result("resume_true")), "resume_path": (resume_path, result("resume_path"))}


@pytest.mark.timeout(600)
def test_trainer_crash_mid_save_leaves_a_partial_checkpoint_folder(trainer_crash):
    """What a crash mid-save leaves: the Trainer writes straight into ``checkpoint-4``, so that name exists with
    the weights but without optimizer shards, RNG states or trainer_state.json; transformers' get_last_checkpoint
    (what resume_from_checkpoint=True uses) returns it; latest_trainer_checkpoint skips it."""
    crash, record = trainer_crash["crash"]
    assert crash[1].returncode == -signal.SIGKILL and crash[0].returncode not in (0, None), crash
    assert sorted(record["losses"]) == ["1", "2", "3", "4"], record  # step 4 was logged, then its save crashed
    contents = trainer_crash["contents"]
    assert {"trainer_state.json", "model.safetensors", "zeropp_optimizer"} <= set(contents["checkpoint-2"])
    assert "model.safetensors" in contents["checkpoint-4"]
    assert "trainer_state.json" not in contents["checkpoint-4"] and "zeropp_optimizer" not in contents["checkpoint-4"]
    assert Path(trainer_crash["picked"]["transformers"]).name == "checkpoint-4"
    assert trainer_crash["picked"]["hf_zeropp"].name == "checkpoint-2"


@pytest.mark.timeout(600)
def test_trainer_resumes_exactly_from_the_checkpoint_latest_trainer_checkpoint_picks(trainer_crash):
    """The workaround until the mixin does it for ``True``: ``resume_from_checkpoint=latest_trainer_checkpoint(out)``
    resumes from checkpoint-2 and logs the same losses for steps 3 and 4 as the run that crashed."""
    ranks, result = trainer_crash["resume_path"]
    assert all(r.returncode == 0 for r in ranks), [last_error_line(r.log) for r in ranks]
    assert result["started_at_step"] == 2 and result["final_step"] == 6, result
    assert sorted(result["losses"]) == ["3", "4", "5", "6"], result["losses"]
    crashed = trainer_crash["crash"][1]["losses"]
    assert [result["losses"][s] for s in ("3", "4")] == [crashed[s] for s in ("3", "4")], (result, crashed)


@pytest.mark.timeout(600)
def test_trainer_resume_from_checkpoint_true_never_picks_a_partial_checkpoint(trainer_crash):
    """Trainer.train(resume_from_checkpoint=True) alone takes get_last_checkpoint's partial checkpoint-4 and fails
    on every rank with FileNotFoundError: .../checkpoint-4/trainer_state.json (a crash loop under any restarting
    launcher); the mixin resolves True with latest_trainer_checkpoint."""
    ranks, result = trainer_crash["resume_true"]
    assert result is not None and "error" not in result, result and result.get("error")
    assert all(r.returncode == 0 for r in ranks)
    assert result["started_at_step"] == 2 and result["final_step"] == 6, result


# ============================================================================ 4 + 6. rank failure and exact resume

RESUME_CONFIGS = {"stage3": {"stage": 3}, "zeropp": ZEROPP,
                  "zeropp_sr": {**ZEROPP, "stochastic_rounding": True, "seed": 7},
                  "zeropp_ef": {**ZEROPP, "gradient_error_feedback": True, "gradient_hadamard": 64}}
STEPS, SAVE_AT, FAULT_AT = 20, 10, 15


def _run(name: str, root: Path, losses: Path, **extra) -> dict:
    return {"name": name, "config": RESUME_CONFIGS[name], "root": str(root), "losses": str(losses), "end": STEPS,
            "save_at": [SAVE_AT], **extra}


def _losses(path: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(path.read_text())["losses"].items()}


@pytest.fixture(scope="module")
def resume_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="module")
def uninterrupted(resume_dir):
    """20 steps of each configuration without a fault (checkpoint at 10 as in the faulty runs)."""
    work = resume_dir / "uninterrupted"
    spec = {"pg_timeout": PG_TIMEOUT,
            "runs": [_run(name, work / name, work / f"{name}.json") for name in RESUME_CONFIGS]}
    ranks = launch(WORKER, spec, work, 4, 2, timeout=500)
    assert all(r.returncode == 0 for r in ranks), [last_error_line(r.log) for r in ranks]
    return {name: _losses(work / f"{name}.json") for name in RESUME_CONFIGS}


def _faulty_run(work: Path, run: dict) -> dict:
    marker = Path(run["losses"]).with_suffix(".killed")
    ranks = launch(WORKER, {"pg_timeout": PG_TIMEOUT, "runs": [run]}, work, 4, 2, timeout=500,
                   fault_marker=marker, after_fault=PG_TIMEOUT + EXIT_MARGIN)
    killed_at = json.loads(marker.read_text()) if marker.exists() else None
    return {"ranks": ranks, "killed": killed_at, "losses": _losses(Path(run["losses"]))}


@pytest.fixture(scope="module")
def killed_mid_step(resume_dir):
    """ZeRO-3: rank 2 SIGKILLs itself inside the forward of step 16 (index 15)."""
    work = resume_dir / "killed_mid_step"
    return _faulty_run(work, _run("stage3", work / "stage3", work / "stage3.json",
                                  kill={"rank": 2, "step": FAULT_AT, "where": "forward"}))


@pytest.fixture(scope="module")
def killed_mid_save(resume_dir):
    """ZeRO++: rank 1 SIGKILLs itself while checkpoint-15 is saved, right after its DCP shard file was written."""
    work = resume_dir / "killed_mid_save"
    return _faulty_run(work, _run("zeropp", work / "zeropp", work / "zeropp.json", save_at=[SAVE_AT, FAULT_AT],
                                  kill={"rank": 1, "step": FAULT_AT, "where": "dcp_write"}))


def _assert_survivors_exit_nonzero_in_time(run: dict, killed_rank: int) -> None:
    assert run["killed"] is not None and run["killed"]["rank"] == killed_rank, "the fault was not injected"
    for rank_exit in run["ranks"]:
        if rank_exit.rank == killed_rank:
            assert rank_exit.returncode == -signal.SIGKILL
            continue
        assert rank_exit.returncode is not None, f"rank {rank_exit.rank} hung after the fault"
        assert rank_exit.returncode != 0, f"rank {rank_exit.rank} exited 0 after a peer died"
        took = rank_exit.exited_at - run["killed"]["time"]
        assert took <= PG_TIMEOUT + EXIT_MARGIN, (rank_exit.rank, took)
        assert "RuntimeError" in last_error_line(rank_exit.log), last_error_line(rank_exit.log)


@pytest.mark.timeout(600)
def test_rank_sigkilled_mid_step_makes_every_other_rank_exit_nonzero(killed_mid_step):
    _assert_survivors_exit_nonzero_in_time(killed_mid_step, killed_rank=2)
    assert sorted(killed_mid_step["losses"]) == list(range(FAULT_AT))  # steps 0-14 ran, step 15 did not finish


@pytest.mark.timeout(600)
def test_rank_sigkilled_mid_save_leaves_the_previous_checkpoint_latest(killed_mid_save, resume_dir):
    _assert_survivors_exit_nonzero_in_time(killed_mid_save, killed_rank=1)
    root = resume_dir / "killed_mid_save" / "zeropp"
    assert hf_zeropp.latest_checkpoint(root) == root / f"checkpoint-{SAVE_AT}"
    assert not (root / f"checkpoint-{FAULT_AT}").exists()
    partial = root / f".checkpoint-{FAULT_AT}.partial"
    written = sorted(p.name for p in partial.iterdir())
    assert any(name.endswith(".distcp") for name in written) and "zeropp_meta.json" not in written, written


@pytest.mark.timeout(600)
def test_faulty_runs_match_the_uninterrupted_run_until_the_fault(uninterrupted, killed_mid_step, killed_mid_save):
    for name, run in (("stage3", killed_mid_step), ("zeropp", killed_mid_save)):
        for step, loss in run["losses"].items():
            assert loss == uninterrupted[name][step], (name, step)


@pytest.fixture(scope="module")
def resumed(resume_dir, killed_mid_step, killed_mid_save, uninterrupted):
    """One launch resuming all four from their latest checkpoint: the two faulty runs' roots, and the
    uninterrupted runs' roots for stochastic rounding and error feedback."""
    work = resume_dir / "resumed"
    roots = {"stage3": resume_dir / "killed_mid_step" / "stage3", "zeropp": resume_dir / "killed_mid_save" / "zeropp",
             "zeropp_sr": resume_dir / "uninterrupted" / "zeropp_sr",
             "zeropp_ef": resume_dir / "uninterrupted" / "zeropp_ef"}
    spec = {"pg_timeout": PG_TIMEOUT,
            "runs": [_run(name, roots[name], work / f"{name}.json", resume=True, save_at=[]) for name in roots]}
    ranks = launch(WORKER, spec, work, 4, 2, timeout=500)
    assert all(r.returncode == 0 for r in ranks), [last_error_line(r.log) for r in ranks]
    return {name: json.loads((work / f"{name}.json").read_text()) for name in roots}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def test_resume_from_step_10_reproduces_steps_11_to_20_exactly(resumed, uninterrupted, name):
    """Bit-identical losses after resuming: weights, AdamW state, LR schedule, (for stochastic rounding) the qgZ
    rounding seeds and (for error feedback) its residuals all continue where the checkpoint left them."""
    record = resumed[name]
    assert Path(record["resumed_from"]).name == f"checkpoint-{SAVE_AT}"
    got = {int(k): v for k, v in record["losses"].items()}
    assert sorted(got) == list(range(SAVE_AT, STEPS))
    expected = {step: uninterrupted[name][step] for step in range(SAVE_AT, STEPS)}
    assert got == expected, {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}


def _sigkill_rank_1():
    if dist.get_rank() == 1:
        _die()
    dist.barrier()
    return dist.get_rank()


@pytest.mark.timeout(180)
def test_run_distributed_reports_a_rank_that_died_without_reporting_at_once():
    """hf_zeropp.spawn.run_distributed used to wait its whole ``timeout`` (300 s) for a rank that was SIGKILLed;
    it now notices the dead process at once and says how it died."""
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run_distributed(_sigkill_rank_1, 3, timeout=300, pg_timeout=PG_TIMEOUT)
    message = str(raised.value)
    assert "rank 1:\ndied without reporting (killed by signal 9)" in message, message
    assert time.monotonic() - started < 120


@pytest.mark.timeout(300)
def test_rank_hung_in_backward_with_zeropp_makes_the_others_exit_within_the_timeout(tmp_path):
    """ZeRO++: rank 2 freezes (SIGSTOP) in backward, where hpZ gathers and qgZ all-to-alls run on the node and
    inter-node groups. A frozen rank keeps its sockets open, so only the process-group timeout can end the wait —
    on *every* group: DeviceMesh groups built without a timeout get torch's 30-minute default, whatever the world
    group's timeout is (survivors were still waiting 60 s after the freeze with a 15 s world timeout)."""
    timeout = 10
    run = {"name": "zeropp", "config": ZEROPP, "root": str(tmp_path / "root"), "losses": str(tmp_path / "l.json"),
           "end": 4, "save_at": [], "kill": {"rank": 2, "step": 1, "where": "backward_hang"}}
    marker = tmp_path / "l.killed"
    allowed = timeout + 20  # with the world group's timeout on every group, survivors exit after ~timeout + 5 s
    ranks = launch(WORKER, {"pg_timeout": timeout, "runs": [run]}, tmp_path, 4, 2, timeout=200, fault_marker=marker,
                   after_fault=allowed)
    frozen_at = json.loads(marker.read_text())["time"]
    for rank_exit in ranks:
        if rank_exit.rank != 2:
            assert rank_exit.returncode not in (0, None), \
                f"rank {rank_exit.rank} still waiting {allowed} s after rank 2 froze (process-group timeout {timeout} s)"
            assert rank_exit.exited_at - frozen_at <= allowed
