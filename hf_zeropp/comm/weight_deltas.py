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
2. a node-local all-gather of the copies, which lays the node's ``k`` columns into FSDP's output. A flag beside
   each payload says whether a rank's difference lost more than :data:`DIFFERENCE_ERROR_LIMIT` of its shard; if any
   did, every rank sends what is left again at 8 bits, then if needed the shards whole, before forward computes.

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
from .qwz import QuantizedAllGather, all_gather_packed, start_all_gather_packed
from ..config.config import ZeroPPConfig
from .topology import Topology


# A difference whose quantization would leave a rank's shard further than this (relative L2) from the master is
# refined in the same gather: what is left is sent again at 8 bits, then, if that is still too far, the shards whole.
# About INT8 qwZ's own error on GPT-2 weights (2e-3 to 4e-3), so the weights forward uses are never further off than
# INT8's, whatever changed them (a large optimizer step, an edit in place).
DIFFERENCE_ERROR_LIMIT = 4e-3


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
        if on != getattr(self, "_enabled", None):
            self.forget()
        self._enabled = on

    def forget(self) -> None:
        """Drop the copy: the next gather over the world sends the shards whole. Call it on every rank together
        when weights are replaced (a load): a rank that forgot alone would send a payload of another size."""
        self.copy = None

    def kept_bytes(self) -> int:
        """Bytes of the copy this rank keeps between steps."""
        return 0 if self.copy is None else nbytes(self.copy)

    def _gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                async_op: bool) -> dist.Work | None:
        if not (self.enabled and self.topology.nodes > 1 and dist.get_world_size(group) == self.topology.world_size):
            return super()._gather(output_tensor, input_tensor, group, async_op)
        kind = allgather_kind()
        shard = input_tensor.clone()  # FSDP's input is a view of this rank's slot of the output
        layout = (self.topology.nodes, shard.numel())
        if self.copy is None or self.copy.shape != layout or self.copy.dtype != shard.dtype:
            self._send_whole(kind, shard, "first, or after the weights were replaced")
            self._record_error(kind, shard)
            self._gather_node_copies(output_tensor, kind)
            return None
        if kind == "bwd_allgather":  # the copy holds what forward computed with
            self._gather_node_copies(output_tensor, kind)
            return None
        payload, positions = self._difference(kind, shard, self.bits)
        work, arrivals = start_all_gather_packed(payload, self.topology.inter_node_group)

        def apply_arrivals() -> None:
            gathered = arrivals()
            self._add_differences(gathered, positions, self.bits)
            finer = [8] if self.bits < 8 else []
            while self._gather_node_copies(output_tensor, kind, too_coarse=bool(gathered[-1].any())):
                if not finer:
                    self._send_whole(kind, shard, f"a difference lost more than {DIFFERENCE_ERROR_LIMIT:g} of a shard")
                    self._gather_node_copies(output_tensor, kind)
                    break
                bits = finer.pop()
                payload, _ = self._difference(kind, shard, bits)
                gathered = all_gather_packed(payload, self.topology.inter_node_group)
                self._add_differences(gathered, positions, bits)
            self._record_error(kind, shard)

        return finish_after(work, apply_arrivals, async_op)

    def _send_whole(self, kind: str, shard: torch.Tensor, why: str) -> None:
        """Gather the column's shards unquantized into the copy, which is then exact."""
        inter = self.topology.inter_node_group
        self.meter.record(kind, inter, nbytes(shard), f"weight deltas: full {shard.dtype} gather across nodes ({why})")
        self.copy = all_gather_packed([shard], inter)[0].view(shard.dtype)

    def _record_error(self, kind: str, shard: torch.Tensor) -> None:
        if self.meter.track_errors:
            self.meter.record_error(kind, shard, self.copy[self.topology.node])

    def _difference(self, kind: str, shard: torch.Tensor, bits: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The payload of this rank's ``bits``-wide difference from its copy: codes, scales, the 1-D parameters'
        values, and whether the codes lose more than :data:`DIFFERENCE_ERROR_LIMIT` of the shard (one byte)."""
        difference = shard.float() - self.copy[self.topology.node].float()
        _, positions = self._take_vectors(kind, difference, self.topology.world_size)  # zeroed in the difference
        codes, scales = kernels.quantize(difference, bits, self.block_size, backend=self.backend)
        restored = kernels.dequantize(codes, scales, bits=bits, block_size=self.block_size,
                                      length=difference.numel(), dtype=torch.float32, backend=self.backend)
        too_coarse = (restored - difference).norm() > DIFFERENCE_ERROR_LIMIT * shard.float().norm()
        payload = [codes, scales] + ([shard[positions]] if positions is not None else []) + [
            too_coarse.to(torch.uint8).reshape(1)]
        self.meter.record(kind, self.topology.inter_node_group, sum(nbytes(t) for t in payload),
                          f"weight deltas: int{bits} differences across nodes (block {self.block_size})"
                          + (f", 1-D parameters in {shard.dtype}" if positions is not None else "")
                          + f", kernels {kernels.active_backend(shard.device, self.backend)}"
                          + ("" if bits == self.bits else f"; again, as int{self.bits} lost more than "
                                                         f"{DIFFERENCE_ERROR_LIMIT:g} of a shard"))
        return payload, positions

    def _add_differences(self, gathered: list[torch.Tensor], positions: torch.Tensor | None, bits: int) -> None:
        differences = kernels.dequantize(gathered[0], gathered[1].view(torch.float32), bits=bits,
                                         block_size=self.block_size, length=self.copy.shape[1], dtype=torch.float32,
                                         backend=self.backend)
        copy = (self.copy.float() + differences).to(self.copy.dtype)
        if positions is not None:
            copy[:, positions] = gathered[2].view(copy.dtype)
        self.copy = copy

    def _gather_node_copies(self, output_tensor: torch.Tensor, kind: str, too_coarse: bool | None = None) -> bool:
        """Lay every node's shards into FSDP's output (rows in world-rank order): this node's ranks exchange their
        copies, column ``l`` holding the shards of the ranks with local index ``l``. ``too_coarse`` (whether a
        difference of this rank's column lost too much) travels with the copies; returns whether any column's did,
        the same answer on every rank of the world."""
        nodes, node_size = self.topology.nodes, self.topology.node_size
        numel = self.copy.shape[1]
        sent = self.copy.reshape(-1)
        if too_coarse is not None:
            sent = torch.cat([sent, sent.new_full((1,), float(too_coarse))])
        if node_size == 1:
            columns = sent
        else:
            intra = self.topology.intra_node_group
            columns = sent.new_empty(node_size * sent.numel())
            all_gather_single(columns, sent, group=intra)
            self.meter.record(kind, intra, nbytes(sent), f"weight deltas: node-local {sent.dtype} all_gather of the "
                                                        f"kept copies")
        columns = columns.view(node_size, -1)
        output_tensor.view(nodes, node_size, numel).copy_(columns[:, :nodes * numel].reshape(node_size, nodes, numel)
                                                          .transpose(0, 1))
        return too_coarse is not None and bool(columns[:, -1].any())

def make_all_gather(config: ZeroPPConfig, topology: Topology, meter: CommMeter,
                    module: torch.nn.Module) -> QuantizedAllGather:
    """The FSDP unit ``module``'s forward all-gather: qwZ's, sending differences where ``weight_deltas`` is set."""
    return qwz.make_all_gather(config, topology, meter, module,
                               DeltaAllGather if config.weight_deltas else QuantizedAllGather)
