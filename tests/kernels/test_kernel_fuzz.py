"""Property-based fuzzing of the quantization kernels: the compiled backends ("cpp" on CPU tensors, "cuda" on CUDA
tensors where a GPU is visible) must equal the plain-torch reference on CPU ("reference") bit for bit on *any* input
the public API accepts.

``tests/kernels/test_kernels.py`` checks hand-picked shapes; here hypothesis draws the shapes (0 and 1 elements, primes,
lengths that leave tail blocks), dtypes (fp32/fp16/bf16), bits, block sizes (odd ones only where 8-bit allows
them), memory layouts (transposed, strided, offset views) and values (NaN, ±Inf, denormals, all-zero blocks, values
so small that the block scale underflows, values near the dtype's maximum), with stochastic rounding on and off.
NaN *positions* must agree; NaN payloads may differ (they are not part of the format).

``derandomize=True`` makes every run draw the same examples (CI is reproducible; a failure prints the example),
``deadline=None`` because the machine is shared and timings are noisy; ``max_examples`` keeps the file well under
a minute.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_zeropp.kernels as K

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(K.active_backend("cpu") != "cpp", reason="the cpp kernels did not build on this machine"),
]

FUZZ = settings(deadline=None, derandomize=True, max_examples=1000, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (backend, device) of every compiled backend this machine can run
COMPILED = [("cpp", "cpu")] + ([("cuda", "cuda")] if torch.cuda.is_available() else [])
# 0 and 1 elements, primes, powers of two and their neighbours, plus anything up to 700
LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 31, 97, 127, 128, 129, 257, 509, 1021]),
                    st.integers(0, 700))
ROWS = st.sampled_from([0, 1, 2, 3, 5])
BITS = st.sampled_from([4, 8])
SEEDS = st.integers(-(2**40), 2**40)  # the kernels use the low 32 bits, as the reference does
SPECIAL_KINDS = ["nan", "inf", "-inf", "denormal", "zero_block", "huge", "underflow_block"]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equality, except that any NaN matches any NaN (payloads are not part of the format)."""
    actual = actual.cpu()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if actual.is_floating_point():
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(actual), nan), "NaN positions differ"
        actual, expected = actual[~nan], expected[~nan]
        # compare bits, so that -0.0 vs +0.0 would also be caught
        view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[actual.dtype]
        actual, expected = actual.contiguous().view(view), expected.contiguous().view(view)
    assert torch.equal(actual, expected), "values differ"


@st.composite
def block_sizes(draw, *bits: int) -> int:
    """Even block sizes from 2 up (4-bit packs two codes per byte and needs them); odd ones too for 8-bit only."""
    if all(b == 8 for b in bits) and draw(st.booleans()):
        return draw(st.sampled_from([1, 3, 5, 7, 127, 255, 257]))
    return 2 * draw(st.one_of(st.sampled_from([1, 2, 4, 64, 128]), st.integers(1, 300)))


def _layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``values`` (rows, L), stored contiguously or as a non-contiguous / offset view, on
    ``values``' device."""
    rows, length = values.shape
    device = values.device
    if layout == "transposed":  # strides (1, rows)
        return values.t().contiguous().t()
    if layout == "strided":  # every other column of a wider buffer
        wide = torch.full((rows, 2 * length), 12345.0, dtype=values.dtype, device=device)
        wide[:, ::2] = values
        return wide[:, ::2]
    if layout == "offset":  # a view that starts inside its storage
        big = torch.full((rows + 1, length), -7.0, dtype=values.dtype, device=device)
        big[1:] = values
        return big[1:]
    return values


