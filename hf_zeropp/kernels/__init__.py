"""Block-quantization kernels for ZeRO++: quantize, dequantize, swizzle+quantize, dequant+reduce(+requant).

The kernels are torch custom ops, ``torch.ops.hf_zeropp.*`` (:mod:`hf_zeropp.kernels.ops`): torch runs the compiled
C++ code for CPU tensors and the CUDA code for CUDA tensors (built on first use, :mod:`hf_zeropp.kernels._build`),
and the plain-torch reference (:mod:`hf_zeropp.kernels.reference`, the spec) wherever no compiled kernel is
available. The functions here validate arguments once, with messages that name the value and the fix, shape the
outputs, and call the op. ``backend`` chooses per call: ``None`` — the op for the tensor's device (compiled when it
builds); ``"reference"`` — the plain-torch spec, bypassing the compiled kernels (it appears in the profiler under
the op's name too); ``"cpp"`` / ``"cuda"`` — the compiled kernels, or an error saying why they are unavailable.
There is no process-wide default: components that call the kernels (qwZ, qgZ, frozen weights) carry the backend of
their ``ZeroPPConfig.kernel_backend``.

The per-block-width format of qgZ's inter-node hop (``gradient_bit_allocation``; :func:`quantize_allocated`,
:func:`dequantize_allocated`, spec in :mod:`hf_zeropp.kernels.allocation`) is dispatched the same way: compiled on
CPU and CUDA tensors, its plain-torch spec elsewhere.

Every function takes rows along the last dimension: a ``(..., L)`` input gives ``(..., L)`` (8-bit) or
``(..., ceil(L / 2))`` (4-bit) int8 codes and ``(..., ceil(L / block_size))`` fp32 scales.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from . import _build, ops, reference
from .allocation import GROUP as _WIDTH_GROUP
from .allocation import check_floor
from .reference import MAX_HADAMARD, QMAX, is_rotation_size, num_blocks, packed_length, swizzle_source_slices

__all__ = [
    "Backend",
    "DEFAULT_BLOCK_SIZE",
    "Quantized",
    "active_backend",
    "dequant_reduce",
    "dequant_reduce_quant",
    "dequantize",
    "dequantize_allocated",
    "num_blocks",
    "packed_length",
    "quantize",
    "quantize_allocated",
    "swizzle_quantize",
    "swizzle_source_slices",
]

Backend = Literal["reference", "cpp", "cuda"]
BACKENDS: tuple[str, ...] = ("reference", "cpp", "cuda")
DEFAULT_BLOCK_SIZE = 256
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_EXTENSION_OF = {"cpp": _build.CPU_EXTENSION, "cuda": _build.CUDA_EXTENSION}
_COMPILED_FOR = {"cpu": "cpp", "cuda": "cuda"}


class Quantized(NamedTuple):
    """int8 codes (4-bit codes packed two per byte) and one fp32 scale per block."""

    codes: torch.Tensor
    scales: torch.Tensor


def check_backend_name(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS} or None for automatic")


def active_backend(device: torch.device | str, backend: Backend | None = None) -> str:
    """The backend a call with ``backend`` on ``device`` would use (building it if needed)."""
    return _resolve(backend, torch.device(device))


def _resolve(backend: str | None, device: torch.device) -> str:
    if backend is None:
        compiled = _COMPILED_FOR.get(device.type)
        return compiled if compiled is not None and _build.load(_EXTENSION_OF[compiled]) else "reference"
    check_backend_name(backend)
    if backend == "reference":
        return backend
    if device.type != ("cpu" if backend == "cpp" else "cuda"):
        raise ValueError(
            f"kernel backend {backend!r} runs on {'cpu' if backend == 'cpp' else 'cuda'} tensors but got a "
            f"{device.type} tensor; pass backend=None (automatic) or move the tensor"
        )
    _build.load(_EXTENSION_OF[backend], raise_on_failure=True)
    return backend


def _run(name: str, backend: str | None, *args):
    """Call op ``name`` (after :func:`_resolve` loaded the compiled kernels or refused the backend): through the
    dispatcher (compiled kernel for the device, the reference where there is none), or the reference itself when
    asked for by name."""
    if backend == "reference":
        with torch.profiler.record_function(f"{ops.NAMESPACE}::{name}"):
            return ops.REFERENCE[name](*args)
    return getattr(torch.ops.hf_zeropp, name)(*args)


def _check_bits(bits: int, name: str = "bits") -> None:
    if bits not in QMAX:
        raise ValueError(f"{name}={bits!r} is not supported; use 8 or 4")


def _check_block_size(block_size: int, bits: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive integer (e.g. {DEFAULT_BLOCK_SIZE})")
    if bits == 4 and block_size % 2:
        raise ValueError(
            f"block_size={block_size} is odd, but 4-bit codes pack two per byte and a byte may not straddle "
            f"two blocks; use an even block size such as {block_size + 1}"
        )


def _check_hadamard(hadamard: int, block_size: int) -> None:
    if not isinstance(hadamard, int) or isinstance(hadamard, bool) or not is_rotation_size(hadamard):
        raise ValueError(f"hadamard={hadamard!r} must be 0 (no rotation) or a power of two from 2 to {MAX_HADAMARD} "
                         f"(32-128 spreads outliers best)")
    if hadamard and block_size % hadamard:
        raise ValueError(f"block_size={block_size} is not a multiple of hadamard={hadamard}: a rotation group may not "
                         f"straddle two blocks; use block_size {-(-block_size // hadamard) * hadamard}")


def _float_input(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.float64:
        return x.to(torch.float32)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; quantization takes float32, float16 or bfloat16 tensors")
    return x


def _check_codes(codes: torch.Tensor, scales: torch.Tensor) -> None:
    if codes.dtype != torch.int8:
        raise TypeError(f"codes must be int8 (as returned by quantize), got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32 (as returned by quantize), got {scales.dtype}")
    if codes.device != scales.device:
        raise ValueError(f"codes are on {codes.device} but scales on {scales.device}; keep them together")


def _row_length(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, length: int | None) -> int:
    """Resolve and check the unpacked row length against the codes' and scales' shapes."""
    packed = codes.shape[-1] if codes.dim() else 1
    if length is None:
        length = packed if bits == 8 else 2 * packed
    if packed_length(length, bits) != packed:
        raise ValueError(
            f"length={length} needs {packed_length(length, bits)} bytes of {bits}-bit codes per row, "
            f"but the codes have {packed}; pass the row length used at quantization"
        )
    if scales.shape[-1] != num_blocks(length, block_size):
        raise ValueError(
            f"scales have {scales.shape[-1]} blocks per row but length={length} with block_size={block_size} "
            f"needs {num_blocks(length, block_size)}; pass the block_size used at quantization"
        )
    return length


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out has shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}; "
            f"expected shape {tuple(shape)}, dtype {dtype}, device {device}"
        )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int = 0,
    hadamard: int = 0,
    backend: Backend | None = None,
) -> Quantized:
    """Symmetric block quantization along the last dimension.

    ``stochastic=True`` rounds ``floor(x / scale + u)`` with ``u`` drawn from ``seed`` and the element's index:
    unbiased, and identical across backends and reruns. ``hadamard=H`` quantizes the orthonormal Hadamard
    transform of every aligned run of ``H`` elements instead (dequantize with the same ``hadamard``).
    """
    x = _float_input(x)
    _check_bits(bits)
    _check_block_size(block_size, bits)
    _check_hadamard(hadamard, block_size)
    return _quantize_rows("quantize", x, bits, block_size, backend, stochastic, seed, hadamard)


def _quantize_rows(op: str, x: torch.Tensor, bits: int, block_size: int, backend: str | None,
                   *options) -> Quantized:
    """Run quantization op ``op`` on the rows of ``x`` (leading dimensions flattened) and give the codes and scales
    the leading dimensions back."""
    shape = tuple(x.shape) if x.dim() else (1,)
    length = shape[-1]
    lead = shape[:-1]
    rows = x.reshape(-1, length) if length else x.reshape(0, 0)
    codes_shape = (*lead, packed_length(length, bits))
    scales_shape = (*lead, num_blocks(length, block_size))
    _resolve(backend, x.device)  # an unavailable backend asked for by name fails also for empty inputs
    if rows.numel() == 0:
        return Quantized(torch.zeros(codes_shape, dtype=torch.int8, device=x.device),
                         torch.empty(scales_shape, dtype=torch.float32, device=x.device))
    codes, scales = _run(op, backend, rows.contiguous(), bits, block_size, *options)
    return Quantized(codes.view(codes_shape), scales.view(scales_shape))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    length: int | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    hadamard: int = 0,
    backend: Backend | None = None,
) -> torch.Tensor:
    """``code * scale`` back to ``dtype``; ``length`` is the row length (needed for odd 4-bit rows); ``hadamard``
    as given to :func:`quantize` rotates the values back.

    ``out`` (contiguous, shape ``(..., length)``) receives the result in place, e.g. a view of a collective's
    output buffer, saving a copy.
    """
    _check_codes(codes, scales)
    _check_bits(bits)
    _check_block_size(block_size, bits)
    _check_hadamard(hadamard, block_size)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; dequantize to float32, float16 or bfloat16")
    length = _row_length(codes, scales, bits, block_size, length)
    return _dequantize_rows("dequantize", codes, scales, length, dtype, out, backend, bits, block_size, hadamard)


def _dequantize_rows(op: str, codes: torch.Tensor, scales: torch.Tensor, length: int, dtype: torch.dtype,
                     out: torch.Tensor | None, backend: str | None, *options) -> torch.Tensor:
    """Run dequantization op ``op`` on rows ``(..., ·)`` of codes and scales into ``out`` ``(..., length)``."""
    lead = tuple(codes.shape[:-1])
    if tuple(scales.shape[:-1]) != lead:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} differ in leading dims")
    shape = (*lead, length)
    if out is not None:
        _check_out(out, shape, dtype, codes.device)
    _resolve(backend, codes.device)  # an unavailable backend asked for by name fails also for empty inputs
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=codes.device)
    if codes.numel() == 0 or length == 0:
        return out
    rows = out.numel() // length
    _run(op, backend, codes.contiguous().view(rows, -1), scales.contiguous().view(rows, -1), *options,
         out.view(rows, length))
    return out


def swizzle_quantize(
    x: torch.Tensor,
    nodes: int,
    node_size: int,
    stages: int = 1,
    bits: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int = 0,
    hadamard: int = 0,
    backend: Backend | None = None,
) -> Quantized:
    """Reorder a reduce-scatter input for qgZ's hierarchical all-to-all and quantize it, in one pass.

    ``x`` is the flat gradient buffer holding ``nodes * node_size`` equal chunks (chunk ``j`` reduces onto global
    rank ``j``); each chunk is cut into ``stages`` slices. Row ``(s * node_size + d) * nodes + m`` of the result
    holds slice ``s`` of the chunk of node ``m``'s local rank ``d`` (see
    :func:`~hf_zeropp.kernels.reference.swizzle_source_slices`), so stage ``s``'s intra-node all-to-all sends the
    contiguous rows ``[s * node_size * nodes, (s + 1) * node_size * nodes)``, ``nodes`` rows to each local peer.
    Each row is quantized on its own (its own blocks and tail block), after the optional Hadamard rotation of its
    aligned runs of ``hadamard`` elements.
    """
    x = _float_input(x)
    _check_bits(bits)
    _check_block_size(block_size, bits)
    _check_hadamard(hadamard, block_size)
    for name, value in (("nodes", nodes), ("node_size", node_size), ("stages", stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    slices = nodes * node_size * stages
    if x.numel() % slices:
        raise ValueError(
            f"x has {x.numel()} elements, not divisible by nodes*node_size*stages = {slices}; "
            f"pad it to {-(-x.numel() // slices) * slices} elements first"
        )
    length = x.numel() // slices
    codes_shape = (slices, packed_length(length, bits))
    scales_shape = (slices, num_blocks(length, block_size))
    _resolve(backend, x.device)
    if length == 0:
        return Quantized(torch.empty(codes_shape, dtype=torch.int8, device=x.device),
                         torch.empty(scales_shape, dtype=torch.float32, device=x.device))
    return Quantized(*_run("swizzle_quantize", backend, x.contiguous().view(-1), nodes, node_size, stages,
                           bits, block_size, stochastic, seed, hadamard))


def _stacked(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, length: int | None,
             bits_name: str) -> int:
    _check_codes(codes, scales)
    _check_bits(bits, bits_name)
    _check_block_size(block_size, bits)
    if codes.dim() != 3 or scales.dim() != 3 or codes.shape[:2] != scales.shape[:2]:
        raise ValueError(
            f"expected k stacked inputs: codes (k, rows, bytes) and scales (k, rows, blocks), got "
            f"{tuple(codes.shape)} and {tuple(scales.shape)}"
        )
    return _row_length(codes, scales, bits, block_size, length)


def dequant_reduce_quant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    in_bits: int = 4,
    out_bits: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    length: int | None = None,
    stochastic: bool = False,
    seed: int = 0,
    backend: Backend | None = None,
) -> Quantized:
    """qgZ's middle step, fused: dequantize ``k`` inputs ``(k, rows, ·)``, add them in fp32, requantize to
    ``out_bits`` rows ``(rows, ·)`` with the same block size.

    Hadamard-rotated inputs need no option here: the rotation is linear, so the sum of rotated rows is the rotated
    sum and is requantized in the rotated domain; rotating back and forth would only add rounding."""
    length = _stacked(codes, scales, in_bits, block_size, length, "in_bits")
    _check_bits(out_bits, "out_bits")
    _check_block_size(block_size, out_bits)
    rows = codes.shape[1]
    codes_shape = (rows, packed_length(length, out_bits))
    scales_shape = (rows, num_blocks(length, block_size))
    _resolve(backend, codes.device)
    if codes.shape[0] == 0:
        raise ValueError("dequant_reduce_quant needs at least one input (k >= 1)")
    if rows == 0 or length == 0:
        return Quantized(torch.empty(codes_shape, dtype=torch.int8, device=codes.device),
                         torch.empty(scales_shape, dtype=torch.float32, device=codes.device))
    return Quantized(*_run("dequant_reduce_quant", backend, codes.contiguous(), scales.contiguous(),
                           in_bits, block_size, length, out_bits, stochastic, seed))


def dequant_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    length: int | None = None,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    hadamard: int = 0,
    backend: Backend | None = None,
) -> torch.Tensor:
    """qgZ's last step, fused: dequantize ``k`` inputs ``(k, rows, ·)``, add them in fp32, rotate the sum back
    (``hadamard`` as at quantization), multiply by ``scale`` (e.g. 1/world for an average), write ``(rows, length)``
    in ``dtype``."""
    length = _stacked(codes, scales, bits, block_size, length, "bits")
    _check_hadamard(hadamard, block_size)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype} is not supported; reduce into float32, float16 or bfloat16")
    if codes.shape[0] == 0:
        raise ValueError("dequant_reduce needs at least one input (k >= 1)")
    shape = (codes.shape[1], length)
    if out is not None:
        _check_out(out, shape, dtype, codes.device)
    _resolve(backend, codes.device)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=codes.device)
    if shape[0] == 0 or length == 0:
        return out
    _run("dequant_reduce", backend, codes.contiguous(), scales.contiguous(), bits, block_size,
         float(scale), hadamard, out)
    return out


def _check_allocation(bits: int, block_size: int, floor: int) -> None:
    _check_bits(bits)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < _WIDTH_GROUP \
            or block_size % _WIDTH_GROUP:
        raise ValueError(f"block_size={block_size!r} must be a positive multiple of {_WIDTH_GROUP} for per-block "
                         f"widths (whole bytes per {_WIDTH_GROUP} codes), e.g. {DEFAULT_BLOCK_SIZE}")
    check_floor(floor)


def quantize_allocated(
    x: torch.Tensor,
    bits: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int = 0,
    floor: int = 0,
    backend: Backend | None = None,
) -> Quantized:
    """Block quantization with a bit width per block chosen from the block scales, in the bytes of the fixed
    ``bits``-wide format (:mod:`hf_zeropp.kernels.allocation`); ``floor`` > 0 gives every block with a usable scale
    at least that many bits where the row can afford it. Scales are the blocks' absmax; the receiver derives the
    same widths from them, with the same ``floor``."""
    x = _float_input(x).to(torch.float32)
    _check_allocation(bits, block_size, floor)
    return _quantize_rows("quantize_allocated", x, bits, block_size, backend, stochastic, seed, floor)


def dequantize_allocated(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int,
    block_size: int,
    length: int,
    floor: int = 0,
    backend: Backend | None = None,
) -> torch.Tensor:
    """(codes, scales) from :func:`quantize_allocated` with the same ``bits``, ``block_size`` and ``floor`` ->
    fp32 rows ``(..., length)``."""
    _check_codes(codes, scales)
    _check_allocation(bits, block_size, floor)
    length = _row_length(codes, scales, bits, block_size, length)
    return _dequantize_rows("dequantize_allocated", codes, scales, length, torch.float32, None, backend, bits,
                            block_size, floor)
