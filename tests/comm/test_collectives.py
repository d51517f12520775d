"""qgZ and qwZ collectives on real gloo process groups, emulated topologies nodes x node_size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed

TOPOLOGIES = [(2, 2), (2, 3), (2, 4), (4, 2), (3, 2), (1, 4)]
SHARD = 301  # elements per rank: prime, so neither stages nor blocks divide it
BLOCK = 64


def _setup(node_size: int):
    from hf_zeropp.comm.comm_meter import CommMeter
    from hf_zeropp.config.config import ZeroPPConfig
    from hf_zeropp.comm.topology import get_topology

    topology = get_topology(ZeroPPConfig(node_size=node_size), "cpu")
    _ = topology.node_mesh
    return topology, CommMeter(topology)


def _gradients(world: int, rank: int, integers: bool) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter input (world, SHARD); heavy-tailed, or small integers (exact sums)."""
    g = torch.Generator().manual_seed(100 + rank)
    if integers:
        return torch.randint(-50, 50, (world, SHARD), generator=g).float()
    return torch.randn(world, SHARD, generator=g) * torch.rand(world, SHARD, generator=g) ** 4 * 10


def _error_bound(world: int, nodes: int, node_size: int, stages: int, first_bits: int, inter_bits: int,
                 rank: int, stochastic: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Analytic bound on |qgZ SUM - exact SUM| per element of ``rank``'s shard.

    Each rank's slice is quantized once (error <= step/2 per block with step = absmax/qmax; < step with
    stochastic rounding); with two hops each node's partial sum is requantized once (its absmax <= the sum of the
    node's absmaxes, inflated by the first error).
    """
    rounding = 1.0 if stochastic else 0.5
    qmax = {8: 127, 4: 7}
    slice_len = -(-SHARD // stages)
    padded = torch.zeros(world, world, stages * slice_len)
    for r in range(world):
        padded[r, :, :SHARD] = _gradients(world, r, integers=False).to(dtype).float()
    mine = padded[:, rank].view(world, stages, slice_len)  # every rank's chunk addressed to me
    blocks = -(-slice_len // BLOCK)
    pad = blocks * BLOCK - slice_len
    absmax = torch.nn.functional.pad(mine.abs(), (0, pad)).view(world, stages, blocks, BLOCK).amax(-1)
    bound = (absmax * rounding / qmax[first_bits]).sum(0)
    if nodes > 1 and node_size > 1:
        per_node = absmax.view(nodes, node_size, stages, blocks).sum(1) * (1 + rounding / qmax[first_bits])
        bound = bound + (per_node * rounding / qmax[inter_bits]).sum(0)
    return bound.repeat_interleave(BLOCK, -1)[..., :slice_len].reshape(-1)[:SHARD] * (1 + 1e-5) + 1e-6


def _qgz_worker(node_size: int):
    from hf_zeropp.comm.comm_meter import reduce_scatter_single
    from hf_zeropp.comm.qgz import QuantizedReduceScatter
    from hf_zeropp.testing.payloads import FullPrecisionPayload

    topology, meter = _setup(node_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for stages in (1, 2):
        exact_int = torch.empty(SHARD)
        reduce_scatter_single(exact_int, _gradients(world, rank, True).reshape(-1), group=None, op=dist.ReduceOp.SUM)
        bypass = QuantizedReduceScatter(meter, topology, 8, 8, BLOCK, stages, False, 0, payload=FullPrecisionPayload())
        got = torch.empty(SHARD)
        bypass(got, _gradients(world, rank, True).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
        results[("bypass", stages)] = bool(torch.equal(got, exact_int))

        exact = torch.empty(SHARD)
        reduce_scatter_single(exact, _gradients(world, rank, False).reshape(-1), group=None, op=dist.ReduceOp.SUM)
        for intra_bits, inter_bits in ((8, 8), (8, 4), (4, 4)):
            for stochastic in (False, True):
                comm = QuantizedReduceScatter(meter, topology, intra_bits, inter_bits, BLOCK, stages, stochastic, 3)
                got = torch.empty(SHARD)
                comm(got, _gradients(world, rank, False).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
                first = intra_bits if topology.node_size > 1 else inter_bits
                bound = _error_bound(world, topology.nodes, topology.node_size, stages, first, inter_bits, rank,
                                     stochastic)
                error = (got - exact).abs()
                results[(intra_bits, inter_bits, stages, stochastic)] = (
                    bool((error <= bound).all()), float((error / bound).max()), float(error.max()))
                if not stochastic and inter_bits == 4:  # the same exchange with 32-element Hadamard rotation
                    rotated = QuantizedReduceScatter(meter, topology, intra_bits, inter_bits, BLOCK, stages, False, 3,
                                                     hadamard=32)
                    got_rotated = torch.empty(SHARD)
                    rotated(got_rotated, _gradients(world, rank, False).reshape(-1), dist.group.WORLD,
                            dist.ReduceOp.SUM)
                    results[("hadamard", intra_bits, stages)] = (float((got_rotated - exact).norm()),
                                                                 float((got - exact).norm()))
    results["stats"] = meter.stats()
    return results


@pytest.mark.parametrize("nodes,node_size", TOPOLOGIES)
def test_qgz_places_exactly_and_stays_within_the_quantization_bound(nodes, node_size):
    results = run_distributed(_qgz_worker, nodes * node_size, node_size, node_size=node_size)
    for rank, result in enumerate(results):
        for stages in (1, 2):
            assert result[("bypass", stages)], f"rank {rank}: bypassed qgZ differs from reduce-scatter (stages={stages})"
        for key, value in result.items():
            if isinstance(key, tuple) and key[0] == "hadamard":
                # On these gradients (independent per-element magnitudes) rotation neither helps nor hurts much
                # (measured 0.90-1.01x); a missing inverse rotation or a misplaced row would give errors of the
                # order of the gradient itself. Its accuracy gain is tested on heavy-tailed blocks in test_hadamard.
                rotated, plain = value
                assert rotated < 1.25 * plain, f"rank {rank} {key}: rotated error {rotated:.4g} vs plain {plain:.4g}"
            elif isinstance(key, tuple) and key[0] != "bypass":
                within, ratio, worst = value
                assert within, f"rank {rank} {key}: error {worst:.3g} exceeds the bound ({ratio:.2f}x)"
        stats = result["stats"]
        if nodes == 1:
            assert "qgz_inter" not in stats and stats["qgz_intra"]["inter_node"] == 0
            assert "1-hop" in " | ".join(stats["implementations"]["qgz_intra"])
        else:
            assert stats["qgz_intra"]["inter_node"] == 0, "hop 1 must stay inside the node"
            assert stats["qgz_inter"]["intra_node"] == 0, "hop 2 must only cross nodes"


def _qgz_low_precision_worker(node_size: int):
    """qgZ on bf16 and fp16 gradients (FSDP's reduce dtype with ``reduce_dtype`` bf16/fp16): the result comes back in
    that dtype, within the quantization bound of the exact fp32 sum plus the dtype's rounding of the result."""
    from hf_zeropp.comm.comm_meter import reduce_scatter_single
    from hf_zeropp.comm.qgz import QuantizedReduceScatter

    topology, meter = _setup(node_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        inputs = _gradients(world, rank, integers=False).to(dtype)
        exact = torch.empty(SHARD)
        reduce_scatter_single(exact, inputs.float().reshape(-1), group=None, op=dist.ReduceOp.SUM)
        for intra_bits, inter_bits in ((8, 4), (4, 4)):
            comm = QuantizedReduceScatter(meter, topology, intra_bits, inter_bits, BLOCK, 2, False, 3)
            got = torch.empty(SHARD, dtype=dtype)
            comm(got, inputs.reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
            first = intra_bits if topology.node_size > 1 else inter_bits
            bound = _error_bound(world, topology.nodes, topology.node_size, 2, first, inter_bits, rank, False, dtype)
            tolerance = bound + exact.abs() * torch.finfo(dtype).eps
            error = (got.float() - exact).abs()
            results[(dtype, intra_bits, inter_bits)] = (got.dtype == dtype and bool((error <= tolerance).all()),
                                                        float((error / tolerance).max()))
    return results


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (2, 3)])
def test_qgz_on_bf16_and_fp16_gradients(nodes, node_size):
    for rank, result in enumerate(run_distributed(_qgz_low_precision_worker, nodes * node_size, node_size,
                                                  node_size=node_size)):
        for key, (within, ratio) in result.items():
            assert within, f"rank {rank} {key}: error {ratio:.2f}x the bound"


def _qwz_worker(node_size: int):
    from hf_zeropp.comm.comm_meter import all_gather_single
    from hf_zeropp.comm.qwz import QuantizedAllGather

    topology, meter = _setup(node_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bits in (8, 4):
            shard = (torch.randn(SHARD, generator=torch.Generator().manual_seed(rank)) * 3).to(dtype)
            exact = torch.empty(world * SHARD, dtype=dtype)
            all_gather_single(exact, shard, group=dist.group.WORLD)
            output = torch.empty(world * SHARD, dtype=dtype)
            output.view(world, SHARD)[rank].copy_(shard)  # FSDP's layout: the input is a view into the output
            comm = QuantizedAllGather(meter, topology, bits, BLOCK, quantize_node_local=False)
            # as FSDP's prefetch calls it: a work handle; the output is written when it is waited on
            pending = torch.full((world * SHARD,), float("nan"), dtype=dtype)
            pending.view(world, SHARD)[rank].copy_(shard)
            work = comm(pending, pending.view(world, SHARD)[rank], dist.group.WORLD, async_op=True)
            results[("async handle", dtype, bits)] = isinstance(work, dist.Work)
            work.wait()
            assert comm(output, output.view(world, SHARD)[rank], dist.group.WORLD) is None
            results[("async equals sync", dtype, bits)] = torch.equal(pending, output)
            blocks = torch.nn.functional.pad(exact.float().view(world, SHARD).abs(), (0, -SHARD % BLOCK))
            step = blocks.view(world, -1, BLOCK).amax(-1) / {8: 127, 4: 7}[bits]
            bound = step.repeat_interleave(BLOCK, -1)[:, :SHARD].reshape(-1) / 2
            tolerance = bound * (1 + 1e-5) + exact.float().abs() * torch.finfo(dtype).eps
            error = (output.float() - exact.float()).abs()
            results[(dtype, bits)] = bool((error <= tolerance).all()) and output.dtype == dtype
    results["stats"] = meter.stats()
    return results


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (1, 4)])
def test_qwz_all_gather_stays_within_half_a_step_in_every_dtype(nodes, node_size):
    results = run_distributed(_qwz_worker, nodes * node_size, node_size, node_size=node_size)
    for result in results:
        assert all(v for k, v in result.items() if k != "stats"), result
        implementation = " | ".join(result["stats"]["implementations"]["fwd_allgather"])
        # a single node's gather never leaves the node, so it is not quantized unless asked
        assert ("qwZ" in implementation) == (nodes > 1), implementation