@st.composite
def float_rows(draw, rows: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, length) values in ``dtype``: a seeded random base at a drawn magnitude, plus special values."""
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1.0, 1e-3, 300.0, 1e4, 1e-40, 0.0]))
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, length, generator=g)
    if draw(st.booleans()):
        base = base ** 3  # heavy tail
    x = base * magnitude
    info = torch.finfo(dtype)
    for _ in range(draw(st.integers(0, 4)) if rows * length else 0):
        kind = draw(st.sampled_from(SPECIAL_KINDS))
        r, c = draw(st.integers(0, rows - 1)), draw(st.integers(0, length - 1))
        if kind == "nan":
            x[r, c] = float("nan")
        elif kind == "inf":
            x[r, c] = float("inf")
        elif kind == "-inf":
            x[r, c] = -float("inf")
        elif kind == "denormal":
            x[r, c] = info.tiny / 4 if dtype != torch.float32 else 1e-39
        elif kind == "huge":
            x[r, c] = info.max * draw(st.sampled_from([1.0, -1.0, 0.5]))
        else:  # a stretch of zeros, or of values whose block scale absmax / qmax underflows to 0 in fp32
            stretch = draw(st.integers(1, 300))
            x[r, c:c + stretch] = 0.0 if kind == "zero_block" else 1e-45
    return x.to(dtype)


@st.composite
def scales_like(draw, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 block scales as quantize makes them (non-negative), with zeros, NaN, Inf and denormals mixed in."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scales = torch.rand(shape, generator=g) * draw(st.sampled_from([1.0, 1e-3, 1e3, 1e30, 1e-38]))
    flat = scales.view(-1)
    for _ in range(draw(st.integers(0, 3)) if flat.numel() else 0):
        i = draw(st.integers(0, flat.numel() - 1))
        flat[i] = draw(st.sampled_from([0.0, float("nan"), float("inf"), 1e-40, 3.4e38]))
    return scales


def random_codes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Any int8 byte pattern (for 4-bit: any two nibbles), as a corrupted or foreign payload could hold."""
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), rows=ROWS, length=LENGTHS, dtype=st.sampled_from(DTYPES), bits=BITS,
       layout=st.sampled_from(["contiguous", "transposed", "strided", "offset"]), stochastic=st.booleans(),
       seed=SEEDS, lead=st.sampled_from([(), (2,)]))
def test_quantize_and_round_trip_match_reference(backend, device, data, rows, length, dtype, bits, layout, stochastic,
                                                 seed, lead):
    block = data.draw(block_sizes(bits))
    values = data.draw(float_rows(rows, length, dtype))

    def arrange(on: str) -> torch.Tensor:
        x = _layout(values.to(on), layout)
        if lead:  # a 3-D input: leading dimensions are flattened into rows
            x = torch.stack([x, x.flip(0)]) if rows else x.unsqueeze(0).expand(2, rows, length)
        return x

    x = arrange("cpu")
    ref = K.quantize(x, bits, block, stochastic=stochastic, seed=seed, backend="reference")
    got = K.quantize(arrange(device), bits, block, stochastic=stochastic, seed=seed, backend=backend)
    assert_same(got.codes, ref.codes)
    assert_same(got.scales, ref.scales)
    out_dtype = data.draw(st.sampled_from(DTYPES))
    kwargs = dict(bits=bits, block_size=block, length=length, dtype=out_dtype)
    back_ref = K.dequantize(*ref, backend="reference", **kwargs)
    assert_same(K.dequantize(*got, backend=backend, **kwargs), back_ref)
    # the format's promises hold on whatever was drawn: zero blocks exact, a non-finite block never comes back finite
    if x.numel():
        flat_x = x.float().reshape(-1, length)
        flat_back = back_ref.float().reshape(-1, length)
        assert not torch.isfinite(flat_back[~torch.isfinite(flat_x)]).any(), "a non-finite input came back finite"
        zeros = flat_back[flat_x == 0]  # code 0 times the block scale: 0, or NaN in a non-finite block
        assert bool(((zeros == 0) | torch.isnan(zeros)).all()), "a zero came back non-zero"


# ---------------------------------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), rows=ROWS, length=LENGTHS, bits=BITS, dtype=st.sampled_from(DTYPES),
       code_seed=st.integers(0, 2**31 - 1), transposed=st.booleans(), into_view=st.booleans())
