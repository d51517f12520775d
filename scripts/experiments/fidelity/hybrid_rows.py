"""The candidates' gradient paths: qgZ's reduce-scatter, and hybrid sharding's (an exact reduce-scatter inside the
node, then the engine's cross-node all-reduce), emulated on the unit's world-sharded buffer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zeropp.comm.comm_meter import CommMeter, MeteredReduceScatter, all_gather_single, check_sum
from hf_zeropp.config.config import ZeroPPConfig
from hf_zeropp.comm.hybrid import QuantizedCrossNodeAllReduce, record_hsdp_all_reduce
from hf_zeropp.comm.layout import parameter_spans
from hf_zeropp.comm.qgz import QuantizedReduceScatter, make_reduce_scatter
from hf_zeropp.comm.topology import Topology



def chunk_numel(shape: torch.Size, parts: int) -> int:
    """Elements of one rank's dim-0 chunk of a parameter of ``shape`` sharded over ``parts`` ranks, padded as FSDP2
    pads it (``ceil(dim 0 / parts)`` rows)."""
    return -(-shape[0] // parts) * shape[1:].numel()


def relayout(rows: torch.Tensor, shapes: list[torch.Size], parts: int) -> torch.Tensor:
    """A unit's flat buffer as FSDP2 lays it out over ``rows.shape[0]`` ranks, to the same buffer as FSDP2 lays it
    out over ``parts`` ranks: ``(parts, numel per rank)``. Row ``r`` is the concatenation, over the parameters of
    ``shapes`` (the unit's order), of each one's ``r``-th dim-0 chunk with torch.chunk's sizes (``ceil(dim 0 /
    parts)`` rows), zero-padded to that size; an emptied chunk is all padding."""
    offset, parts_of = 0, []
    for shape in shapes:
        numel, width = shape.numel(), chunk_numel(shape, rows.shape[0])
        padded = rows.new_zeros(parts, chunk_numel(shape, parts))
        padded.view(-1)[:numel] = rows[:, offset:offset + width].reshape(-1)[:numel]
        parts_of.append(padded)
        offset += width
    if offset != rows.shape[1]:
        raise ValueError(f"parameters of {offset} elements per rank laid out on a buffer of {rows.shape[1]}")
    return torch.cat(parts_of, dim=1)


def vector_positions(shapes: list[torch.Size], parts: int) -> torch.Tensor:
    """Where the 1-D parameters of ``shapes`` lie in one rank's row of ``relayout``'s layout over ``parts`` ranks
    (their padding included: it holds zeros)."""
    offset, positions = 0, []
    for shape in shapes:
        width = chunk_numel(shape, parts)
        if len(shape) == 1:
            positions.append(torch.arange(offset, offset + width))
        offset += width
    return torch.cat(positions) if positions else torch.empty(0, dtype=torch.long)


def unit_shapes(unit: nn.Module, rank_numel: int, group_size: int) -> list[torch.Size]:
    """The full shapes of the unit's trainable parameters, in the order of its reduce-scatter buffer, checked against
    FSDP2's layout of ``rank_numel`` elements per rank over ``group_size`` ranks: dim 0 chunked (``relayout``)."""
    spans = parameter_spans(unit, True, rank_numel, group_size)
    if spans is None:
        raise RuntimeError(f"{type(unit).__name__}: the reduce-scatter's buffer ({rank_numel} elements per rank) does "
                           f"not match its FSDP parameters; the hybrid rows cannot lay it out")
    shapes = [param.shape for param, _, _ in spans]  # a DTensor's shape is the full parameter's
    for shape, (_, _, length) in zip(shapes, spans):
        if length != chunk_numel(shape, group_size):
            raise RuntimeError(f"{type(unit).__name__}: a parameter of shape {tuple(shape)} takes {length} elements "
                               f"per rank, not its dim-0 chunk's; the hybrid rows cannot lay it out")
    return shapes


