"""Hybrid sharding (``shard_group: node``): states sharded inside each node, replicated across nodes, and the one
collective that crosses nodes, the gradient all-reduce, optionally block-quantized (``hybrid_gradient_bits``).

FSDP2 shards every unit over the node's ranks. After its reduce-scatter inside the node, the ranks of equal local
index (one per node: the inter-node group) hold the same shard of their nodes' partial sums; averaging those is the
only traffic between nodes, once per step and on 1/(ranks per node) of the model. In full precision that is FSDP2's
own HSDP all-reduce (a 2-D mesh). Quantized, FSDP2 runs on the node's 1-D mesh and its all-reduce hook calls
:class:`QuantizedCrossNodeAllReduce`, which sends:

1. a reduce-scatter across nodes as an all-to-all of block-quantized chunks (chunk ``m`` to node ``m``, which adds
   the arrivals in fp32 and its own chunk exactly: it never left the rank);
2. an all-gather of the requantized sums. Every node dequantizes every chunk, its own included, so that all
   replicas get the same gradient, bit for bit, and stay identical after the optimizer step.

With ``gradient_full_precision_1d`` (the default, as for qgZ) the 1-D parameters' values (biases, norm gains) are
left out of the blocks and all-reduced in fp32 beside them: a few bytes that keep them exact.

Both hops run asynchronously: the hook quantizes a unit's partial sum, starts hop 1 and returns, so the rest of the
backward runs while the bytes travel; the next unit's hook starts hop 2 of the one before (at the same point on every
rank: collectives on one group must keep one order). Once the backward
has finished (an autograd final callback, before clipping and the optimizer step) every unit is completed and its
gradients are set to the cross-node mean, each value divided by the world size once.

An untied input embedding is a unit of its own whose gradient is complete last, at the backward's end, with no
compute left to overlap its all-reduce; it holds only the rows the batch looked up. The ranks of an inter-node group
agree on the rows that hold a gradient on some node (a one-byte-per-row all-reduce) and send those rows only. Nothing
relies on the batch's tokens: any other use of the weight (a penalty on it in the loss) makes rows hold a gradient
and so be sent, and when most rows hold one the unit is sent whole. A tied embedding also holds the output head's
dense gradient, so it is sent whole.

With ``gradient_error_feedback`` each hop's quantization error is carried into the same hop of the unit's next
reduction (:class:`~hf_zeropp.comm.qgz_payload.ErrorFeedback`): hop 1's residual is this rank's node partial sum's (the
chunk it keeps is exact and carries none), hop 2's is the owner's requantized sum's. Every replica still dequantizes
the same bytes. The residuals are per rank, so checkpoints keep them in the rank's own file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels
from .._compat import in_backward, local_tensor, queue_backward_callback
from .comm_meter import CommMeter, all_gather_single, nbytes
from ..config.config import ZeroPPConfig
from .layout import VectorSlices, parameter_spans
from .qgz_payload import BlockQuantizedPayload, ErrorFeedback
from .topology import Topology

# bytes of fp32 master weights, gradients and Adam's two moments per parameter: what a rank holds per parameter it
# owns, the basis of the check that a node can hold the states of the whole model
STATE_BYTES_PER_PARAMETER = 16


@dataclass
class _Unit:
    """One FSDP unit's cross-node all-reduce in flight."""

    numel: int  # of this node's partial sum, as the hook received it
    spans: list[tuple[nn.Parameter, int, int]]
    accumulated: list[torch.Tensor | None]  # the gradients the parameters held before this backward (accumulation)
    rows: torch.Tensor  # the partial sum in fp32, zero-padded, one row per node
    feedback: ErrorFeedback | None  # the unit's residuals (gradient_error_feedback)
    vectors: torch.Tensor | None  # positions of the 1-D parameters in the partial sum, reduced in fp32 on their own
    vector_sum: torch.Tensor | None
    sent: torch.Tensor | None  # the positions in the blocks, when not all (input-embedding rows with no gradient)
    vector_work: dist.Work | None = None
    hop1: dist.Work | None = None
    arrived: torch.Tensor | None = None
    hop2: dist.Work | None = None
    gathered: torch.Tensor | None = None


