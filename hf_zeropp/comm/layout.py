"""Where an FSDP2 unit's parameters lie in the flat buffers its collectives exchange.

In torch 2.13's FSDP2 a rank's part of a unit's all-gather input and of its reduce-scatter input is the
concatenation, over the unit's parameters, of each one's dim-0-padded part: ``padded_sharded_param_size`` for a
gather or reduce-scatter over the whole world, ``1/k`` of the padded parameter for hpZ's gather over ``k`` ranks.
The all-gather carries every parameter; the reduce-scatter only those that received a gradient. ZeRO++ uses this
to send the 1-D parameters (biases, norm gains) in full precision: quantized with the matrices, they share blocks
with values of another magnitude and lose most of their precision.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from .._compat import fsdp_param_group, group_parameters, group_shard_world_size


class VectorSlices:
    """The positions of a unit's 1-D parameters in one rank's part of a collective's flat buffer.

    ``trainable_only``: lay out only the parameters that require a gradient (the reduce-scatter). When the part's
    length disagrees with the layout (FSDP's layout is not the one expected), :meth:`positions` returns None and the
    caller quantizes everything, saying so in its meter; rank 0 also warns, once per unit, since those 1-D
    parameters then lose most of their precision.
    """

    def __init__(self, module: nn.Module, trainable_only: bool) -> None:
        self.module = module
        self.trainable_only = trainable_only
        self.warned = False

    def positions(self, rank_numel: int, group_size: int, device: torch.device) -> torch.Tensor | None:
        spans = parameter_spans(self.module, self.trainable_only, rank_numel, group_size)
        if spans is None:
            self._warn_once()
            return None
        vectors = [torch.arange(start, start + length, device=device)
                   for param, start, length in spans if param.dim() == 1]
        return torch.cat(vectors) if vectors else torch.empty(0, dtype=torch.long, device=device)

    def _warn_once(self) -> None:
        if self.warned or (dist.is_initialized() and dist.get_rank() != 0):
            return
        self.warned = True
        collective = "reduce-scatter" if self.trainable_only else "all-gather"
        warnings.warn(f"hf_zeropp: {type(self.module).__name__}: FSDP2's {collective} buffer does not match the "
                      f"unit's parameters, so its 1-D parameters are quantized with the matrices (see "
                      f"comm_stats()['implementations']): a layout of FSDP2's hf_zeropp does not know")


def parameter_spans(module: nn.Module, trainable_only: bool, rank_numel: int,
                    group_size: int) -> list[tuple[nn.Parameter, int, int]] | None:
    """(sharded parameter, start, length) of each of the FSDP unit ``module``'s parameters in one rank's
    ``rank_numel``-element part of a collective over ``group_size`` ranks; None when the unit has no parameters or
    the part's length disagrees with the layout. ``trainable_only``: as in :class:`VectorSlices`."""
    group = fsdp_param_group(module)
    if group is None:
        return None
    params = [(p, n) for p, n in group_parameters(group) if p.requires_grad or not trainable_only]
    world = group_shard_world_size(group)
    offset, spans = 0, []
    for param, padded_numel in params:
        length = padded_numel * world // group_size
        spans.append((param, offset, length))
        offset += length
    return spans if offset == rank_numel else None
