"""Per-block bit widths for qgZ's inter-node hop: the format against an independent bit-by-bit decoder, the width
rule's budget and optimality, its error on blocks of unequal size, and qgZ with it on real gloo process groups."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import hf_zeropp.kernels as K
from hf_zeropp.kernels import dequantize_allocated, quantize_allocated
from hf_zeropp.kernels.allocation import block_widths, round_trip_with_widths
from hf_zeropp.testing.spawn import run_distributed


def _unequal_blocks(rows: int, length: int, block: int, spread: float, seed: int) -> torch.Tensor:
    """Gaussian rows whose blocks' magnitudes are log-normal with ``spread`` (natural log) between blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-length // block)
    magnitudes = torch.exp(spread * torch.randn(rows, blocks, 1, generator=g))
    values = torch.randn(rows, blocks, block, generator=g) * magnitudes
    return values.view(rows, -1)[:, :length].contiguous()


def _relative_error(restored: torch.Tensor, x: torch.Tensor) -> float:
    return float((restored - x).norm() / x.norm())


def _decode_bit_by_bit(codes: torch.Tensor, widths: list[int], counts: list[int]) -> list[list[int]]:
    """The stored codes of one row read as the format says, one bit at a time (independent of the vectorized
    decoder): blocks back to back, each ``b`` bits per code, least significant bit first, 8 codes per ``b`` bytes."""
    data = codes.view(torch.uint8).tolist()
    bit = 0
    blocks = []
    for width, count in zip(widths, counts):
        padded = -(-count // 8) * 8
        values = []
        for _ in range(padded if width else 0):
            value = sum(((data[(bit + k) // 8] >> ((bit + k) % 8)) & 1) << k for k in range(width))
            values.append(value - (2 ** (width - 1) - 1))
            bit += width
        blocks.append(values[:count])
    assert all(byte == 0 for byte in data[-(-bit // 8):]), "the row's unused bytes must be zero"
    return blocks


@pytest.mark.parametrize("length,block", [(1000, 256), (4096, 256), (517, 64), (64, 64)])
def test_codes_are_laid_out_as_the_format_says(length, block):
    x = _unequal_blocks(3, length, block, spread=1.5, seed=length)
    codes, scales = quantize_allocated(x, 4, block)
    assert codes.shape == (3, K.packed_length(length, 4)) and codes.dtype == torch.int8
    assert scales.shape == (3, K.num_blocks(length, block))
    widths = block_widths(scales, length, 4, block)
    counts = [min(block, length - i * block) for i in range(scales.shape[1])]
    restored = dequantize_allocated(codes, scales, bits=4, block_size=block, length=length)
    for row in range(3):
        decoded = _decode_bit_by_bit(codes[row], widths[row].tolist(), counts)
        for i, (width, values) in enumerate(zip(widths[row].tolist(), decoded)):
            part = slice(i * block, i * block + counts[i])
            if width == 0:
                assert torch.equal(restored[row, part], torch.zeros(counts[i]))
                continue
            qmax = 2 ** (width - 1) - 1
            step = scales[row, i] / qmax
            expected = torch.round(x[row, part] / step).clamp(-qmax, qmax)
            assert values == expected.int().tolist(), f"row {row} block {i} ({width} bits)"
            assert torch.equal(restored[row, part], expected * step)


@pytest.mark.parametrize("bits", [4, 8])
def test_equal_scales_give_the_fixed_format_values(bits):
    """Every block with the same absmax: every block gets ``bits`` and the values are the fixed format's exactly."""
    g = torch.Generator().manual_seed(bits)
    x = (torch.rand(4, 2048, generator=g) * 5.8 - 2.9).view(4, 8, 256)
    x[:, :, 17] = -3.0
    x = x.view(4, 2048)
    codes, scales = quantize_allocated(x, bits, 256)
    assert torch.equal(block_widths(scales, 2048, bits, 256), torch.full((4, 8), bits))
    fixed = K.dequantize(*K.quantize(x, bits, 256), bits=bits, block_size=256, length=2048)
    assert torch.equal(dequantize_allocated(codes, scales, bits=bits, block_size=256, length=2048), fixed)


def test_widths_spend_the_budget_and_follow_the_scales():
    """The widths fit the fixed format's bytes and leave less unspent than one block's smallest step could take
    (0 to 2 bits), a larger scale never gets fewer bits, and scaling a whole row (the loss scale, the learning rate
    of the gradients) does not change them: only the ratios between blocks decide."""
    length, block, bits = 3000, 64, 4
    x = _unequal_blocks(16, length, block, spread=2.0, seed=5)
    _, scales = quantize_allocated(x, bits, block)
    widths = block_widths(scales, length, bits, block)
    counts = torch.tensor([-(-min(block, length - i * block) // 8) * 8 for i in range(scales.shape[1])])
    budget = 8 * K.packed_length(length, bits)
    cost = (widths * counts).sum(-1)
    assert (cost <= budget).all() and (budget - cost < 2 * block).all(), cost
    order = scales.argsort(-1)
    assert (widths.gather(-1, order).diff(dim=-1) >= 0).all(), "a larger block must never get fewer bits"
    assert set(widths.unique().tolist()) <= {0, 2, 3, 4, 5, 6, 7, 8} and widths.max() == 8 and widths.min() == 0
    assert torch.equal(block_widths(scales * 1024, length, bits, block), widths)


def test_a_floor_at_the_fixed_width_moves_only_the_bits_of_all_zero_blocks():
    """The width rule held to the fixed width (scripts/experiments/fidelity/'s "bits move only from zero blocks"):
    with no
    all-zero block nothing moves, however unequal the scales; with some, every other block is at least as fine as
    in the fixed format, element by element within half a fixed-width step, and the zero blocks' bits go to the
    largest blocks."""
    length, block, bits = 4096, 256, 4
    x = _unequal_blocks(4, length, block, spread=2.0, seed=11)
    scales = x.view(4, -1, block).abs().amax(-1)
    assert torch.equal(block_widths(scales, length, bits, block, floor=bits), torch.full_like(scales, bits).long())

    x.view(4, -1, block)[:, ::4] = 0  # a quarter of the blocks all zero: their bits are free
    scales = x.view(4, -1, block).abs().amax(-1)
    widths = block_widths(scales, length, bits, block, floor=bits)
    used = scales > 0
    assert (widths[used] >= bits).all() and (widths[~used] == 0).all()
    assert ((widths * block).sum(-1) <= 8 * K.packed_length(length, bits)).all()
    largest = scales.argmax(-1, keepdim=True)
    assert (widths.gather(-1, largest) > bits).all(), "the largest block of each row gets the freed bits"
    restored = round_trip_with_widths(x, widths, block)
    bound = (scales / (2 ** (bits - 1) - 1) / 2 * 1.0001)[..., None]  # half a fixed-width step per element
    assert ((restored - x).view(4, -1, block).abs() <= bound).all()
    fixed = K.dequantize(*K.quantize(x, bits, block), bits=bits, block_size=block, length=length)
    unfloored = round_trip_with_widths(x, block_widths(scales, length, bits, block), block)
    # less error than the fixed width (the freed bits), more than the unfloored rule (which also trades bits
    # between non-zero blocks)
    assert _relative_error(unfloored, x) < _relative_error(restored, x) < _relative_error(fixed, x) / 1.5


def test_a_floor_that_cannot_fit_is_lowered_to_the_largest_width_that_does():
    """517 elements in blocks of 64: the short last block is padded to 8 codes, so 4 bits on every block would
    take 4 bits more than the fixed format's 259 bytes. A row without a zero block gets a floor of 3 and fits; a row
    with one keeps 4."""
    x = _unequal_blocks(2, 517, 64, spread=1.0, seed=3)
    x[1, :64] = 0
    scales = torch.stack([x[:, i * 64:(i + 1) * 64].abs().amax(-1) for i in range(9)], -1)
    widths = block_widths(scales, 517, 4, 64, floor=4)
    counts = torch.tensor([64] * 8 + [8])
    assert ((widths * counts).sum(-1) <= 8 * K.packed_length(517, 4)).all()
    assert widths[0].min() == 3 and widths[1, 1:].min() == 4 and widths[1, 0] == 0
    with pytest.raises(ValueError, match="floor=1 must be 0"):
        block_widths(scales, 517, 4, 64, floor=1)


def test_a_floor_of_two_sends_every_nonzero_block_and_both_ends_apply_it():
    """gradient_bit_allocation_floor: 2 on rows whose unfloored widths send many nonzero blocks as zeros: through
    the wire format every nonzero block now comes back nonzero (its largest element at least), the codes fit the
    fixed bytes, the values are the round trip at the floored widths, and the error stays far below the fixed
    width's. A receiver that forgot the floor would read other widths: it decodes garbage, which is why qgZ passes
    one floor to both ends."""
    length, block, bits = 4096, 64, 4
    x = _unequal_blocks(8, length, block, spread=2.5, seed=17)
    x.view(8, -1, block)[:, ::8] = 0  # some all-zero blocks stay width 0
    scales = x.view(8, -1, block).abs().amax(-1)
    unfloored = block_widths(scales, length, bits, block)
    assert int(((unfloored == 0) & (scales > 0)).sum()) > 50, "the test needs nonzero blocks the rule sends as zeros"

    codes, sent_scales = quantize_allocated(x, bits, block, floor=2)
    assert codes.shape[-1] == K.packed_length(length, bits)
    restored = dequantize_allocated(codes, sent_scales, bits=bits, block_size=block, length=length, floor=2)
    widths = block_widths(scales, length, bits, block, floor=2)
    assert (widths[scales > 0] >= 2).all() and (widths[scales == 0] == 0).all()
    torch.testing.assert_close(restored, round_trip_with_widths(x, widths, block), rtol=0, atol=0)
    blocks_back = restored.view(8, -1, block).abs().amax(-1)
    assert torch.equal(blocks_back > 0, scales > 0)
    torch.testing.assert_close(blocks_back, scales)  # the largest element of a block is sent exactly
    fixed = K.dequantize(*K.quantize(x, bits, block), bits=bits, block_size=block, length=length)
    unfloored_error = _relative_error(round_trip_with_widths(x, unfloored, block), x)
    assert unfloored_error <= _relative_error(restored, x) < _relative_error(fixed, x) / 2
    misread = dequantize_allocated(codes, sent_scales, bits=bits, block_size=block, length=length)
    assert _relative_error(misread, x) > 10 * _relative_error(restored, x)


@pytest.mark.parametrize("spread,lowest_gain", [(1.0, 2.0), (2.0, 6.0)])
def test_unequal_blocks_lose_far_less_than_the_fixed_width(spread, lowest_gain):
    """Reverse water-filling: the error falls by about sqrt(AM / GM) of the blocks' squared scales, which for
    log-normal magnitudes is exp(spread**2) — 2.7x at spread 1, 55x at spread 2 (less where widths clip at 0 or 8)."""
    x = _unequal_blocks(8, 64 * 256, 256, spread, seed=int(spread * 10))
    fixed = _relative_error(K.dequantize(*K.quantize(x, 4, 256), bits=4, block_size=256, length=x.shape[1]), x)
    allocated = _relative_error(dequantize_allocated(*quantize_allocated(x, 4, 256), bits=4, block_size=256,
                                                     length=x.shape[1]), x)
    assert fixed / allocated > lowest_gain, (fixed, allocated)
    assert fixed / allocated < math.exp(spread**2) * 1.5


def test_zero_and_non_finite_blocks():
    x = torch.randn(3, 768)
    x[0, :256] = 0
    x[1, 300] = float("nan")
    x[2, 600] = float("inf")
    restored = dequantize_allocated(*quantize_allocated(x, 4, 256), bits=4, block_size=256, length=768)
    assert torch.equal(restored[0, :256], torch.zeros(256))
    blocks_nan = restored.view(3, 3, 256).isnan().all(-1)
    assert blocks_nan.tolist() == [[False, False, False], [False, True, False], [False, False, True]]


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = _unequal_blocks(2, 1024, 256, spread=0.5, seed=9)
    first = quantize_allocated(x, 4, 256, stochastic=True, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, quantize_allocated(x, 4, 256, stochastic=True, seed=1)))
    draws = torch.stack([dequantize_allocated(*quantize_allocated(x, 4, 256, stochastic=True, seed=s), bits=4,
                                              block_size=256, length=1024) for s in range(300)])
    single = _relative_error(draws[0], x)
    assert _relative_error(draws.mean(0), x) < 2 * single / math.sqrt(300)


def test_a_block_size_that_does_not_fill_whole_bytes_is_refused():
    with pytest.raises(ValueError, match="block_size=12 must be a positive multiple of 8"):
        quantize_allocated(torch.randn(2, 100), 4, 12)


SHARD = 64 * 7  # elements per rank: 7 blocks of 64 per chunk


def _heterogeneous_gradients(world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter input (world, SHARD): block magnitudes spread over three orders of magnitude,
    by position (as a layer's are), plus per-rank noise."""
    g = torch.Generator().manual_seed(200 + rank)
    position_scale = torch.logspace(-3, 0, SHARD // 64).repeat_interleave(64)
    return torch.randn(world, SHARD, generator=g) * position_scale


def _allocation_worker(node_size: int):
    from hf_zeropp.comm.comm_meter import CommMeter, reduce_scatter_single
    from hf_zeropp.config.config import ZeroPPConfig
    from hf_zeropp.comm.qgz import QuantizedReduceScatter
    from hf_zeropp.comm.topology import get_topology

    topology = get_topology(ZeroPPConfig(node_size=node_size), "cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    exact = torch.empty(SHARD)
    reduce_scatter_single(exact, _heterogeneous_gradients(world, rank).reshape(-1), group=None, op=dist.ReduceOp.SUM)
    results = {}
    for name, options in (("fixed", {}), ("allocated", {"allocate_bits": True}),
                          ("allocated, floor 2", {"allocate_bits": True, "width_floor": 2}),
                          ("allocated, hadamard, 2 stages", {"allocate_bits": True, "hadamard": 32, "stages": 2}),
                          ("fixed, hadamard, 2 stages", {"hadamard": 32, "stages": 2}),
                          ("allocated + error feedback", {"allocate_bits": True, "error_feedback": True})):
        meter = CommMeter(topology)
        stages = options.pop("stages", 1)
        comm = QuantizedReduceScatter(meter, topology, 8, 4, 64, stages, False, 3, **options)
        got = torch.empty(SHARD)
        comm(got, _heterogeneous_gradients(world, rank).reshape(-1), dist.group.WORLD, dist.ReduceOp.SUM)
        stats = meter.stats()
        results[name] = {"error": float((got - exact).norm() / exact.norm()),
                         "inter_bytes": stats.get("qgz_inter", stats.get("qgz_intra"))["inter_node"],
                         "implementations": stats["implementations"]}
    return results


@pytest.mark.parametrize("nodes,node_size", [(2, 2), (3, 2), (4, 1), (1, 4)])
def test_qgz_with_bit_allocation_is_more_accurate_at_the_same_cross_node_bytes(nodes, node_size):
    results = run_distributed(_allocation_worker, nodes * node_size, node_size, node_size=node_size)
    for rank, result in enumerate(results):
        fixed, allocated = result["fixed"], result["allocated"]
        assert allocated["inter_bytes"] == fixed["inter_bytes"], f"rank {rank}: cross-node bytes differ"
        if nodes == 1:  # no hop crosses nodes: nothing to allocate, the same numbers
            assert allocated["error"] == fixed["error"]
            continue
        described = " ".join(allocated["implementations"]["qgz_inter"])
        assert "per-block bit widths on the inter-node hop" in described
        assert ("(C++ kernel)" if K.active_backend("cpu") == "cpp" else "(plain torch)") in described
        # measured 8.5-13x lower on these gradients; a misplaced block or a wrong width would be far worse
        assert allocated["error"] < fixed["error"] / 4, (rank, allocated["error"], fixed["error"])
        # the floor gives the blocks the rule sent as zeros (the smallest of the three decades) 2 bits, taken
        # from the largest blocks: measured 1.35-1.7x the unfloored error, 5.5-9x below the fixed width's
        floored = result["allocated, floor 2"]
        assert floored["inter_bytes"] == fixed["inter_bytes"]
        assert "at least 2 bits per nonzero block" in " ".join(floored["implementations"]["qgz_inter"])
        assert 1.2 * allocated["error"] < floored["error"] < fixed["error"] / 4, (rank, floored["error"])
        # two stages leave 3.5 blocks per row, fewer to trade bits between: measured 1.4-1.9x lower
        rotated = result["allocated, hadamard, 2 stages"]
        assert rotated["error"] < result["fixed, hadamard, 2 stages"]["error"] / 1.25, rank
        # a first reduction has no residual yet: error feedback sends the same rows
        assert result["allocated + error feedback"]["error"] == allocated["error"], rank


def _tiny_model_steps(options: dict) -> dict:
    """Three AdamW steps of a tiny GPT-2 under ZeRO++ with ``options``; what comm_stats and rank 0's warnings said."""
    import warnings

    import hf_zeropp
    from hf_zeropp.testing.tiny_models import local_batch, tiny_gpt2

    torch.manual_seed(0)
    model = tiny_gpt2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_zeropp.shard_model(model, {**hf_zeropp.PRESETS["zeropp-accurate"], **options})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        ids = local_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    stats = hf_zeropp.comm_stats(model)
    return {"losses": losses, "implementations": stats["implementations"],
            "inter_node": stats.get("qgz_inter", {}).get("inter_node", 0),
            "warnings": [str(w.message) for w in caught if "not applied" in str(w.message)]}


def test_a_tiny_transformer_trains_with_it_and_cross_node_bytes_stay_the_same():
    """2 emulated nodes x 2 on a real transformers model: the option is reported as running, sends exactly the
    bytes of the fixed format, and the losses follow plain zeropp-accurate's closely (same data, same init)."""
    plain = run_distributed(_tiny_model_steps, 4, {}, node_size=2)
    allocated = run_distributed(_tiny_model_steps, 4, {"gradient_bit_allocation": True}, node_size=2)
    compiled = K.active_backend("cpu") == "cpp"
    for p, a in zip(plain, allocated):
        assert a["inter_node"] == p["inter_node"] > 0
        described = " ".join(a["implementations"]["qgz_inter"])
        assert "per-block bit widths on the inter-node hop" in described
        assert ("(C++ kernel)" if compiled else "(plain torch)") in described
        assert not a["warnings"] and not p["warnings"]
        assert a["losses"][0] == p["losses"][0]  # the first forward precedes any gradient
        assert a["losses"] == pytest.approx(p["losses"], rel=2e-2) and a["losses"] != p["losses"]
    if compiled:  # the C++ kernel of the width format trains exactly as its plain-torch spec
        spec = run_distributed(_tiny_model_steps, 4, {"gradient_bit_allocation": True, "kernel_backend": "reference"},
                               node_size=2)
        for s, a in zip(spec, allocated):
            assert "(plain torch)" in " ".join(s["implementations"]["qgz_inter"])
            assert s["losses"] == a["losses"]


@pytest.mark.parametrize("nodes,node_size,expected", [
    (1, 4, {"gradient_bit_allocation", "gradient_error_feedback"}),
    (4, 1, {"gradient_error_feedback"}),
])
def test_options_of_the_inter_node_hop_that_cannot_apply_are_reported(nodes, node_size, expected):
    """One node has no inter-node hop; one rank per node has no requantization between hops for error feedback to
    compensate. Each is said once by rank 0 and recorded in comm_stats, rather than silently skipped."""
    options = {"gradient_bit_allocation": True, "gradient_error_feedback": True}
    results = run_distributed(_tiny_model_steps, nodes * node_size, options, node_size=node_size)
    for rank, result in enumerate(results):
        for option in expected:
            assert result["implementations"][option][0].startswith("not applied: "), (rank, option)
        assert ("gradient_bit_allocation" in result["implementations"]) == ("gradient_bit_allocation" in expected)
        said = [w for w in result["warnings"] if w.startswith("hf_zeropp: gradient_")]
        assert len(said) == (len(expected) if rank == 0 else 0), result["warnings"]


@pytest.mark.parametrize("device_type,backend,nodes,rank,warns", [
    ("xpu", None, 2, 0, True),        # no compiled kernel for the device: the width format's spec runs
    ("xpu", None, 2, 1, False),       # said by rank 0 only
    ("xpu", "reference", 2, 0, False),  # plain torch everywhere was asked for
    ("xpu", None, 1, 0, False),       # one node: the widths do not apply (reported as such elsewhere)
    ("cuda", None, 2, 0, False),      # the CUDA kernel runs
    ("cuda", "cuda", 2, 0, False),
    ("cpu", None, 2, 0, False),       # the C++ kernel runs
])
def test_widths_on_a_device_without_their_kernel_are_said_once(device_type, backend, nodes, rank, warns):
    """The width format has compiled kernels for CPU and CUDA; on another device its plain-torch spec runs, slower
    than the fixed format there. That is said once, naming the option that avoids it, not left silent."""
    import warnings

    from hf_zeropp.comm.comm_meter import CommMeter
    from hf_zeropp.config.config import ZeroPPConfig
    from hf_zeropp.engine.reports import _report_width_format_without_kernel
    from hf_zeropp.engine.state import ZeroPPState
    from hf_zeropp.comm.topology import Topology

    config = ZeroPPConfig(quantized_gradients=True, gradient_bit_allocation=True, kernel_backend=backend,
                          node_size=2)
    topology = Topology.from_config(config, 2 * nodes, rank=rank, device_type=device_type)
    state = ZeroPPState(config, topology, CommMeter(topology), units=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _report_width_format_without_kernel(state)
        _report_width_format_without_kernel(ZeroPPState(ZeroPPConfig(quantized_gradients=True, node_size=2),
                                                        topology, CommMeter(topology), units=[]))
    said = [str(w.message) for w in caught]
    assert len(said) == (1 if warns else 0), said
    if warns:
        assert "plain-torch" in said[0] and "gradient_bit_allocation: false" in said[0] and device_type in said[0]
