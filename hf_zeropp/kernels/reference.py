"""Plain-torch block quantization: the specification every compiled backend must match bit for bit.

Format (shared by all backends and by the collectives that ship it between ranks):

* Blocks run along the last dimension. A tensor of shape ``(..., L)`` has ``ceil(L / block_size)`` blocks per
  row; the last one is a shorter tail block when ``L`` is not a multiple of ``block_size``.
* Symmetric: ``qmax = 127`` (8 bits) or ``7`` (4 bits); ``scale = absmax / qmax`` in fp32, so the block maximum
  maps exactly to ``±qmax`` and is never clipped. Codes are ``clamp(x / scale, -qmax, qmax)`` rounded half to
  even (or ``floor(v + u)`` with a counter-based uniform ``u`` for stochastic rounding). All arithmetic is fp32
  with single roundings (no fused multiply-add), which is what lets the backends agree exactly.
* A block whose scale is zero (all zeros, or values so small the scale underflows) or non-finite (NaN/Inf in the
  block) gets all-zero codes; dequantization computes ``code * scale``, so the zero block comes back exactly zero
  and a NaN/Inf block comes back NaN — overflow checks downstream always see it.
* 4-bit codes are packed two per byte along the row: element ``2i`` in the low nibble, ``2i + 1`` in the high
  nibble, two's complement; an odd row length leaves a zero high nibble in its last byte. Codes are int8.
* Dequantization returns ``code * scale`` (one fp32 multiply) cast to the requested dtype. Reductions add the
  dequantized inputs in input order ``((x0 + x1) + x2) + ...`` in fp32.
* Optional Hadamard rotation (``hadamard = H``, a power of two up to 128 dividing the block size): before
  quantization every run of ``H`` elements aligned to the row start is replaced by its orthonormal Walsh-Hadamard
  transform, computed as the butterfly stages ``h = 1, 2, 4, ..., H/2`` — pairs ``(i, i + h)`` with bit ``h`` of
  ``i`` clear become ``(a + b, a - b)`` — followed by one multiply by ``fp32(1 / sqrt(H))``. The transform is its
  own inverse, so dequantization applies the same steps after ``code * scale`` (and after the sum, before the
  reduction's ``scale``). A row's last ``L mod H`` elements are left unrotated. The rotation spreads one outlier
  over ``H`` elements, so the block's scale fits the rest of the block far better (QuaRot, SDP4Bit).
"""

from __future__ import annotations

import math

import torch

QMAX = {8: 127, 4: 7}
MAX_HADAMARD = 128  # rotation groups of up to 128 elements (16 lanes of 8 elements in the CUDA kernels)

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: the product with a 32-bit value fits in int64, so torch can do the mixing exactly.
_MIX_A = 0x7FEB352D
_MIX_B = 0x6A09E667
_TWO_POW_MINUS_24 = 2.0**-24


def packed_length(length: int, bits: int) -> int:
    """Bytes of codes for a row of ``length`` elements."""
    return length if bits == 8 else (length + 1) // 2


def num_blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * _MIX_A) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _MIX_B) & _MASK32
    return h ^ (h >> 16)