def _reduce_scatter_worker(node_size: int):
    """hf_zeropp's plain reduce-scatter, as FSDP calls it (``MeteredReduceScatter``, which passes the topology's
    ranks per node) and as a work handle, against the float64 sum of every rank's input (each rank rebuilds all
    inputs from their seeds), in fp32 and bf16; also which algorithm ran. The all-to-all sums in fp32 and rounds
    once; gloo's ring, like NCCL's and like stock FSDP2 on gloo, rounds its partial sums to the dtype at each of
    its g - 1 hops."""
    import hf_zeropp.comm.comm_meter as comm_meter

    _, meter = _setup(node_size)
    all_to_all_calls = []
    as_all_to_all = comm_meter._reduce_scatter_as_all_to_all
    comm_meter._reduce_scatter_as_all_to_all = lambda *args: all_to_all_calls.append(1) or as_all_to_all(*args)
    metered = comm_meter.MeteredReduceScatter(meter)
    world, rank = dist.get_world_size(), dist.get_rank()
    roundings = 1 if comm_meter.gloo_reduce_scatter_as_all_to_all(world, node_size) else world - 1
    results = {"backend": dist.get_backend()}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [(torch.randn(world, SHARD, generator=torch.Generator().manual_seed(7 + r)) * 3).to(dtype)
                  for r in range(world)]
        exact = sum(x[rank].double() for x in inputs)
        magnitude = sum(x[rank].double().abs() for x in inputs)
        tolerance = (exact.abs() if roundings == 1 else magnitude) * roundings * torch.finfo(dtype).eps \
            + magnitude * world * torch.finfo(torch.float32).eps
        sync = torch.empty(SHARD, dtype=dtype)
        assert metered(sync, inputs[rank].reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM) is None
        pending = torch.full((SHARD,), float("nan"), dtype=dtype)
        work = metered(pending, inputs[rank].reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM, async_op=True)
        work.wait()
        for name, got in (("sync", sync), ("async", pending)):
            results[(name, dtype)] = bool(((got.double() - exact).abs() <= tolerance).all())
    return results, len(all_to_all_calls)


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (1, 3), (2, 4)])
def test_plain_reduce_scatter_sums_exactly_on_gloo(nodes, node_size):
    """On gloo it runs as an all-to-all plus a local sum where that crosses nodes with fewer bytes than gloo's ring
    all-reduce (2 x 2, and one node), else as gloo's own (2 x 4; see ``gloo_reduce_scatter_as_all_to_all``,
    scripts/benchmarks/wire.py and the bench_cluster probe); either way the sums must be the reduce-scatter's."""
    for result, all_to_all_calls in run_distributed(_reduce_scatter_worker, nodes * node_size, node_size,
                                                    node_size=node_size):
        assert result.pop("backend") == "gloo"
        assert all(result.values()), result
        assert all_to_all_calls == (0 if (nodes, node_size) == (2, 4) else 4)


