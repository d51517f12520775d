"""qwZ by weight deltas: the forward gather sends the quantized difference from a copy every node keeps.

Between two optimizer steps a weight moves by about the learning rate, far less than the weight itself, so a
difference quantized to 4 bits loses less than the weight quantized to 8 (SDP4Bit's idea, NeurIPS 2024). A
difference only helps if the receivers hold what it is taken against, and ZeRO-3 keeps nothing between steps; this
gather keeps it.

Layout (ranks numbered node by node, ``k`` per node, ``N`` nodes): each rank keeps ``copy``, the receivers'
reconstruction of the world shards of the ``N`` ranks that share its local index (one per node): ``1/k`` of the
unit's weights, in the compute dtype, from one step to the next. A gather over the world then runs as

1. a cross-node all-gather among the ranks of equal local index of this rank's ``weight_bits``-wide difference
   ``shard - copy[my node]`` (one scale per block; 1-D parameters as values in the compute dtype, as qwZ sends
   them). Every rank of the column adds the same dequantized differences to the same copy, the sender included
   (its own row comes back from the gather like the others), so all copies stay bit-identical and the next
   difference is taken against what the receivers hold: the quantization error does not pile up, the next step
   sends it again;
2. a node-local all-gather of the copies, which lays the node's ``k`` columns into FSDP's output.

The first gather of a unit, and the first after :meth:`DeltaAllGather.forget` (weights loaded from outside the
optimizer, qwZ switched off and on), sends the shards in the compute dtype and the copy starts exact. A backward's
gather over the world (stage 3 without hpZ) only runs step 2: the copy holds the weights forward used, so backward
computes with the same ones and nothing crosses nodes, as under hpZ.

Every rank takes the same path in the same gather (copies exist on all ranks or none, forgetting is collective),
so payload sizes always agree. Gathers over a node-local group (hpZ's backward) are qwZ's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from . import qwz
from .comm_meter import CommMeter, allgather_kind, all_gather_single, finish_after, nbytes
from .qwz import QuantizedAllGather, start_all_gather_packed
from ..config.config import ZeroPPConfig
from .topology import Topology


class DeltaAllGather(QuantizedAllGather):
    """qwZ's all-gather for one FSDP unit, sending differences against the node-kept copy (see the module)."""

    def __init__(self, *args, **kwargs) -> None:
        self.copy: torch.Tensor | None = None  # (nodes, shard elements): this rank's column of the unit's shards
        super().__init__(*args, **kwargs)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        # the weights train on while the deltas are off, so switching them on again starts from a full gather
        self._enabled = on
        self.forget()

    def forget(self) -> None:
        """Drop the copy: the next gather over the world sends the shards whole. Call it on every rank together
        when weights change other than through a training step (a load), or the copies would disagree."""
        self.copy = None

    def _gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                async_op: bool) -> dist.Work | None:
        if not (self.enabled and self.topology.nodes > 1 and dist.get_world_size(group) == self.topology.world_size):
            return super()._gather(output_tensor, input_tensor, group, async_op)
        kind = allgather_kind()
        shard = input_tensor.clone()  # FSDP's input is a view of this rank's slot of the output
        nodes, numel = self.topology.nodes, shard.numel()
        if self.copy is not None and self.copy.shape == (nodes, numel) and self.copy.dtype == shard.dtype:
            if kind == "bwd_allgather":  # the copy holds what forward computed with
                self._gather_node_copies(output_tensor, kind)
                return None
            payload, positions, label = self._difference(kind, shard)
            whole = False
        else:
            payload, positions, whole = [shard], None, True
            label = f"weight deltas: full {shard.dtype} gather (first, or after the weights were replaced)"
        inter = self.topology.inter_node_group
        work, arrivals = start_all_gather_packed(payload, inter)
        self.meter.record(kind, inter, sum(nbytes(t) for t in payload), label)

        def apply_arrivals() -> None:
            gathered = arrivals()
            if whole:
                self.copy = gathered[0].view(shard.dtype).view(nodes, numel)
            else:
                self._add_differences(gathered, positions, numel)
            if self.meter.track_errors:
                self.meter.record_error(kind, shard, self.copy[self.topology.node])
            self._gather_node_copies(output_tensor, kind)

        return finish_after(work, apply_arrivals, async_op)

    def _difference(self, kind: str, shard: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None, str]:
        """The payload of this rank's difference from its copy: codes, scales and the 1-D parameters' values."""
        difference = shard.float() - self.copy[self.topology.node].float()
        _, positions = self._take_vectors(kind, difference, self.topology.world_size)  # zeroed in the difference
        codes, scales = kernels.quantize(difference, self.bits, self.block_size, backend=self.backend)
        payload = [codes, scales] + ([shard[positions]] if positions is not None else [])
        label = (f"weight deltas: int{self.bits} differences across nodes (block {self.block_size})"
                 + (f", 1-D parameters in {shard.dtype}" if positions is not None else "")
                 + f", kernels {kernels.active_backend(shard.device, self.backend)}")
        return payload, positions, label

    def _add_differences(self, gathered: list[torch.Tensor], positions: torch.Tensor | None, numel: int) -> None:
        differences = kernels.dequantize(gathered[0], gathered[1].view(torch.float32), bits=self.bits,
                                         block_size=self.block_size, length=numel, dtype=torch.float32,
                                         backend=self.backend)
        copy = (self.copy.float() + differences).to(self.copy.dtype)
        if positions is not None:
            copy[:, positions] = gathered[2].view(copy.dtype)
        self.copy = copy

    def _gather_node_copies(self, output_tensor: torch.Tensor, kind: str) -> None:
        """Lay every node's shards into FSDP's output (rows in world-rank order): this node's ranks exchange their
        copies, column ``l`` holding the shards of the ranks with local index ``l``."""
        nodes, node_size = self.topology.nodes, self.topology.node_size
        numel = self.copy.shape[1]
        if node_size == 1:
            output_tensor.view(nodes, numel).copy_(self.copy)
            return
        intra = self.topology.intra_node_group
        columns = self.copy.new_empty(node_size * nodes * numel)
        all_gather_single(columns, self.copy.reshape(-1), group=intra)
        self.meter.record(kind, intra, nbytes(self.copy), f"weight deltas: node-local {self.copy.dtype} all_gather "
                                                          f"of the kept copies")
        output_tensor.view(nodes, node_size, numel).copy_(columns.view(node_size, nodes, numel).transpose(0, 1))


def make_all_gather(config: ZeroPPConfig, topology: Topology, meter: CommMeter,
                    module: torch.nn.Module) -> QuantizedAllGather:
    """The FSDP unit ``module``'s forward all-gather: qwZ's, sending differences where ``weight_deltas`` is set."""
    return qwz.make_all_gather(config, topology, meter, module,
                               DeltaAllGather if config.weight_deltas else QuantizedAllGather)
