"""qwZ: the weight all-gather ships block-quantized codes and dequantizes on arrival.

FSDP2 hands the all-gather a flat buffer of this rank's (padded) parameter shards in the parameter dtype,
``input_tensor`` being a view into ``output_tensor`` at this rank's slot. qwZ quantizes that shard (INT8 by
default, one symmetric scale per block), all-gathers codes and scales, and dequantizes every rank's slot into
the output — this rank's own slot too, so all ranks compute with bit-identical weights.

FSDP's prefetch calls it with ``async_op=True`` (on CPU hf_zeropp asks FSDP for that, see
``live_weights.prefetch_gathers``): the codes are then on the wire while the previous unit computes, and the returned
work dequantizes them when FSDP waits for the gather.

Only gathers whose group spans more than one node are quantized unless ``quantize_hpz_gather`` is set: the
node-local hpZ gather in backward runs at full precision by default, as in the ZeRO++ paper.

The 1-D parameters' slices of the shard (biases, norm gains: ~1 % of a transformer's weights) travel unquantized
in the compute dtype (``weight_full_precision_1d``, default on), as qgZ does for their gradients. In INT8 blocks
shared with matrix values their relative error per forward was 0.11-0.16 at GPT-2 h = 768 with trained-like
values, against 0.007 for matrices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import kernels
from .._compat import AllGather
from .comm_meter import CommMeter, _PlainAlloc, all_gather_single, allgather_kind, finish_after, nbytes
from .layout import VectorSlices
from ..config.config import ZeroPPConfig
from .topology import Topology


PROFILER_RANGE = "hf_zeropp.comm.qwz.all_gather"  # what torch.profiler shows for one call, kernels and collective


class QuantizedAllGather(_PlainAlloc, AllGather):
    def __init__(self, meter: CommMeter, topology: Topology, bits: int, block_size: int,
                 quantize_node_local: bool, enabled: bool = True, vector_slices: VectorSlices | None = None,
                 backend: kernels.Backend | None = None) -> None:
        self.meter = meter
        self.topology = topology
        self.bits = bits
        self.block_size = block_size
        self.quantize_node_local = quantize_node_local
        self.enabled = enabled  # schedules switch qwZ off and on between steps
        self.vector_slices = vector_slices  # 1-D parameters travel unquantized (weight_full_precision_1d)
        self.backend = backend

    def applies(self) -> bool:
        """Whether some gather of this launch is quantized: one that crosses nodes, or a node-local one with
        ``quantize_hpz_gather``."""
        return self.topology.nodes > 1 or self.quantize_node_local

    def _quantizes(self, group: dist.ProcessGroup) -> bool:
        if not self.enabled:
            return False
        intra_peers, inter_peers = self.topology.peers_on_my_node(group)
        return inter_peers > 0 or (self.quantize_node_local and intra_peers > 0)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        with torch.profiler.record_function(PROFILER_RANGE):
            return self._gather(output_tensor, input_tensor, group, async_op)

    def _gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                async_op: bool) -> dist.Work | None:
        kind = allgather_kind()
        if not self._quantizes(group):
            self.meter.record(kind, group, nbytes(input_tensor), f"all_gather {input_tensor.dtype}")
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        shard_numel = input_tensor.numel()
        original = input_tensor.clone() if self.meter.track_errors else None  # the output overwrites the input
        vectors, positions = self._take_vectors(kind, input_tensor, world)
        codes, scales = kernels.quantize(input_tensor, self.bits, self.block_size, backend=self.backend)
        work, arrivals = start_all_gather_packed([codes, scales, *vectors], group)
        self.meter.record(kind, group, sum(nbytes(t) for t in (codes, scales, *vectors)),
                          f"qwZ int{self.bits} all_gather (block {self.block_size})"
                          + (f", 1-D parameters in {input_tensor.dtype}" if vectors else "")
                          + f", kernels {kernels.active_backend(input_tensor.device, self.backend)}")

        def dequantize_arrivals() -> None:
            gathered = arrivals()
            rows = output_tensor.view(world, shard_numel)
            kernels.dequantize(gathered[0], gathered[1].view(torch.float32), bits=self.bits,
                               block_size=self.block_size, length=shard_numel, dtype=output_tensor.dtype, out=rows,
                               backend=self.backend)
            if vectors:
                rows[:, positions] = gathered[2].view(output_tensor.dtype)
            if original is not None:
                self.meter.record_error(kind, original, rows[dist.get_rank(group)])

        # with async_op (FSDP's prefetch) the codes travel while the caller computes; they are dequantized when
        # FSDP waits for the gather, right before the unit's forward or backward needs its weights
        return finish_after(work, dequantize_arrivals, async_op)

    def _take_vectors(self, kind: str, shard: torch.Tensor, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """This rank's 1-D parameter values (sent as they are) and their positions; zeroes them in ``shard``, so that
        the blocks' scales come from the matrices (zeros quantize exactly)."""
        if self.vector_slices is None:
            return [], None
        positions = self.vector_slices.positions(shard.numel(), world, shard.device)
        if positions is None:
            self.meter.note(f"{kind}_1d_fallback",
                            f"{type(self.vector_slices.module).__name__}: the gathered shard does not match the "
                            f"unit's parameters, so its 1-D parameters were quantized with the rest")
            return [], None
        if positions.numel() == 0:
            return [], None
        vectors = shard[positions]
        shard[positions] = 0
        return [vectors], positions


def start_all_gather_packed(tensors: list[torch.Tensor], group: dist.ProcessGroup
                            ) -> tuple[dist.Work, Callable[[], list[torch.Tensor]]]:
    """Start an all-gather of several tensors of any dtypes as one byte buffer (one collective, not several: at
    these sizes the per-collective latency costs more than the copy). Returns the work and a function that, once
    the work is done, gives each tensor as ``(world, bytes)`` int8 rows; view them back with the tensor's dtype."""
    world = dist.get_world_size(group)
    as_bytes = [t.contiguous().reshape(-1).view(torch.int8) for t in tensors]
    packed = torch.cat(as_bytes)
    gathered = packed.new_empty(world * packed.numel())
    work = all_gather_single(gathered, packed, group=group, async_op=True)

    def parts() -> list[torch.Tensor]:
        rows = gathered.view(world, -1)
        unpacked, offset = [], 0
        for part in as_bytes:
            unpacked.append(rows[:, offset:offset + part.numel()].contiguous())
            offset += part.numel()
        return unpacked

    return work, parts


def all_gather_packed(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """:func:`start_all_gather_packed`, waited for."""
    work, parts = start_all_gather_packed(tensors, group)
    work.wait()
    return parts()


def make_all_gather(config: ZeroPPConfig, topology: Topology, meter: CommMeter, module: torch.nn.Module,
                    gather_class: type[QuantizedAllGather] = QuantizedAllGather) -> QuantizedAllGather:
    """The qwZ all-gather for the FSDP unit ``module`` (a ``gather_class``); with qwZ off it runs the plain metered
    gather until a schedule switches it on."""
    return gather_class(meter, topology, config.weight_bits, config.block_size,
                        config.quantize_hpz_gather, enabled=config.quantized_weights,
                        vector_slices=(VectorSlices(module, trainable_only=False)
                                       if config.weight_full_precision_1d else None),
                        backend=config.kernel_backend)