class ExactCrossNodeAllReduce:
    """Preset hybrid's cross-node step: FSDP2's own HSDP all-reduce (an fp32 SUM among the ranks of equal local
    index), metered as the engine meters it (``install_hybrid_all_reduce``)."""

    def __init__(self, topology: Topology, meter: CommMeter) -> None:
        self.group, self.meter = topology.inter_node_group, meter

    def reduce(self, partial: torch.Tensor, unit: int, vectors: torch.Tensor | None = None) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=self.group)
        record_hsdp_all_reduce(self.meter, self.group, total)
        return total


def cross_node_all_reduce(config: ZeroPPConfig, topology: Topology,
                          meter: CommMeter) -> QuantizedCrossNodeAllReduce | ExactCrossNodeAllReduce | None:
    """What a hybrid-sharding candidate runs across nodes, sending on ``meter``; None for a ZeRO++ (qgZ) one."""
    if config.shard_group != "node":
        return None
    if config.hybrid_gradient_bits is None:
        return ExactCrossNodeAllReduce(topology, meter)
    return QuantizedCrossNodeAllReduce(config, topology, meter)


class HybridReduceScatter:
    """Hybrid sharding's gradient path (presets hybrid, hybrid-q) run on a world-sharded unit's reduce-scatter input,
    so that it is measured on the very gradients the qgZ candidates get.

    Hybrid sharding's FSDP2 shards the unit over the ranks of one node, so its cross-node all-reduce quantizes the
    node layout of the unit's flat buffer, not the world layout FSDP hands this probe: the blocks would fall
    elsewhere. So the input (each rank's unreduced gradients, world layout) is laid out as FSDP2 on the node's mesh
    would (``relayout``), reduce-scattered exactly inside the node, and its node partial sum is reduced across nodes
    by the engine's own all-reduce (``cross_node.reduce``: the SUM over all ranks, as the exact reduce-scatter's;
    FSDP divides either by the world size afterwards). The node's shards of that sum are then gathered, a step of
    the emulation alone (not metered: the engine keeps the node layout), and this rank's world shard cut from them.
    """

    def __init__(self, cross_node: QuantizedCrossNodeAllReduce | ExactCrossNodeAllReduce, config: ZeroPPConfig,
                 topology: Topology, meter: CommMeter, unit: nn.Module, index: int) -> None:
        self.cross_node, self.topology, self.unit, self.index = cross_node, topology, unit, index
        self.full_precision_1d = config.gradient_full_precision_1d
        error_feedback = config.gradient_error_feedback
        self.intra_node = MeteredReduceScatter(meter)  # no byte of it crosses nodes
        # what Probe.start_window resets, as qgZ's ErrorFeedback: the residuals belong to the last window's gradients
        self.feedback = SimpleNamespace(reset=cross_node.reset_feedback) if error_feedback else None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> None:
        check_sum(op)
        topo = self.topology
        shapes = unit_shapes(self.unit, output_tensor.numel(), topo.world_size)
        node_layout = relayout(input_tensor.view(topo.world_size, -1), shapes, topo.node_size)
        partial = node_layout.new_empty(node_layout.shape[1])
        self.intra_node(partial, node_layout.reshape(-1), topo.intra_node_group, op)
        vectors = vector_positions(shapes, topo.node_size) if self.full_precision_1d else None
        total = self.cross_node.reduce(partial, self.index, vectors)
        gathered = total.new_empty(topo.node_size * total.numel())
        all_gather_single(gathered, total, topo.intra_node_group)
        output_tensor.copy_(relayout(gathered.view(topo.node_size, -1), shapes, topo.world_size)[topo.rank])


def gradient_candidate(config: ZeroPPConfig, cross_node: QuantizedCrossNodeAllReduce | ExactCrossNodeAllReduce | None,
                       topology: Topology, meter: CommMeter, unit: nn.Module,
                       index: int) -> QuantizedReduceScatter | HybridReduceScatter:
    """The unit's reduce-scatter under the gradient candidate ``config``: qgZ's (ZeRO++), or hybrid sharding's
    through ``cross_node``, the candidate's all-reduce (cross_node_all_reduce)."""
    if cross_node is None:
        return make_reduce_scatter(config, topology, meter, unit)
    return HybridReduceScatter(cross_node, config, topology, meter, unit, index)


