"""Block quantization whose bit width varies per block, chosen from the block scales, at the fixed format's bytes.

Why: one row of qgZ's gradient partial sums mixes blocks whose magnitudes differ by orders of magnitude (the rows
of an embedding that no token of the batch used, a layer's small bias-like directions next to its largest ones).
A fixed width spends as many bits on a block a hundred times smaller than the largest as on the largest, though
its squared error weighs ten thousand times less. With a block's squared error proportional to ``absmax**2 *
4**-b``, the width that minimises the row's total error for a given number of bits is ``b ≈ mean + log2(absmax /
geometric mean)`` (reverse water-filling): a bit moves from where it buys little to where it buys much, and the
row's relative error falls by the square root of the ratio of the arithmetic to the geometric mean of the blocks'
squared scales. The widths are a function of the scales alone, which travel with the codes anyway, so the receiver
recomputes them: no extra byte, and the rule is integer arithmetic on the scales' bit patterns, so every device and
backend derives the same widths.

Format (rows along the last dimension, ``(..., L)``; blocks of ``block_size`` elements, the last one shorter when
``block_size`` does not divide ``L``):

* One fp32 scale per block: the block's absolute maximum (not ``absmax / qmax`` as in the fixed format, because the
  step depends on the width).
* Width ``b`` of a block in ``{0, 2, 3, ..., 8}`` bits: ``key`` is the int32 bit pattern of the scale (for positive
  floats it grows with the value, about ``2**23 * (log2(absmax) + 127)``), ``b = clamp((key + T) >> 23, 0, 8)``,
  and a width of 1 (a single level, zero) is taken as 0. A zero or non-finite scale gets width 0. ``T`` is the
  largest integer for which the row's code bytes, ``sum(b * ceil8(n) / 8)`` over its blocks of ``n`` elements,
  fit in ``packed_length(L, bits)`` bytes — the row size of the fixed ``bits``-wide format. Equal scales give every
  block ``bits`` (when ``L`` is a multiple of 8), and then the codes are those of the fixed format. With a
  ``floor`` (``gradient_bit_allocation_floor``), no block with a usable scale gets fewer than ``floor`` bits where
  the row can afford it (see ``_row_floors``); sender and receiver must use the same floor.
* Codes: ``q = x / step`` rounded half to even (or ``floor(x / step + u)`` with the reference's counter-based
  uniform ``u`` for stochastic rounding), clamped to ``[-qmax, qmax]``, ``qmax = 2**(b - 1) - 1``, ``step =
  absmax / qmax`` in fp32. Stored as ``q + qmax`` in ``b`` bits; every 8 codes (a block is padded with zeros to a
  multiple of 8 elements) fill ``b`` bytes, little-endian; the blocks follow one another in order and the row's
  remaining bytes are zero.
* Dequantization: ``q * step``, or ``0 * absmax`` for width 0 — zero, or NaN when the scale is not finite, so a
  NaN/Inf block still comes back NaN as in the fixed format.

This module is the specification, in plain torch: ``torch.ops.hf_zeropp.quantize_allocated`` /
``dequantize_allocated`` run the compiled kernels on CPU and CUDA tensors (``cuda/cpu_kernels.cpp``,
``cuda/allocation_kernels.cu``, each equal to this bit for bit) and this code on any other device;
:func:`hf_zeropp.kernels.quantize_allocated` is the validated entry point.
"""

from __future__ import annotations

import torch

from .reference import _blocked, num_blocks, packed_length, uniform_from_counter

MAX_WIDTH = 8
_KEY_SHIFT = 23  # the fp32 exponent's position: one width step per doubling of the scale
GROUP = 8  # codes per group of whole bytes: 8 codes of b bits fill b bytes


def check_floor(floor: int) -> None:
    if not isinstance(floor, int) or isinstance(floor, bool) or not (floor == 0 or 2 <= floor <= MAX_WIDTH):
        raise ValueError(f"floor={floor!r} must be 0 (none) or a width from 2 to {MAX_WIDTH}")


