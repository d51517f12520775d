"""qgZ's rows: how the reduce-scatter's chunks are quantized, summed in fp32 and requantized between the two hops
(:class:`BlockQuantizedPayload`, fused kernels with the fixed or the per-block width format), and the error feedback
on a requantization (:class:`ErrorFeedback`, which hybrid sharding's all-reduce uses too). :mod:`hf_zeropp.comm.qgz`
moves these rows between ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import kernels
from ..kernels.reference import hadamard_rows


class OwnRows(NamedTuple):
    """A rank's own contribution to one hop's sum, exact and unrotated: ``rows`` replace the quantized rows that
    arrived from peer ``peer`` (this rank itself)."""

    peer: int
    rows: torch.Tensor


class BlockQuantizedPayload:
    """What qgZ ships: block-quantized codes plus one fp32 scale per block (the kernels in hf_zeropp.kernels).

    With ``hadamard`` the rows are rotated before the first quantization and rotated back only after the last
    reduction: the middle reduction sums rotated rows, which is the rotated sum. With ``allocate_bits`` the hop that
    crosses nodes uses per-block widths chosen from the block scales at the same bytes
    (:mod:`hf_zeropp.kernels.allocation`), no usable block below ``width_floor`` bits; the intra-node hop keeps the
    fixed format and its fused kernels."""

    def __init__(self, block_size: int, stochastic: bool, hadamard: int = 0,
                 backend: kernels.Backend | None = None, allocate_bits: bool = False, width_floor: int = 0) -> None:
        self.block_size = block_size
        self.stochastic = stochastic
        self.hadamard = hadamard
        self.backend = backend
        self.allocate_bits = allocate_bits
        self.width_floor = width_floor

    def swizzle(self, flat, nodes, node_size, stages, bits, seed):
        if self.allocate_bits and node_size == 1 and nodes > 1:  # one rank per node: the first hop crosses nodes
            order = kernels.swizzle_source_slices(nodes, node_size, stages).to(flat.device)
            rows = flat.float().view(nodes * stages, -1)[order]
            return self.quantize_inter(hadamard_rows(rows, self.hadamard), bits, seed)
        return kernels.swizzle_quantize(flat, nodes, node_size, stages, bits, self.block_size,
                                        stochastic=self.stochastic, seed=seed, hadamard=self.hadamard,
                                        backend=self.backend)

    def quantize_inter(self, rows, bits, seed) -> kernels.Quantized:
        """The quantizer of the hop that crosses nodes, on fp32 rows (rotated when ``hadamard`` is on)."""
        if self.allocate_bits:
            return kernels.quantize_allocated(rows, bits, self.block_size, stochastic=self.stochastic, seed=seed,
                                              floor=self.width_floor, backend=self.backend)
        return kernels.quantize(rows, bits, self.block_size, stochastic=self.stochastic, seed=seed,
                                backend=self.backend)

    def dequantize_inter(self, codes, scales, bits, length) -> torch.Tensor:
        """Inverse of :meth:`quantize_inter`, still in the rotated domain."""
        if self.allocate_bits:
            return kernels.dequantize_allocated(codes, scales, bits=bits, block_size=self.block_size, length=length,
                                                floor=self.width_floor, backend=self.backend)
        return kernels.dequantize(codes, scales, bits=bits, block_size=self.block_size, length=length,
                                  backend=self.backend)

    def sum_peers(self, payload, scales, bits, length, *, crossed_nodes: bool = False, skip: int | None = None,
                  rotate_back: bool = True) -> torch.Tensor:
        """The fp32 sum of the stacked peers' rows ``(peers, rows, ·)``, rotated back unless ``rotate_back`` is
        False; ``skip`` leaves that peer's rows out (a rank's own, added exactly instead). The peers before and
        after ``skip`` are summed as two views rather than gathered into a copy."""
        groups = [(payload, scales)] if skip is None else [(payload[:skip], scales[:skip]),
                                                           (payload[skip + 1:], scales[skip + 1:])]
        total = None
        for codes, block_scales in groups:
            if codes.shape[0] == 0:
                continue
            if self.allocate_bits and crossed_nodes:
                part = _sum_in_order(self.dequantize_inter(codes, block_scales, bits, length))
                part = hadamard_rows(part, self.hadamard) if rotate_back else part
            else:
                part = kernels.dequant_reduce(codes, block_scales, bits=bits, block_size=self.block_size,
                                              length=length, hadamard=self.hadamard if rotate_back else 0,
                                              backend=self.backend)
            total = part if total is None else total.add_(part)
        return torch.zeros(payload.shape[1], length, device=payload.device) if total is None else total

    def requantize(self, partial_sums, bits, seed) -> kernels.Quantized:
        """Quantize unrotated fp32 partial sums for the inter-node hop (rotating them first, fused where the format
        allows)."""
        if self.allocate_bits:
            return self.quantize_inter(hadamard_rows(partial_sums, self.hadamard), bits, seed)
        return kernels.quantize(partial_sums, bits, self.block_size, stochastic=self.stochastic, seed=seed,
                                hadamard=self.hadamard, backend=self.backend)

    def reduce_requantize(self, payload, scales, in_bits, out_bits, length, seed):
        if self.allocate_bits:
            return self.quantize_inter(self.sum_peers(payload, scales, in_bits, length, rotate_back=False), out_bits,
                                       seed)
        return kernels.dequant_reduce_quant(payload, scales, in_bits=in_bits, out_bits=out_bits,
                                            block_size=self.block_size, length=length, stochastic=self.stochastic,
                                            seed=seed, backend=self.backend)

    def reduce(self, payload, scales, bits, length, out, crossed_nodes: bool, own: OwnRows | None = None) -> None:
        """The last hop's sum into ``out``; with ``own`` (unrotated), that peer's quantized rows replaced by it."""
        if own is not None:
            total = self.sum_peers(payload, scales, bits, length, crossed_nodes=crossed_nodes, skip=own.peer)
            out.copy_(total.add_(own.rows))
            return
        if self.allocate_bits and crossed_nodes:
            out.copy_(self.sum_peers(payload, scales, bits, length, crossed_nodes=True))
            return
        kernels.dequant_reduce(payload, scales, bits=bits, block_size=self.block_size, length=length,
                               dtype=out.dtype, out=out, hadamard=self.hadamard, backend=self.backend)

    def restore(self, payload, scales, bits, length, crossed_nodes: bool) -> torch.Tensor:
        """One hop's rows back in fp32 and unrotated (to measure that hop's error)."""
        if self.allocate_bits and crossed_nodes:
            return hadamard_rows(self.dequantize_inter(payload, scales, bits, length), self.hadamard)
        return kernels.dequantize(payload, scales, bits=bits, block_size=self.block_size, length=length,
                                  hadamard=self.hadamard, backend=self.backend)

    def describe(self, device: torch.device) -> str:
        if not self.allocate_bits:
            return ""
        floor = f", at least {self.width_floor} bits per nonzero block" if self.width_floor else ""
        implementation = {"cpp": "C++ kernel", "cuda": "CUDA kernel"}.get(kernels.active_backend(device, self.backend),
                                                                          "plain torch")
        return f", per-block bit widths on the inter-node hop{floor} ({implementation})"


class ErrorFeedback:
    """Error feedback for a requantization between hops: plain (EF-SGD) or LoCo-style.

    What the requantization of a rank's partial sums drops in one reduction is added to the same partial sums before
    they are requantized in the next, so rounding errors cancel over steps instead of accumulating in the weights.
    With ``decay`` > 0 the residual carried forward is a moving average of the dropped errors (``decay`` x the
    previous residual + (1 - decay) x this step's), which damps the step-to-step noise the compensation adds (the
    first residual after a reset is the dropped error itself); ``reset_every`` drops it every so many reductions, so
    that a residual never outlives the gradients it came from by much (LoCo: averaged, compressed, reset).

    qgZ compensates its inter-node hop only: its partial sums are already 1/node_size of the unit's gradient on each
    rank, whereas compensating hop 1 would need a residual as large as the whole unsharded gradient. Hybrid
    sharding's all-reduce compensates both of its hops, which carry 1/node_size and 1/world_size of the unit. A
    residual is kept block-quantized to 8 bits, one per key (a pipeline stage, a hop), for as long as the technique
    is on. One instance serves one FSDP unit, whose reductions it counts.
    """

    def __init__(self, block_size: int, backend: kernels.Backend | None = None, decay: float = 0.0,
                 reset_every: int = 0) -> None:
        self.block_size = block_size
        self.backend = backend
        self.decay = decay
        self.reset_every = reset_every
        self.residuals: dict[Any, kernels.Quantized] = {}
        self.reductions = 0  # of the unit's gradient (for reset_every)

    def start_reduction(self) -> None:
        """A new reduction of the unit's gradient begins: count it, and drop the residuals every ``reset_every``."""
        if self.reset_every and self.reductions and self.reductions % self.reset_every == 0:
            self.residuals.clear()
        self.reductions += 1

    def requantize(self, key: Any, partial_sums: torch.Tensor, quantize: Callable[[torch.Tensor], Any],
                   dequantize: Callable[[Any], torch.Tensor], exact_row: int | None = None) -> Any:
        """``quantize`` the fp32 rows ``partial_sums`` with the residual of ``key`` added first (in place), and keep
        the new residual: what ``dequantize`` of the result misses. Row ``exact_row`` reaches its destination exactly
        (it never leaves the rank), so it drops nothing and carries no residual."""
        residual = self.residuals.get(key)
        previous = None
        if residual is not None and residual.codes.shape == partial_sums.shape:
            previous = kernels.dequantize(*residual, bits=8, block_size=self.block_size,
                                          length=partial_sums.shape[-1], backend=self.backend)
            partial_sums += previous
        sent = quantize(partial_sums)
        dropped = partial_sums - dequantize(sent)
        if exact_row is not None:
            dropped[exact_row] = 0
        if self.decay and previous is not None:
            dropped = previous.mul_(self.decay).add_(dropped, alpha=1.0 - self.decay)
        self.residuals[key] = kernels.quantize(dropped, 8, self.block_size, backend=self.backend)
        return sent

    def reset(self) -> None:
        self.residuals.clear()

    def describe(self) -> str:
        return ("error feedback (8-bit residual"
                + (f", averaged with decay {self.decay}" if self.decay else "")
                + (f", reset every {self.reset_every} reductions" if self.reset_every else "") + ")")

    def state_dict(self) -> dict[Any, Any]:
        """The residual of every key as (codes, scales), rank-local like the partial sums, and the reduction count
        the resets follow."""
        return {"residuals": {key: tuple(residual) for key, residual in self.residuals.items()},
                "reductions": self.reductions}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self.residuals = {key: kernels.Quantized(*residual) for key, residual in state["residuals"].items()}
        self.reductions = int(state["reductions"])


def _sum_in_order(stacked: torch.Tensor) -> torch.Tensor:
    total = stacked[0].clone()
    for part in stacked[1:]:
        total += part
    return total