def test_dequantize_of_arbitrary_codes_and_scales_matches_reference(backend, device, data, rows, length, bits, dtype,
                                                                   code_seed, transposed, into_view):
    block = data.draw(block_sizes(bits))
    codes = random_codes((rows, K.packed_length(length, bits)), code_seed)
    if transposed:
        codes = codes.t().contiguous().t()
    scales = data.draw(scales_like((rows, K.num_blocks(length, block))))
    kwargs = dict(bits=bits, block_size=block, length=length, dtype=dtype)
    ref = K.dequantize(codes, scales, backend="reference", **kwargs)
    codes, scales = codes.to(device), scales.to(device)
    if into_view:  # out= a contiguous view inside a larger buffer, as qwZ writes into FSDP's gather buffer
        buffer = torch.full((rows + 1, length), 5.0, dtype=dtype, device=device)
        got = K.dequantize(codes, scales, backend=backend, out=buffer[1:], **kwargs)
        assert bool((buffer[0] == 5.0).all()), "dequantize wrote outside its out= view"
    else:
        got = K.dequantize(codes, scales, backend=backend, **kwargs)
    assert_same(got, ref)


# ---------------------------------------------------------------------------------------------------- qgZ kernels


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), nodes=st.integers(1, 4), node_size=st.integers(1, 4), stages=st.integers(1, 3),
       length=st.one_of(st.sampled_from([0, 1, 2, 3, 7, 13, 31]), st.integers(0, 90)),
       dtype=st.sampled_from(DTYPES), bits=BITS, stochastic=st.booleans(), seed=SEEDS,
       layout=st.sampled_from(["contiguous", "strided", "offset"]))
def test_swizzle_quantize_matches_reference(backend, device, data, nodes, node_size, stages, length, dtype, bits,
                                            stochastic, seed, layout):
    block = data.draw(block_sizes(bits))
    slices = nodes * node_size * stages
    values = data.draw(float_rows(1, slices * length, dtype))
    args = (nodes, node_size, stages, bits, block)
    # a 1-D (possibly strided) buffer
    ref = K.swizzle_quantize(_layout(values, layout)[0], *args, stochastic=stochastic, seed=seed, backend="reference")
    got = K.swizzle_quantize(_layout(values.to(device), layout)[0], *args, stochastic=stochastic, seed=seed,
                             backend=backend)
    assert_same(got.codes, ref.codes)
    assert_same(got.scales, ref.scales)


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), k=st.integers(1, 5), rows=st.sampled_from([0, 1, 2, 3]),
       length=st.one_of(st.sampled_from([0, 1, 2, 7, 97]), st.integers(0, 400)), in_bits=BITS, out_bits=BITS,
       stochastic=st.booleans(), seed=SEEDS, code_seed=st.integers(0, 2**31 - 1), from_quantize=st.booleans())
def test_dequant_reduce_quant_matches_reference(backend, device, data, k, rows, length, in_bits, out_bits, stochastic,
                                                seed, code_seed, from_quantize):
    block = data.draw(block_sizes(in_bits, out_bits))
    if from_quantize:  # realistic payloads: k ranks' quantized gradients, special values included
        x = data.draw(float_rows(k * rows, length, torch.float32)).view(k, rows, length)
        codes, scales = K.quantize(x, in_bits, block, backend="reference")
    else:
        codes = random_codes((k, rows, K.packed_length(length, in_bits)), code_seed)
        scales = data.draw(scales_like((k, rows, K.num_blocks(length, block))))
    kwargs = dict(in_bits=in_bits, out_bits=out_bits, block_size=block, length=length, stochastic=stochastic,
                  seed=seed)
    ref = K.dequant_reduce_quant(codes, scales, backend="reference", **kwargs)
    got = K.dequant_reduce_quant(codes.to(device), scales.to(device), backend=backend, **kwargs)
    assert_same(got.codes, ref.codes)
    assert_same(got.scales, ref.scales)


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), k=st.integers(1, 5), rows=st.sampled_from([0, 1, 2, 3]),
       length=st.one_of(st.sampled_from([0, 1, 2, 7, 97]), st.integers(0, 400)), bits=BITS,
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1.0, 0.25, 1 / 3, 1 / 6, 0.0, -0.5, 1e-30, 7.0]),
       code_seed=st.integers(0, 2**31 - 1), use_out=st.booleans(), transposed=st.booleans())
