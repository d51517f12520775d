"""Non-finite values: a NaN/Inf in one rank's gradient stays non-finite through qgZ on the owning rank (never
masked, never leaked to another rank's shard) and makes the global grad norm non-finite; a NaN/Inf in one rank's
weight shard reaches every rank through qwZ. What fp16 loss scaling then does with such a step is in
``tests/reliability/test_fp16_loss_scaling.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_zeropp
from faults import ZEROPP, inject_non_finite_gradient
from hf_zeropp import ZeroPPConfig
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import local_batch, tiny_gpt2

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
    from hf_zeropp.comm.comm_meter import CommMeter, reduce_scatter_single
    from hf_zeropp.comm.qgz import QuantizedReduceScatter
    from hf_zeropp.comm.topology import get_topology

    world, rank = dist.get_world_size(), dist.get_rank()
    topology = get_topology(ZeroPPConfig(node_size=2), "cpu")
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


def _model_with_non_finite_gradients():
    """ZeRO++ (qwZ + hpZ + qgZ) on a GPT-2: rank 1's backward produces a NaN/Inf. The same batch and weights run
    once with qgZ off (the exact reduce-scatter) and once with qgZ on."""
    out = {}
    for kind, value in (("nan", float("nan")), ("inf", float("inf"))):
        model = tiny_gpt2()
        hf_zeropp.shard_model(model, ZeroPPConfig(**ZEROPP))
        ids = local_batch(0)
        handle = inject_non_finite_gradient(model, value) if dist.get_rank() == 1 else None
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