def _padded_counts(length: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Elements per block rounded up to whole groups of 8 codes, (blocks,) int64."""
    blocks = num_blocks(length, block_size)
    counts = torch.full((blocks,), block_size, dtype=torch.int64, device=device)
    counts[-1] = length - (blocks - 1) * block_size
    return -(-counts // GROUP) * GROUP


def block_widths(scales: torch.Tensor, length: int, bits: int, block_size: int, floor: int = 0) -> torch.Tensor:
    """The width of every block of rows ``(rows, blocks)`` of absmax scales, int64 (see the module docstring);
    with ``floor``, no block with a usable scale gets fewer than ``floor`` bits (see ``_row_floors``)."""
    rows = scales.reshape(-1, scales.shape[-1])
    usable = torch.isfinite(rows) & (rows > 0)
    key = torch.where(usable, rows, torch.ones_like(rows)).view(torch.int32).to(torch.int64)
    counts = _padded_counts(length, block_size, rows.device)
    budget = 8 * packed_length(length, bits)
    floors = _row_floors(usable, counts, budget, floor)

    def widths_at(offset: torch.Tensor) -> torch.Tensor:
        widths = torch.maximum(((key + offset[:, None]) >> _KEY_SHIFT).clamp(0, MAX_WIDTH), floors)
        return torch.where(usable & (widths != 1), widths, torch.zeros_like(widths))

    # the largest offset whose cost fits, by bisection; the cost only grows with the offset
    low = torch.full((rows.shape[0],), -(1 << 32), dtype=torch.int64, device=rows.device)  # every usable width its row's floor: fits
    high = torch.full_like(low, 1 << 32)  # every usable width MAX_WIDTH: may not fit
    fits_high = (widths_at(high) * counts).sum(-1) <= budget
    low = torch.where(fits_high, high, low)
    while bool((high - low > 1).any()):
        middle = (low + high) // 2
        fits = (widths_at(middle) * counts).sum(-1) <= budget
        low = torch.where(fits, middle, low)
        high = torch.where(fits, high, middle)
    return widths_at(low).view(scales.shape)


def _row_floors(usable: torch.Tensor, counts: torch.Tensor, budget: int, floor: int) -> torch.Tensor:
    """Per row ``(rows, 1)``: the least width of a usable block, ``floor`` or, where the row's usable blocks cannot
    all have it in the budget (a short last block is padded to 8 codes), the largest width below it that fits.

    Why: with ``floor`` = the fixed format's width no block is coarser than in the fixed format, so the only bits
    that move are those the fixed format spends on all-zero blocks (the 1-D slices qgZ sends apart, embedding rows
    no token used). scripts/experiments/fidelity/ compares that rule with the unfloored one, to tell which part of the
    allocation's gain is free and which part takes precision from small blocks. A floor of 2 keeps most of the
    trade and only forbids sending a nonzero block as all zeros, which the unfloored rule does to the same small
    blocks step after step (starving Adam's second moment there). On the measured Llama case it ended that
    starvation but not the loss cost (docs/accuracy.md, "A 2-bit floor ends the starvation")."""
    check_floor(floor)
    usable_counts = (usable.to(torch.int64) * counts).sum(-1, keepdim=True)
    floors = torch.zeros_like(usable_counts)
    for width in range(2, floor + 1):
        floors = torch.where(width * usable_counts <= budget, torch.full_like(floors, width), floors)
    return floors


def _steps(absmax: torch.Tensor, widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = ((1 << widths) // 2 - 1).clamp_min(0).to(torch.float32)
    return qmax, absmax / qmax.clamp_min(1)


def _round(blocked: torch.Tensor, absmax: torch.Tensor, widths: torch.Tensor, length: int, stochastic: bool,
           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed codes of blocked rows ``(rows, blocks, block_size)`` at the given widths, as float, with qmax and step
    per block (see the module docstring)."""
    qmax, step = _steps(absmax, widths)
    values = blocked / step.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    if stochastic:
        index = torch.arange(blocked.shape[1] * blocked.shape[2], device=blocked.device).view(blocked.shape[1:])
        index = torch.arange(blocked.shape[0], device=blocked.device)[:, None, None] * length + index
        codes = torch.floor(values + uniform_from_counter(seed, index))
    else:
        codes = torch.round(values)
    return torch.maximum(torch.minimum(codes, qmax[..., None]), -qmax[..., None]), qmax, step


def round_trip_with_widths(rows: torch.Tensor, widths: torch.Tensor, block_size: int) -> torch.Tensor:
    """What the format delivers for fp32 rows ``(r, L)`` (``L`` a multiple of ``block_size``) when the widths
    ``(r, blocks)`` are given instead of derived from the scales, rounding to nearest: for comparing width rules
    (scripts/experiments/fidelity/). With the format's own widths it equals the quantize/dequantize round trip."""
    blocked = rows.view(rows.shape[0], -1, block_size)
    absmax = blocked.abs().amax(-1)
    codes, _, step = _round(blocked, absmax, widths, rows.shape[-1], stochastic=False, seed=0)
    return (codes * step[..., None]).view_as(rows)


def _layout(widths: torch.Tensor, length: int, block_size: int, row_bytes: int):
    """Where each block's codes lie: (padded counts (blocks,), flat start byte (rows, blocks)) — and, for every
    (width, padded count) pair present, the mask of its blocks."""
    counts = _padded_counts(length, block_size, widths.device)
    block_bytes = widths * counts // 8
    rows = torch.arange(widths.shape[0], device=widths.device)[:, None]
    starts = rows * row_bytes + torch.cumsum(block_bytes, dim=-1) - block_bytes
    groups = [(width, count, (widths == width) & (counts == count))
              for count in counts.unique().tolist() for width in range(2, MAX_WIDTH + 1)]
    return starts, [group for group in groups if bool(group[2].any())]


def quantize(x: torch.Tensor, bits: int, block_size: int, stochastic: bool = False, seed: int = 0,
             floor: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows ``(rows, L)`` -> (int8 codes ``(rows, packed_length(L, bits))``, fp32 absmax scales
    ``(rows, blocks)``)."""
    length = x.shape[-1]
    row_bytes = packed_length(length, bits)
    blocked = _blocked(x, block_size)  # (rows, blocks, block_size), zero padded
    absmax = blocked.abs().amax(-1)
    widths = block_widths(absmax, length, bits, block_size, floor)
    codes, qmax, _ = _round(blocked, absmax, widths, length, stochastic, seed)
    unsigned = (codes + qmax[..., None]).to(torch.int64)
    out = torch.zeros(x.shape[0] * row_bytes, dtype=torch.uint8, device=x.device)
    starts, groups = _layout(widths, length, block_size, row_bytes)
    for width, count, mask in groups:
        group = unsigned[mask][:, :count].view(-1, count // GROUP, GROUP)
        shifts = torch.arange(GROUP, device=x.device) * width
        packed = (group << shifts).sum(-1)  # 8 codes in 8 * width bits; int64 wraps harmlessly at width 8
        as_bytes = (packed[..., None] >> (torch.arange(width, device=x.device) * 8)) & 0xFF
        positions = starts[mask][:, None] + torch.arange(count * width // 8, device=x.device)
        out[positions.reshape(-1)] = as_bytes.reshape(-1).to(torch.uint8)
    return out.view(torch.int8).view(x.shape[0], row_bytes), absmax


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, length: int,
               floor: int = 0) -> torch.Tensor:
    """(codes, scales) from :func:`quantize`, ``(rows, ·)`` each -> fp32 rows ``(rows, length)``."""
    row_bytes = codes.shape[-1]
    flat = codes.reshape(-1).view(torch.uint8)
    widths = block_widths(scales, length, bits, block_size, floor)
    qmax, step = _steps(scales, widths)
    starts, groups = _layout(widths, length, block_size, row_bytes)
    blocks = num_blocks(length, block_size)
    out = (scales * 0)[..., None].expand(scales.shape[0], blocks, block_size).clone()
    for width, count, mask in groups:
        positions = starts[mask][:, None] + torch.arange(count * width // 8, device=codes.device)
        as_bytes = flat[positions].to(torch.int64).view(-1, count // GROUP, width)
        packed = (as_bytes << (torch.arange(width, device=codes.device) * 8)).sum(-1)
        unsigned = (packed[..., None] >> (torch.arange(GROUP, device=codes.device) * width)) & ((1 << width) - 1)
        signed = unsigned.view(-1, count).to(torch.float32) - qmax[mask][:, None]
        block_values = out[mask]
        block_values[:, :count] = signed * step[mask][:, None]
        out[mask] = block_values
    return out.view(scales.shape[0], blocks * block_size)[:, :length]