def test_dequant_reduce_matches_reference(backend, device, data, k, rows, length, bits, dtype, scale, code_seed,
                                          use_out, transposed):
    block = data.draw(block_sizes(bits))
    codes = random_codes((k, rows, K.packed_length(length, bits)), code_seed)
    if transposed:  # a non-contiguous stack, as torch.stack of views can produce
        codes = codes.transpose(0, 1).contiguous().transpose(0, 1)
    scales = data.draw(scales_like((k, rows, K.num_blocks(length, block))))
    kwargs = dict(bits=bits, block_size=block, length=length, scale=scale, dtype=dtype)
    ref = K.dequant_reduce(codes, scales, backend="reference", **kwargs)
    out = torch.empty(rows, length, dtype=dtype, device=device) if use_out else None
    got = K.dequant_reduce(codes.to(device), scales.to(device), backend=backend, out=out, **kwargs)
    assert_same(got, ref)


# ---------------------------------------------------------------------------------------------------- per-block widths

WIDTH_BLOCKS = st.one_of(st.sampled_from([8, 16, 64, 256]), st.integers(1, 40).map(lambda groups: 8 * groups))
FLOORS = st.sampled_from([0, 2, 3, 4, 8])


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), rows=ROWS, length=LENGTHS, dtype=st.sampled_from(DTYPES), bits=BITS, floor=FLOORS,
       spread=st.sampled_from([0.0, 1.0, 3.0, 8.0]), stochastic=st.booleans(), seed=SEEDS,
       layout=st.sampled_from(["contiguous", "strided"]))
def test_allocated_quantize_and_round_trip_match_reference(backend, device, data, rows, length, dtype, bits, floor,
                                                          spread, stochastic, seed, layout):
    """Blocks of magnitudes spread log-normally (``spread`` in natural log), so the rule hands out every width from
    0 to 8, plus the special values of the other tests."""
    block = data.draw(WIDTH_BLOCKS)
    x = data.draw(float_rows(rows, length, dtype))
    if spread and x.numel():
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        magnitudes = torch.exp(spread * torch.randn(rows, K.num_blocks(length, block), generator=g))
        x = (x.float() * magnitudes.repeat_interleave(block, -1)[:, :length]).to(dtype)
    kwargs = dict(stochastic=stochastic, seed=seed, floor=floor)
    ref = K.quantize_allocated(_layout(x, layout), bits, block, backend="reference", **kwargs)
    got = K.quantize_allocated(_layout(x.to(device), layout), bits, block, backend=backend, **kwargs)
    assert_same(got.codes, ref.codes)
    assert_same(got.scales, ref.scales)
    back = dict(bits=bits, block_size=block, length=length, floor=floor)
    assert_same(K.dequantize_allocated(*got, backend=backend, **back),
                K.dequantize_allocated(*ref, backend="reference", **back))


@pytest.mark.parametrize("backend,device", COMPILED)
@FUZZ
@given(data=st.data(), rows=ROWS, length=LENGTHS, bits=BITS, floor=FLOORS, code_seed=st.integers(0, 2**31 - 1))
def test_allocated_dequantize_of_arbitrary_codes_and_scales_matches_reference(backend, device, data, rows, length,
                                                                             bits, floor, code_seed):
    block = data.draw(WIDTH_BLOCKS)
    codes = random_codes((rows, K.packed_length(length, bits)), code_seed)
    scales = data.draw(scales_like((rows, K.num_blocks(length, block))))
    if data.draw(st.booleans()) and scales.numel():  # scales of many magnitudes: every width appears
        scales = scales * torch.logspace(-20, 20, scales.numel()).view_as(scales)
    kwargs = dict(bits=bits, block_size=block, length=length, floor=floor)
    assert_same(K.dequantize_allocated(codes.to(device), scales.to(device), backend=backend, **kwargs),
                K.dequantize_allocated(codes, scales, backend="reference", **kwargs))