class QuantizedCrossNodeAllReduce:
    """The all-reduce hook of every FSDP unit of one model (:meth:`hook_for`)."""

    def __init__(self, config: ZeroPPConfig, topology: Topology, meter: CommMeter) -> None:
        self.bits = int(config.hybrid_gradient_bits)
        self.block_size = config.gradient_block_size or config.block_size
        self.hadamard = config.gradient_hadamard
        self.stochastic = config.stochastic_rounding
        self.seed = config.seed
        self.backend = config.kernel_backend
        # sums the dequantized chunks that arrive at hop 1 (qgZ's fused dequantize-and-add)
        self.peers = BlockQuantizedPayload(self.block_size, self.stochastic, self.hadamard, self.backend)
        self.topology = topology
        self.meter = meter
        self.group = topology.inter_node_group
        self.new_feedback = (functools.partial(ErrorFeedback, self.block_size, self.backend,
                                               config.gradient_error_feedback_decay,
                                               config.gradient_error_feedback_reset)
                             if config.gradient_error_feedback else None)
        self.unit_feedback: dict[int, ErrorFeedback] = {}  # per unit (hook_for's order), with error feedback
        self.full_precision_1d = config.gradient_full_precision_1d
        self.vector_slices: list[VectorSlices] = []  # per unit, in hook_for's order
        self.calls = 0
        self.pending: list[_Unit] = []
        self.finish_queued = False
        self.embedding: nn.Parameter | None = None  # an untied input embedding's weight (send_embedding_rows)

    def hook_for(self, module: nn.Module):
        index = len(self.vector_slices)
        self.vector_slices.append(VectorSlices(module, trainable_only=True))

        def hook(reduce_output: torch.Tensor) -> None:
            self._start(module, index, reduce_output)

        return hook

    # ---------------------------------------------------------------- the hook

    def _start(self, module: nn.Module, index: int, reduce_output: torch.Tensor) -> None:
        numel, node_size = reduce_output.numel(), self.topology.node_size
        spans = parameter_spans(module, True, numel, node_size)
        vectors = None
        if self.full_precision_1d:
            vectors = self.vector_slices[index].positions(numel, node_size, reduce_output.device)
            if vectors is None:
                self.meter.note("hybrid_1d_fallback", f"{type(module).__name__}: the gradient does not match the "
                                f"unit's parameters (one got no gradient), so its 1-D slices were quantized too")
        if spans is None or not in_backward():
            # FSDP's layout is not the one expected (or no backward to wait for): finish now, in place
            self.meter.note("hybrid_synchronous", "a unit whose gradient layout was not the expected one")
            reduce_output.copy_(self.reduce(reduce_output, index, vectors))
            return
        unit = self._unit(reduce_output, index, spans, vectors, self._rows_to_send(reduce_output, spans, vectors))
        unit.accumulated = [None if p.grad is None else local_tensor(p.grad).clone() for p, _, _ in spans]
        self._send_chunks(unit)
        if self.pending and self.pending[-1].hop2 is None:
            # the unit before this one had its backward's worth of compute to arrive; every rank advances the same
            # unit at the same point, so the group's collectives keep one order on all of them
            self._receive_chunks(self.pending[-1])
        self.pending.append(unit)
        if not self.finish_queued:
            queue_backward_callback(self.finish)
            self.finish_queued = True

    # ---------------------------------------------------------------- untied input embeddings

    def send_embedding_rows(self, embeddings: nn.Module | None, head: nn.Module | None) -> None:
        """Send only the rows of the input embedding's gradient that hold a gradient (module docstring), unless the
        output ``head`` shares its weight. Call once the modules are sharded."""
        weight = getattr(embeddings, "weight", None)
        if (not isinstance(weight, nn.Parameter) or weight.dim() != 2 or not weight.requires_grad
                or getattr(head, "weight", None) is weight):
            return
        if self.new_feedback is not None:
            self.meter.note("hybrid_embedding_rows", "the input embedding's gradient crosses nodes whole: error "
                            "feedback keeps a residual for every position")
            return
        self.embedding = weight

    def _rows_to_send(self, partial: torch.Tensor, spans: list[tuple[nn.Parameter, int, int]],
                      vectors: torch.Tensor | None) -> torch.Tensor | None:
        """Positions of this unit's partial sum to quantize and send, when it holds the input embedding and most of
        the embedding's rows hold no gradient on any node (the same on every rank of the inter-node group)."""
        span = next(((start, length) for param, start, length in spans if param is self.embedding), None)
        if span is None:
            return None
        start, length = span
        rows = partial[start:start + length].view(-1, self.embedding.shape[1])
        touched = rows.ne(0).any(dim=1).to(torch.uint8)
        dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=self.group)
        self.meter.record_allreduce(self.group, nbytes(touched), "which input-embedding rows hold a gradient on "
                                    "some node, one byte per row", kind="hybrid_row_mask")
        if 2 * int(touched.sum()) > touched.numel():
            self.meter.note("hybrid_embedding_rows", "the input embedding's gradient crossed nodes whole: most of its "
                            "rows hold a gradient")
            return None
        send = torch.ones(partial.numel(), dtype=torch.bool, device=partial.device)
        send[start:start + length].view_as(rows)[touched == 0] = False
        if vectors is not None:
            send[vectors] = False
        return send.nonzero().view(-1)

    def reduce(self, partial: torch.Tensor, unit: int = 0, vectors: torch.Tensor | None = None) -> torch.Tensor:
        """This node's partial sum of the gradient of unit ``unit`` (whose error-feedback residuals apply) to the
        sum over all nodes (fp32, the same bits on every replica), both hops waited for: the path of a unit that
        cannot wait for the backward's end, and what an instrument measuring this all-reduce on gradients of its
        own calls (a collective of the inter-node group). ``vectors``: positions reduced in fp32 instead (the 1-D
        parameters' with ``gradient_full_precision_1d``)."""
        reduction = self._unit(partial, unit, [], vectors)
        self._send_chunks(reduction)
        self._receive_chunks(reduction)
        return self._result(reduction)

    def reset_feedback(self) -> None:
        """Drop every residual (they belong to gradients that are no longer being reduced)."""
        for feedback in self.unit_feedback.values():
            feedback.reset()

    def _unit(self, reduce_output: torch.Tensor, index: int, spans: list[tuple[nn.Parameter, int, int]],
              vectors: torch.Tensor | None, sent: torch.Tensor | None = None) -> _Unit:
        topo, numel = self.topology, reduce_output.numel()
        vectors = vectors if vectors is not None and vectors.numel() else None
        values = reduce_output.detach() if sent is None else reduce_output.detach()[sent]
        # at least one block: a rank whose shard of an embedding unit holds no row with a gradient still takes part
        chunk = max(1, -(-values.numel() // (topo.nodes * self.block_size))) * self.block_size
        rows = reduce_output.new_zeros(topo.nodes, chunk, dtype=torch.float32)
        rows.view(-1)[:values.numel()] = values
        vector_sum = None
        if vectors is not None:
            # biases and norm gains would share blocks with values of another magnitude and lose their precision;
            # zeros quantize exactly and leave the scales to the matrices (``sent`` leaves them out already)
            vector_sum = reduce_output.detach()[vectors].float()
            if sent is None:
                rows.view(-1)[vectors] = 0
        feedback = None
        if self.new_feedback is not None:
            feedback = self.unit_feedback.get(index)
            if feedback is None:
                feedback = self.unit_feedback[index] = self.new_feedback()
            feedback.start_reduction()
        return _Unit(numel, spans, [], rows, feedback, vectors, vector_sum, sent)

    # ---------------------------------------------------------------- the two hops

    def _quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows to one byte buffer per row: codes then fp32 scales (one collective carries both)."""
        self.calls += 1
        seed = (self.seed * 1_000_003 + self.calls * 7919 + self.topology.rank * 104_729) & 0xFFFFFFFF
        codes, scales = kernels.quantize(rows, self.bits, self.block_size, stochastic=self.stochastic, seed=seed,
                                         hadamard=self.hadamard, backend=self.backend)
        return torch.cat((codes.view(torch.int8), scales.view(torch.int8)), dim=1)

    def _quantize_compensated(self, unit: _Unit, hop: int, rows: torch.Tensor,
                              exact_row: int | None = None) -> torch.Tensor:
        """:meth:`_quantize`, through the unit's error feedback when it has one (``rows`` then get the hop's
        residual added, in place)."""
        if unit.feedback is None:
            return self._quantize(rows)
        length = rows.shape[1]
        return unit.feedback.requantize(hop, rows, self._quantize, lambda packed: self._dequantize(packed, length),
                                        exact_row)

    def _unpack(self, packed: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Byte rows from :meth:`_quantize` back to (codes, fp32 scales), each contiguous."""
        code_bytes = kernels.packed_length(length, self.bits)
        return packed[:, :code_bytes].contiguous(), packed[:, code_bytes:].contiguous().view(torch.float32)

    def _dequantize(self, packed: torch.Tensor, length: int) -> torch.Tensor:
        return kernels.dequantize(*self._unpack(packed, length), bits=self.bits, block_size=self.block_size,
                                  length=length, hadamard=self.hadamard, backend=self.backend)

    def _send_chunks(self, unit: _Unit) -> None:
        """Hop 1: chunk ``m`` of this node's partial sum, quantized, to the rank of my local index on node ``m``."""
        if unit.vectors is not None:
            unit.vector_work = dist.all_reduce(unit.vector_sum, group=self.group, async_op=True)
            self.meter.record_allreduce(self.group, nbytes(unit.vector_sum), "hybrid cross-node all-reduce of the "
                                        "1-D parameters, fp32", kind="hybrid_1d_full_precision")
        packed = self._quantize_compensated(unit, 0, unit.rows, exact_row=self.topology.node)
        if self.meter.track_errors:
            self.meter.record_error("hybrid_reduce_scatter", unit.rows, self._dequantize(packed, unit.rows.shape[1]))
        unit.arrived = torch.empty_like(packed)
        unit.hop1 = dist.all_to_all_single(unit.arrived, packed, group=self.group, async_op=True)
        self.meter.record("hybrid_reduce_scatter", self.group, nbytes(packed[0]), self.describe())

    def _receive_chunks(self, unit: _Unit) -> None:
        """Between the hops: add the nodes' chunks of my part (mine exactly), requantize, start hop 2."""
        unit.hop1.wait()
        node, length = self.topology.node, unit.rows.shape[1]
        codes, scales = self._unpack(unit.arrived, length)
        # the other nodes' chunks dequantized and added in one fused pass, then mine, which never left the rank
        total = self.peers.sum_peers(codes[:, None], scales[:, None], self.bits, length, skip=node)
        total += unit.rows[node]
        packed = self._quantize_compensated(unit, 1, total)
        if self.meter.track_errors:
            self.meter.record_error("hybrid_all_gather", total, self._dequantize(packed, length))
        unit.gathered = packed.new_empty(self.topology.nodes, packed.shape[1])
        unit.hop2 = all_gather_single(unit.gathered, packed, group=self.group, async_op=True)
        self.meter.record("hybrid_all_gather", self.group, nbytes(packed), self.describe())

    def _result(self, unit: _Unit, scale: float = 1.0) -> torch.Tensor:
        """Hop 2 arrived: ``scale`` x the sum over all ranks, identical on every node (each dequantizes the same
        bytes with the same kernel)."""
        unit.hop2.wait()
        length = unit.rows.shape[1]
        codes, scales = self._unpack(unit.gathered, length)
        summed = kernels.dequant_reduce(codes[None], scales[None], bits=self.bits, block_size=self.block_size,
                                        length=length, scale=scale, hadamard=self.hadamard, backend=self.backend)
        if unit.sent is None:
            result = summed.view(-1)[:unit.numel]
        else:
            result = summed.new_zeros(unit.numel)
            result[unit.sent] = summed.view(-1)[:unit.sent.numel()]
        if unit.vectors is not None:
            unit.vector_work.wait()
            result[unit.vectors] = unit.vector_sum * scale
        return result

    # ---------------------------------------------------------------- after backward

    def finish(self) -> None:
        """Complete every unit of this backward and give its parameters the cross-node mean as gradient."""
        self.finish_queued = False
        pending, self.pending = self.pending, []
        for unit in pending:
            if unit.hop2 is None:
                self._receive_chunks(unit)
        world = self.topology.world_size
        for unit in pending:
            mean = self._result(unit, 1.0 / world)
            for (param, start, _), before in zip(unit.spans, unit.accumulated):
                if param.grad is None:  # no rank used it: None, as under stock (hf_zeropp.engine.unused_parameters)
                    continue
                grad = local_tensor(param.grad)
                update = mean[start:start + grad.numel()].view_as(grad)
                grad.copy_(update if before is None else before + update.to(before.dtype))

    def state_dict(self) -> dict[str, int]:
        """The call count the stochastic-rounding seeds derive from (equal on every rank): a checkpoint carries it so
        a resumed run draws the rounding the uninterrupted run would have."""
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = int(state["calls"])

    def residuals_state_dict(self) -> dict[int, dict]:
        """This rank's error-feedback residuals per unit (they differ between ranks, unlike :meth:`state_dict`)."""
        return {index: feedback.state_dict() for index, feedback in self.unit_feedback.items()}

    def load_residuals_state_dict(self, state: dict[int, dict]) -> None:
        if self.new_feedback is None:
            return
        self.unit_feedback = {}
        for index, saved in state.items():
            self.unit_feedback[index] = self.new_feedback()
            self.unit_feedback[index].load_state_dict(saved)

    def describe(self) -> str:
        return (f"hybrid cross-node all-reduce: int{self.bits} block {self.block_size} reduce-scatter + all-gather "
                f"among {self.topology.nodes} nodes, asynchronous"
                + (f", Hadamard {self.hadamard}" if self.hadamard else "")
                + (", stochastic rounding" if self.stochastic else "")
                + (", 1-D parameters in full precision" if self.full_precision_1d else "")
                + (f", {self.new_feedback().describe()} on both hops" if self.new_feedback is not None else "")
                + (", input-embedding rows that hold a gradient" if self.embedding is not None else ""))


def install_hybrid_all_reduce(modules: list[nn.Module], config: ZeroPPConfig, topology: Topology, meter: CommMeter,
                              embeddings: nn.Module | None = None,
                              head: nn.Module | None = None) -> QuantizedCrossNodeAllReduce | None:
    """Give FSDP's cross-node all-reduce of every unit to the meter (full precision: FSDP2's HSDP all-reduce) or
    to :class:`QuantizedCrossNodeAllReduce`, which also sets the divide factor so each value is averaged once and
    sends the rows of an untied input ``embeddings``' gradient that hold one only; returns the latter, if installed."""
    if config.hybrid_gradient_bits is None or topology.nodes == 1:
        group = topology.inter_node_group

        def metered(reduced: torch.Tensor) -> None:
            record_hsdp_all_reduce(meter, group, reduced)

        for module in modules:
            module.set_all_reduce_hook(metered)
        return None
    all_reduce = QuantizedCrossNodeAllReduce(config, topology, meter)
    for module in modules:
        module.set_all_reduce_hook(all_reduce.hook_for(module))
        module.set_gradient_divide_factor(float(topology.world_size))
    all_reduce.send_embedding_rows(embeddings, head)
    return all_reduce


def record_hsdp_all_reduce(meter: CommMeter, group: dist.ProcessGroup, reduced: torch.Tensor) -> None:
    """Count one unit's full-precision cross-node all-reduce (FSDP2's HSDP) on ``meter``."""
    meter.record_allreduce(group, nbytes(reduced), f"hybrid cross-node all-reduce {reduced.dtype} (FSDP2 HSDP)",
                           kind="hybrid_allreduce")


def check_hybrid_fits(model: nn.Module, config: ZeroPPConfig, topology: Topology, device: torch.device) -> None:
    """Before any collective: hybrid sharding's states (fp32 weights, gradients, Adam moments) divided by the ranks
    of a node must fit the memory free for one rank. (On one node it is ZeRO-3: :mod:`hf_zeropp.engine.reports` says
    so.)"""
    if config.shard_group != "node" or topology.nodes == 1:
        return
    fits, needed, free = hybrid_fits(model, topology, device)
    if not fits:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters()) - trainable
        raise ValueError(
            f"shard_group='node': {trainable:,} trainable and {frozen:,} frozen parameters need about "
            f"{needed / 2**30:.2f} GiB of states per rank when sharded over a node of {topology.node_size} ranks, but "
            f"about {free / 2**30:.2f} GiB is free per rank on {device.type}; shard over all ranks instead (preset "
            f"zero3 or zeropp)")


def hybrid_fits(model: nn.Module, topology: Topology, device: torch.device) -> tuple[bool, float, float]:
    """(fits, bytes of states per rank under hybrid sharding, bytes free per rank; inf when unknown)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters()) - trainable
    needed = (trainable * STATE_BYTES_PER_PARAMETER + frozen * 4) / topology.node_size
    free = _free_bytes_per_rank(device, topology.node_size)
    free = float("inf") if free is None else free
    return needed <= free, needed, free


def _free_bytes_per_rank(device: torch.device, ranks_per_node: int) -> float | None:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        return int(fields["MemAvailable"].split()[0]) * 1024 / ranks_per_node
    except (OSError, KeyError, ValueError):
        return None
