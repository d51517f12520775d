"""qwZ: the weight all-gather ships block-quantized codes and dequantizes on arrival.

FSDP2 hands the all-gather a flat buffer of this rank's (padded) parameter shards in the parameter dtype,
``input_tensor`` being a view into ``output_tensor`` at this rank's slot. qwZ quantizes that shard (INT8 by
default, one symmetric scale per block), all-gathers codes and scales, and dequantizes every rank's slot into
the output — this rank's own slot too, so all ranks compute with bit-identical weights.

Only gathers whose group spans more than one node are quantized unless ``quantize_hpz_gather`` is set: the
node-local hpZ gather in backward runs at full precision by default, as in the ZeRO++ paper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from . import kernels
from .comm_meter import CommMeter, _PlainAlloc, all_gather_single, allgather_kind, nbytes
from .topology import Topology

if TYPE_CHECKING:
    from .sharding import ZeroPPState


class QuantizedAllGather(_PlainAlloc, AllGather):
    def __init__(self, meter: CommMeter, topology: Topology, bits: int, block_size: int,
                 quantize_node_local: bool, enabled: bool = True) -> None:
        self.meter = meter
        self.topology = topology
        self.bits = bits
        self.block_size = block_size
        self.quantize_node_local = quantize_node_local
        self.enabled = enabled  # schedules switch qwZ off and on between steps

    def _quantizes(self, group: dist.ProcessGroup) -> bool:
        if not self.enabled:
            return False
        intra_peers, inter_peers = self.topology.peers_on_my_node(group)
        return inter_peers > 0 or (self.quantize_node_local and intra_peers > 0)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        kind = allgather_kind()
        if not self._quantizes(group):
            self.meter.record(kind, group, nbytes(input_tensor), f"all_gather {input_tensor.dtype}")
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        shard_numel = input_tensor.numel()
        original = input_tensor.clone() if self.meter.track_errors else None  # the output overwrites the input
        codes, scales = kernels.quantize(input_tensor, self.bits, self.block_size)
        gathered_codes, gathered_scales = all_gather_quantized(codes, scales, group)
        kernels.dequantize(gathered_codes, gathered_scales, bits=self.bits, block_size=self.block_size,
                           length=shard_numel, dtype=output_tensor.dtype, out=output_tensor.view(world, shard_numel))
        if original is not None:
            self.meter.record_error(kind, original, output_tensor.view(world, shard_numel)[dist.get_rank(group)])
        self.meter.record(kind, group, nbytes(codes) + nbytes(scales),
                          f"qwZ int{self.bits} all_gather (block {self.block_size})")
        return None


def all_gather_quantized(codes: torch.Tensor, scales: torch.Tensor,
                         group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather one rank's codes and scales as a single byte buffer (one collective, not two: at these sizes the
    per-collective latency costs more than the extra copy); returns every rank's codes and scales as rows."""
    world = dist.get_world_size(group)
    packed = torch.cat((codes.reshape(-1), scales.reshape(-1).view(torch.int8)))
    gathered = packed.new_empty(world * packed.numel())
    all_gather_single(gathered, packed, group=group)
    rows = gathered.view(world, -1)
    return (rows[:, : codes.numel()].contiguous(),
            rows[:, codes.numel():].contiguous().view(torch.float32))


def make_all_gather(state: ZeroPPState) -> QuantizedAllGather:
    """The qwZ all-gather for a unit; with qwZ off it runs the plain metered gather until a schedule switches it
    on."""
    config = state.config
    return QuantizedAllGather(state.meter, state.topology, config.weight_bits, config.block_size,
                              config.quantize_hpz_gather, enabled=config.quantized_weights)