FEEDBACK_VARIANTS = {"off": {}, "plain": {"error_feedback": True},
                     "loco": {"error_feedback": True, "error_feedback_decay": 0.5},
                     "reset every reduction": {"error_feedback": True, "error_feedback_reset": 1}}


def _error_feedback_worker(steps: int):
    from hf_zeropp.comm.comm_meter import reduce_scatter_single
    from hf_zeropp.comm.qgz import QuantizedReduceScatter

    topology, meter = _setup(2)
    world, rank = dist.get_world_size(), dist.get_rank()
    gradient = _gradients(world, rank, False).reshape(-1)
    exact = torch.empty(SHARD)
    reduce_scatter_single(exact, gradient.clone(), group=None, op=dist.ReduceOp.SUM)
    errors = {}
    for name, options in FEEDBACK_VARIANTS.items():
        comm = QuantizedReduceScatter(meter, topology, 8, 4, BLOCK, 1, False, 0, **options)
        total = torch.zeros(SHARD)
        for _ in range(steps):
            got = torch.empty(SHARD)
            comm(got, gradient.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
            total += got
        errors[name] = (float((got - exact).norm()), float((total / steps - exact).norm()))
        if comm.feedback is not None:
            state = comm.feedback.state_dict()
            errors[f"residual_bytes_{name}"] = sum(codes.numel() for codes, _ in state["residuals"].values())
            errors[f"reductions_{name}"] = state["reductions"]
    return errors


def test_error_feedback_cancels_the_inter_node_rounding_over_steps():
    """The same gradient every step, rounded to nearest: without feedback every step repeats the same error, so the
    mean over steps is as wrong as one step; with feedback the 4-bit hop's error cancels and only the 8-bit first
    hop's remains; LoCo's averaged residual cancels it too, more slowly; a residual reset before every reduction is
    no feedback at all. The residual is 1/node_size of the gradient at 8 bits."""
    steps = 8
    for rank, errors in enumerate(run_distributed(_error_feedback_worker, 4, steps, node_size=2)):
        plain_step, plain_mean = errors["off"]
        assert plain_mean == pytest.approx(plain_step, rel=1e-6)
        assert errors["plain"][1] < 0.3 * plain_mean, (rank, errors)
        assert errors["loco"][1] < 0.6 * plain_mean, (rank, errors)
        assert errors["reset every reduction"] == errors["off"]
        assert errors["reductions_loco"] == steps
        assert errors["residual_bytes_plain"] == 4 * SHARD // 2  # (nodes x slice) int8 = world * shard / node_size


def _own_contribution_reference(world: int, node_size: int, rank: int, stages: int, intra_bits: int,
                                inter_bits: int, hadamard: int) -> torch.Tensor:
    """qgZ's SUM for ``rank`` with every rank's own contribution kept exact, written out hop by hop from the
    reference quantizer: node m's owner of my rows (local index = mine) sums its peers' dequantized rows and its own
    exact ones, requantizes them for me unless m is my node, and I sum those and my node's exact partial sum."""
    from hf_zeropp.kernels import reference

    nodes, node, local = world // node_size, rank // node_size, rank % node_size
    slice_len = -(-SHARD // stages)

    def round_trip(rows: torch.Tensor, bits: int) -> torch.Tensor:
        return reference._dequantize_rows(*reference._quantize_rows(rows, bits, BLOCK, False, 0, None), bits, BLOCK,
                                          slice_len)

    first_bits = intra_bits if node_size > 1 else inter_bits
    mine = torch.zeros(world, stages * slice_len)  # every rank's chunk addressed to me
    for source in range(world):
        mine[source, :SHARD] = _gradients(world, source, integers=False)[rank]
    result = torch.zeros(stages, slice_len)
    for s in range(stages):
        rows = reference.hadamard_rows(mine[:, s * slice_len:(s + 1) * slice_len].contiguous(), hadamard)
        partials = []
        for m in range(nodes):
            peers = [round_trip(rows[m * node_size + d:m * node_size + d + 1], first_bits)
                     for d in range(node_size) if d != local]
            total = peers[0].clone() if peers else torch.zeros(1, slice_len)
            for peer in peers[1:]:
                total = total + peer
            partials.append(total + rows[m * node_size + local] if peers else rows[m * node_size + local:][:1])
        if nodes == 1:
            total = partials[0]
        else:
            others = [round_trip(partials[m], inter_bits) for m in range(nodes) if m != node]
            total = others[0].clone()
            for other in others[1:]:
                total = total + other
            total = total + partials[node]
        result[s] = reference.hadamard_rows(total, hadamard)[0]
    return result.reshape(-1)[:SHARD]


def _full_precision_local_worker(node_size: int):
    from hf_zeropp.comm.comm_meter import reduce_scatter_single
    from hf_zeropp.comm.qgz import QuantizedReduceScatter

    topology, meter = _setup(node_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    exact = torch.empty(SHARD)
    reduce_scatter_single(exact, _gradients(world, rank, False).reshape(-1), group=None, op=dist.ReduceOp.SUM)
    results = {}
    for stages, intra_bits, inter_bits, hadamard in ((1, 8, 4, 0), (2, 4, 4, 0), (1, 8, 4, 32), (2, 8, 8, 64)):
        got = {}
        for local in (False, True):
            comm = QuantizedReduceScatter(meter, topology, intra_bits, inter_bits, BLOCK, stages, False, 0,
                                          hadamard=hadamard, full_precision_local=local, backend="reference")
            got[local] = torch.empty(SHARD)
            comm(got[local], _gradients(world, rank, False).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
        expected = _own_contribution_reference(world, node_size, rank, stages, intra_bits, inter_bits, hadamard)
        results[(stages, intra_bits, inter_bits, hadamard)] = (
            float((got[True] - expected).abs().max()), float(expected.abs().max()),
            float((got[True] - exact).norm()), float((got[False] - exact).norm()))
    combinations = {"error feedback": {"error_feedback": True, "hadamard": 64},
                    "widths": {"allocate_bits": True, "hadamard": 64, "width_floor": 2},
                    "stochastic rounding": {"stochastic": True}}
    for name, options in combinations.items():
        errors = {}
        for local in (False, True):
            comm = QuantizedReduceScatter(meter, topology, 8, 4, BLOCK, 1, full_precision_local=local,
                                          **{"stochastic": False, "seed": 5, **options})
            got = torch.empty(SHARD)
            comm(got, _gradients(world, rank, False).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
            errors[local] = float((got - exact).norm())
        results[name] = (errors[True], errors[False])
        if comm.feedback is not None and topology.nodes > 1 and topology.node_size > 1:
            from hf_zeropp.kernels import dequantize

            residual = comm.feedback.state_dict()["residuals"][0]
            dropped = dequantize(*residual, bits=8, block_size=BLOCK, length=SHARD).abs().amax(1)
            results["residual per node"] = dropped.tolist()
    results["implementation"] = " | ".join(" | ".join(lines) for lines in meter.stats()["implementations"].values())
    return results


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (2, 4), (4, 2), (3, 1), (1, 4)])
def test_full_precision_local_adds_each_ranks_own_rows_exactly(nodes, node_size):
    """``gradient_full_precision_local``: against a hop-by-hop reference in which every rank's own rows (hop 1) and
    its node's partial sums (hop 2) skip quantization, with and without rotation, at 1 and 2 stages and one rank per
    node; the error falls against the option off, also with error feedback, per-block widths or stochastic
    rounding. With error feedback the own node's row carries no residual, every other node's does."""
    world = nodes * node_size
    for rank, result in enumerate(run_distributed(_full_precision_local_worker, world, node_size,
                                                  node_size=node_size)):
        for key, value in result.items():
            if not isinstance(key, tuple):
                continue
            deviation, magnitude, error_on, error_off = value
            # the reference adds the own rows in the rotated domain: equal up to fp32 rounding
            assert deviation <= 1e-5 * magnitude, (rank, key, value)
            assert error_on < error_off, (rank, key, value)
        for name in ("error feedback", "widths", "stochastic rounding"):
            error_on, error_off = result[name]
            assert error_on < error_off, (rank, name, result[name])
        assert "own contributions in fp32" in result["implementation"]
        if nodes > 1 and node_size > 1:  # the row for my own node reached its owner exactly: nothing carried
            residual = result["residual per node"]
            mine = rank // node_size
            assert residual[mine] == 0.0 and min(residual[:mine] + residual[mine + 1:]) > 0, residual