def uniform_from_counter(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Reproducible U[0, 1) per element index (int64), identical in every backend.

    ``u = (h >> 8) * 2**-24`` with ``h = mix(mix(lo32(index) ^ mix(lo32(seed))) ^ hi32(index))``.
    """
    key = int(_mix32(torch.tensor(seed & _MASK32, dtype=torch.int64)))
    h = _mix32((index & _MASK32) ^ key)
    h = _mix32(h ^ (index >> 32))
    return (h >> 8).to(torch.float32) * _TWO_POW_MINUS_24


def _blocked(xf: torch.Tensor, block_size: int) -> torch.Tensor:
    """(rows, L) fp32 -> (rows, nblocks, block_size), zero-padded (zeros never change a block's absmax)."""
    rows, length = xf.shape
    nb = num_blocks(length, block_size)
    pad = nb * block_size - length
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return xf.reshape(rows, nb, block_size)


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    rows, length = codes.shape
    if length % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    nibbles = codes.to(torch.int16) & 0xF
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed.to(torch.uint8).view(torch.int8)


def _unpack_int4(packed: torch.Tensor, length: int) -> torch.Tensor:
    b = packed.view(torch.uint8).to(torch.int16)
    lo = ((b & 0xF) ^ 8) - 8
    hi = ((b >> 4) ^ 8) - 8
    codes = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return codes[..., :length].to(torch.int8)


def is_rotation_size(size: int) -> bool:
    """0 (no rotation) or a power of two from 2 to MAX_HADAMARD."""
    return 0 <= size <= MAX_HADAMARD and size != 1 and not size & (size - 1)


def hadamard_rows(x: torch.Tensor, size: int) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each aligned run of ``size`` elements of fp32 rows (..., L); the
    last ``L mod size`` elements of a row are returned unchanged. Applying it twice gives back x (up to rounding)."""
    if not size:
        return x
    length = x.shape[-1]
    full = length // size * size
    if full == 0:
        return x
    groups = x[..., :full].reshape(*x.shape[:-1], full // size, size)
    h = 1
    while h < size:
        pairs = groups.reshape(*groups.shape[:-1], size // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        groups = torch.stack((a + b, a - b), dim=-2).reshape(groups.shape)
        h *= 2
    rotated = groups.reshape(*x.shape[:-1], full) * hadamard_norm(size, x.device)
    return torch.cat((rotated, x[..., full:]), dim=-1) if full < length else rotated


def hadamard_norm(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``fp32(1 / sqrt(size))`` (from the double), the factor every backend multiplies by."""
    return torch.tensor(1.0 / math.sqrt(size), dtype=torch.float32, device=device)


def _quantize_rows(
    xf: torch.Tensor, bits: int, block_size: int, stochastic: bool, seed: int, element_index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 rows ``(rows, L)``; ``element_index`` (rows, L) numbers the elements for stochastic rounding."""
    qmax = QMAX[bits]
    rows, length = xf.shape
    blocks = _blocked(xf, block_size)
    absmax = blocks.abs().amax(dim=-1)  # NaN propagates (torch.amax is NaN-propagating)
    # a tensor divisor: torch on CUDA turns division by a Python scalar into a reciprocal multiply
    scales = absmax / torch.full_like(absmax, qmax)
    usable = torch.isfinite(scales) & (scales != 0)
    safe = torch.where(usable, scales, torch.ones_like(scales))
    v = torch.where(usable.unsqueeze(-1), blocks / safe.unsqueeze(-1), torch.zeros_like(blocks))
    v = v.clamp(-qmax, qmax).reshape(rows, -1)[:, :length]
    if stochastic:
        if element_index is None:
            element_index = torch.arange(rows * length, dtype=torch.int64, device=xf.device).reshape(rows, length)
        v = torch.floor(v + uniform_from_counter(seed, element_index)).clamp(-qmax, qmax)
    else:
        v = torch.round(v)  # half to even
    codes = v.to(torch.int8)
    if bits == 4:
        codes = _pack_int4(codes)
    return codes, scales


def _dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, length: int) -> torch.Tensor:
    """(..., Lc) int8 codes and (..., nb) scales -> (..., L) fp32."""
    values = _unpack_int4(codes, length) if bits == 4 else codes
    expanded = scales.repeat_interleave(block_size, dim=-1)[..., :length]
    return values.to(torch.float32) * expanded


def quantize(x: torch.Tensor, bits: int, block_size: int, stochastic: bool = False, seed: int = 0,
             hadamard: int = 0):
    """x (rows, L) floating -> (codes (rows, Lc) int8, scales (rows, nb) fp32)."""
    return _quantize_rows(hadamard_rows(x.to(torch.float32), hadamard), bits, block_size, stochastic, seed, None)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, length: int,
               dtype: torch.dtype, hadamard: int = 0) -> torch.Tensor:
    return hadamard_rows(_dequantize_rows(codes, scales, bits, block_size, length), hadamard).to(dtype)


def swizzle_source_slices(nodes: int, node_size: int, stages: int) -> torch.Tensor:
    """For each destination slot of the reordered tensor, the source slice it holds (ZeRO++ Eq. 1-2, Alg. 2).

    The input is ``world = nodes * node_size`` chunks (chunk ``j`` is rank ``j``'s reduce-scatter shard), each cut
    into ``stages`` equal slices; source slice ``t = j * stages + s``. With ``j = m * node_size + d`` (node ``m``,
    local rank ``d``) the reordered position is ``(s * node_size + d) * nodes + m``: stage-major so that every
    pipeline stage is one contiguous all-to-all, then grouped by the destination *local* rank for the intra-node
    all-to-all, then by node for the inter-node all-to-all that follows.
    """
    m = torch.arange(nodes).view(1, 1, nodes)
    d = torch.arange(node_size).view(1, node_size, 1)
    s = torch.arange(stages).view(stages, 1, 1)
    return ((m * node_size + d) * stages + s).reshape(-1)


def swizzle_quantize(x: torch.Tensor, nodes: int, node_size: int, stages: int, bits: int, block_size: int,
                     stochastic: bool = False, seed: int = 0, hadamard: int = 0):
    """Flat x (numel divisible by nodes*node_size*stages) -> codes/scales of shape (stages*node_size*nodes, ...)."""
    slices = nodes * node_size * stages
    flat = x.reshape(slices, -1)
    source = swizzle_source_slices(nodes, node_size, stages).to(x.device)
    length = flat.shape[1]
    index = None
    if stochastic:  # stochastic rounding draws by the element's position in the *source* tensor
        index = source.view(-1, 1) * length + torch.arange(length, device=x.device).view(1, -1)
    rows = hadamard_rows(flat.to(torch.float32)[source], hadamard)
    return _quantize_rows(rows, bits, block_size, stochastic, seed, index)


def _sum_in_order(values: torch.Tensor) -> torch.Tensor:
    acc = values[0].clone()
    for i in range(1, values.shape[0]):
        acc = acc + values[i]
    return acc


def dequant_reduce_quant(codes: torch.Tensor, scales: torch.Tensor, in_bits: int, block_size: int, length: int,
                         out_bits: int, stochastic: bool = False, seed: int = 0):
    """k quantized inputs (k, rows, Lc) -> fp32 sum over k -> requantized (rows, Lc') with ``out_bits``.

    Takes no rotation: the sum of rotated rows is the rotated sum, so Hadamard-rotated inputs are reduced and
    requantized in the rotated domain as they are, and only the last step (``dequant_reduce``) rotates back."""
    total = _sum_in_order(_dequantize_rows(codes, scales, in_bits, block_size, length))
    return _quantize_rows(total, out_bits, block_size, stochastic, seed, None)


def dequant_reduce(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, length: int,
                   scale: float, dtype: torch.dtype, hadamard: int = 0) -> torch.Tensor:
    """k quantized inputs (k, rows, Lc) -> (sum over k in fp32), rotated back -> * scale -> (rows, L) in ``dtype``."""
    total = hadamard_rows(_sum_in_order(_dequantize_rows(codes, scales, bits, block_size, length)), hadamard)
    return (total * torch.tensor(scale, dtype=torch.float32)).to(dtype)
