"""qgZ: the gradient reduce-scatter as a hierarchical 2-hop all-to-all on block-quantized data (ZeRO++ §3.3).

For ``nodes`` nodes of ``node_size`` ranks, FSDP2's reduce-scatter input holds one chunk per global rank. Per
pipeline stage ``s`` (ZeRO++ Alg. 2; each chunk is cut into ``stages`` slices):

1. ``swizzle_quantize`` reorders the slices (Eq. 1-2) and quantizes them to ``gradient_intra_bits``, so that the
   rows addressed to each *local* rank are contiguous;
2. intra-node all-to-all: each rank receives, from every rank of its node, the ``nodes`` rows whose owners share
   its local index;
3. ``dequant_reduce_quant``: sum those ``node_size`` contributions in fp32 and requantize to ``gradient_bits``;
4. inter-node all-to-all among the ranks with this local index: row ``m`` goes to node ``m``;
5. ``dequant_reduce``: sum the ``nodes`` partial sums in fp32 into this rank's slice of its shard.

With ``gradient_full_precision_local`` a rank adds its own contribution at each hop (the rows it addresses to
itself, which never leave it) in fp32 instead of dequantizing its own quantized copy; the sums then run unfused.

The intra-node all-to-alls of all stages are issued asynchronously up front, and stage ``s``'s inter-node hop runs
while stage ``s + 1`` is reduced — the overlap Alg. 2 pipelines for. The result is the plain SUM that FSDP asked
for; FSDP then divides by the world size exactly once (``set_force_sum_reduction_for_comms``), so the gradient is
the true mean, never ``node_size`` times it. A single node runs one hop; shards that do not split evenly into
stages are zero-padded. What ran is recorded in ``comm_stats(...)["implementations"]``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from .. import kernels
from .._compat import ReduceScatter
from .comm_meter import CommMeter, MeteredReduceScatter, _PlainAlloc, check_sum, nbytes
from ..config.config import ZeroPPConfig
from ..kernels.reference import hadamard_rows
from .layout import VectorSlices
from .qgz_payload import BlockQuantizedPayload, ErrorFeedback, OwnRows
from .topology import Topology


PROFILER_RANGE = "hf_zeropp.comm.qgz.reduce_scatter"  # what torch.profiler shows for one call, kernels and collectives


class QuantizedReduceScatter(_PlainAlloc, ReduceScatter):
    def __init__(self, meter: CommMeter, topology: Topology, intra_bits: int, inter_bits: int, block_size: int,
                 stages: int, stochastic: bool, seed: int, enabled: bool = True, hadamard: int = 0,
                 error_feedback: bool = False, error_feedback_decay: float = 0.0, error_feedback_reset: int = 0,
                 allocate_bits: bool = False, width_floor: int = 0, vector_slices: VectorSlices | None = None,
                 full_precision_local: bool = False,
                 payload: BlockQuantizedPayload | None = None,
                 backend: kernels.Backend | None = None) -> None:
        self.meter = meter
        self.topology = topology
        self.intra_bits = intra_bits
        self.inter_bits = inter_bits
        self.block_size = block_size
        self.stages = stages
        self.stochastic = stochastic
        self.seed = seed
        self.enabled = enabled  # schedules switch qgZ off and on between steps
        self.hadamard = hadamard
        self.backend = backend
        self.payload = payload or BlockQuantizedPayload(block_size, stochastic, hadamard, backend, allocate_bits,
                                                        width_floor)
        self.feedback = (ErrorFeedback(block_size, backend, error_feedback_decay, error_feedback_reset)
                         if error_feedback else None)
        self.vector_slices = vector_slices
        # unquantized payloads have no error to spare
        self.full_precision_local = full_precision_local and isinstance(self.payload, BlockQuantizedPayload)
        self.calls = 0  # stochastic-rounding seeds derive from it (see _seed)
        self._plain = MeteredReduceScatter(meter)
        self._plain_vectors = MeteredReduceScatter(meter, "qgz_1d_full_precision")

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        check_sum(op)
        with torch.profiler.record_function(PROFILER_RANGE):
            return self._reduce_scatter(output_tensor, input_tensor, group, op)

    def _reduce_scatter(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                        op: Any) -> None:
        topo = self.topology
        if not self.enabled:
            if self.feedback is not None:
                self.feedback.reset()  # a residual from before a pause belongs to other gradients
            return self._plain(output_tensor, input_tensor, group, op)
        if dist.get_world_size(group) != topo.world_size:
            raise RuntimeError(
                f"qgZ expects the reduce-scatter over all {topo.world_size} ranks but FSDP used a group of "
                f"{dist.get_world_size(group)}; this is a bug in hf_zeropp's FSDP setup"
            )
        nodes, node_size, stages = topo.nodes, topo.node_size, self.stages
        shard_numel = output_tensor.numel()
        slice_len = -(-shard_numel // stages)
        chunks = input_tensor.view(topo.world_size, shard_numel)
        exact = self._reduce_vectors_exactly(chunks, group)
        if slice_len * stages != shard_numel:
            padded = chunks.new_zeros(topo.world_size, slice_len * stages)
            padded[:, :shard_numel] = chunks
            chunks = padded
        seed = self._seed()
        own_rows = self._own_rows(chunks, slice_len) if self.full_precision_local else None
        # one rank per node has no intra-node hop: quantize straight to the inter-node width
        first_bits = self.intra_bits if node_size > 1 else self.inter_bits
        payload, scales = self.payload.swizzle(chunks.reshape(-1), nodes, node_size, stages, first_bits, seed)
        if self.meter.track_errors and isinstance(self.payload, BlockQuantizedPayload):
            self._record_error(chunks, payload, scales, first_bits, slice_len,
                               crossed_nodes=node_size == 1 and nodes > 1)
        rows_per_stage = node_size * nodes
        payload = payload.view(stages, rows_per_stage, payload.shape[-1])
        scales = scales.view(stages, rows_per_stage, scales.shape[-1])

        # hop 1 (intra-node): every stage's all-to-all goes out now; the node's D contributions arrive stacked
        if node_size > 1:
            received = [self._all_to_all(payload[s], scales[s], topo.intra_node_group, "qgz_intra")
                        for s in range(stages)]
        else:  # one rank per node: nothing to exchange inside the node
            received = [functools.partial(_as_one_peer, payload[s], scales[s]) for s in range(stages)]

        exact_fit = slice_len * stages == shard_numel
        result = output_tensor.view(stages, slice_len) if exact_fit else output_tensor.new_empty(stages, slice_len)
        if nodes == 1:  # single node: one hop, reduce straight to full precision
            final = received
            final_bits = first_bits
            own_final = None if own_rows is None else [OwnRows(topo.local_rank, rows) for rows in own_rows]
        else:
            final = []
            own_final = None if own_rows is None else []  # per stage: this rank's exact share of the last sum
            for s, arrival in enumerate(received):
                got, got_scales, partial_sums = self._node_partial_sums(s, *arrival(), own_rows, first_bits,
                                                                        slice_len, seed + 1 + s)
                if own_final is not None:
                    own_final.append(OwnRows(topo.node, partial_sums[topo.node:topo.node + 1]))
                # hop 2 (inter-node): row m of the partial sums goes to node m; stage s+1 is reduced meanwhile
                final.append(self._all_to_all(got, got_scales, topo.inter_node_group, "qgz_inter"))
            final_bits = self.inter_bits
        for s, arrival in enumerate(final):
            got, got_scales = arrival()
            self.payload.reduce(got, got_scales, final_bits, slice_len, result[s:s + 1], crossed_nodes=nodes > 1,
                                own=None if own_final is None else own_final[s])
        if not exact_fit:
            output_tensor.copy_(result.reshape(-1)[:shard_numel])
        if exact is not None:
            positions, reduced, work = exact
            work.wait()
            output_tensor[positions] = reduced
        return None

    def _reduce_vectors_exactly(self, chunks: torch.Tensor, group: dist.ProcessGroup):
        """Start the full-precision reduce-scatter of the 1-D parameters' slices and zero them in ``chunks``
        (zeros quantize exactly and leave the blocks' scales to the matrices). Returns (positions, output, work),
        or None when the option is off or the chunk layout is not the expected one."""
        if self.vector_slices is None:
            return None
        positions = self.vector_slices.positions(chunks.shape[1], self.topology.world_size, chunks.device)
        if positions is None:
            self.meter.note("qgz_1d_fallback",
                            f"{type(self.vector_slices.module).__name__}: the reduce-scatter chunk does not match the "
                            f"unit's parameters (one got no gradient), so its 1-D slices were quantized with the rest")
            return None
        if positions.numel() == 0:
            return None
        vectors = chunks[:, positions].contiguous()
        reduced = vectors.new_empty(positions.numel())
        work = self._plain_vectors(reduced, vectors.view(-1), group, dist.ReduceOp.SUM, async_op=True)
        chunks[:, positions] = 0
        return positions, reduced, work

    def _node_partial_sums(self, stage: int, got: torch.Tensor, got_scales: torch.Tensor,
                           own_rows: torch.Tensor | None, first_bits: int, slice_len: int, seed: int):
        """Between the hops: the node's partial sums for every node, requantized for the inter-node hop, as
        (codes, scales, unrotated fp32 partial sums or None). The fp32 sums are formed only where they are needed:
        with ``own_rows`` (this rank's exact first-hop rows, which with one rank per node are the partial sums
        themselves), whose row for this rank's node is kept; and for error feedback, which works on rotated sums.
        Otherwise the fused kernel runs."""
        topo = self.topology
        if topo.node_size == 1:
            return got[0], got_scales[0], None if own_rows is None else own_rows[stage]
        if self.feedback is not None and stage == 0:
            self.feedback.start_reduction()
        if own_rows is None:
            if self.feedback is None:
                return (*self.payload.reduce_requantize(got, got_scales, first_bits, self.inter_bits, slice_len,
                                                        seed), None)
            rotated = self.payload.sum_peers(got, got_scales, first_bits, slice_len, rotate_back=False)
            return (*self._compensated(stage, rotated, slice_len, seed), None)
        partial_sums = self.payload.sum_peers(got, got_scales, first_bits, slice_len, skip=topo.local_rank)
        partial_sums += own_rows[stage]
        if self.feedback is not None:
            # the residual lives in the rotated domain; requantize adds it in place
            rotated = hadamard_rows(partial_sums, self.hadamard) if self.hadamard else partial_sums.clone()
            sent = self._compensated(stage, rotated, slice_len, seed, exact_row=topo.node)
        else:
            sent = self.payload.requantize(partial_sums, self.inter_bits, seed)
        return *sent, partial_sums

    def _compensated(self, stage: int, rotated: torch.Tensor, slice_len: int, seed: int,
                     exact_row: int | None = None) -> kernels.Quantized:
        """The inter-node hop's quantization of rotated partial sums through the error feedback."""
        bits = self.inter_bits
        return self.feedback.requantize(stage, rotated, lambda rows: self.payload.quantize_inter(rows, bits, seed),
                                        lambda sent: self.payload.dequantize_inter(*sent, bits, slice_len), exact_row)

    def _own_rows(self, chunks: torch.Tensor, slice_len: int) -> torch.Tensor:
        """The rows this rank addresses to itself at the first hop, unrotated, as a strided view of ``chunks``:
        ``(stages, nodes, slice_len)``, row ``m`` of a stage being its contribution to node ``m``'s owner (chunk
        ``m * node_size + local_rank``; the order :func:`kernels.swizzle_source_slices` gives them)."""
        topo = self.topology
        mine = chunks.view(topo.nodes, topo.node_size, self.stages, slice_len)[:, topo.local_rank]
        return mine.transpose(0, 1)

    def _record_error(self, chunks: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor, bits: int,
                      slice_len: int, crossed_nodes: bool) -> None:
        """Error of this rank's first quantization (hop 1), measured against its reordered input rows."""
        topo = self.topology
        source = kernels.swizzle_source_slices(topo.nodes, topo.node_size, self.stages).to(chunks.device)
        rows = chunks.reshape(-1, slice_len)[source]
        restored = self.payload.restore(payload, scales, bits, slice_len, crossed_nodes)
        self.meter.record_error("qgz_intra" if topo.node_size > 1 else "qgz_inter", rows, restored)

    def _seed(self) -> int:
        """A fresh seed per call and rank, so stochastic rounding errors are independent across steps and ranks."""
        self.calls += 1
        return (self.seed * 1_000_003 + (self.calls - 1) * 7919 + self.topology.rank * 104_729) & 0xFFFFFFFF

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly as an uninterrupted one: the call count (the
        stochastic-rounding seeds derive from it; equal on every rank) and the error-feedback residuals (this rank's
        own: they belong to its partial sums)."""
        return {"calls": self.calls, "error_feedback": self.feedback.state_dict() if self.feedback else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave; a missing entry leaves that part as it is."""
        if state.get("calls") is not None:
            self.calls = int(state["calls"])
        if self.feedback is not None and state.get("error_feedback") is not None:
            self.feedback.load_state_dict(state["error_feedback"])

    def _all_to_all(self, payload: torch.Tensor, scales: torch.Tensor, group: dist.ProcessGroup, kind: str):
        """Start an all-to-all of equal row blocks; returns a function that waits for it and gives
        (payload (g, rows/g, ·), scales (g, rows/g, ·)). Payload and scales travel packed in one byte buffer: one
        collective instead of two, which matters at these latency-bound sizes."""
        peers = dist.get_world_size(group)
        packed = torch.cat((payload.view(torch.int8), scales.view(torch.int8)), dim=1)
        arrived = torch.empty_like(packed)
        work = dist.all_to_all_single(arrived, packed, group=group, async_op=True)
        self.meter.record(kind, group, nbytes(packed) // peers, self.describe(payload.device))
        rows = payload.shape[0] // peers
        width = payload.view(torch.int8).shape[1]

        def wait() -> tuple[torch.Tensor, torch.Tensor]:
            work.wait()
            got = arrived[:, :width].contiguous().view(payload.dtype).view(peers, rows, payload.shape[1])
            got_scales = arrived[:, width:].contiguous().view(scales.dtype).view(peers, rows, scales.shape[1])
            return got, got_scales

        return wait

    def describe(self, device: torch.device) -> str:
        topo = self.topology
        hops = "1-hop (single node)" if topo.nodes == 1 else "2-hop"
        precision = (f"int{self.intra_bits}/int{self.inter_bits}, block {self.block_size}"
                     if isinstance(self.payload, BlockQuantizedPayload) else "fp32 (quantization bypassed)")
        return (f"qgZ {hops} all-to-all {precision}, {self.stages} stage(s), {topo.nodes}x{topo.node_size}"
                + (f", Hadamard {self.hadamard}" if self.hadamard else "")
                + (self.payload.describe(device) if isinstance(self.payload, BlockQuantizedPayload) else "")
                + (f", inter-node {self.feedback.describe()}" if self.feedback is not None else "")
                + (", 1-D parameters in full precision" if self.vector_slices is not None else "")
                + (", own contributions in fp32" if self.full_precision_local else "")
                + (", stochastic rounding" if self.stochastic else "")
                + (f", kernels {kernels.active_backend(device, self.backend)}"
                   if isinstance(self.payload, BlockQuantizedPayload)
                   else ""))


def _as_one_peer(payload: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return payload.unsqueeze(0), scales.unsqueeze(0)


def make_reduce_scatter(config: ZeroPPConfig, topology: Topology, meter: CommMeter,
                        module: torch.nn.Module) -> QuantizedReduceScatter:
    """The qgZ reduce-scatter for the FSDP unit ``module``; with qgZ off it runs the plain metered reduce-scatter
    until a schedule switches it on."""
    return QuantizedReduceScatter(
        meter, topology,
        intra_bits=config.gradient_intra_bits or config.gradient_bits,
        inter_bits=config.gradient_bits,
        block_size=config.gradient_block_size or config.block_size,
        stages=config.qgz_pipeline_stages,
        stochastic=config.stochastic_rounding,
        seed=config.seed,
        enabled=config.quantized_gradients,
        hadamard=config.gradient_hadamard,
        error_feedback=config.gradient_error_feedback,
        error_feedback_decay=config.gradient_error_feedback_decay,
        error_feedback_reset=config.gradient_error_feedback_reset,
        allocate_bits=config.gradient_bit_allocation,
        width_floor=config.gradient_bit_allocation_floor,
        vector_slices=VectorSlices(module, trainable_only=True) if config.gradient_full_precision_1d else None,
        full_precision_local=config.gradient_full_precision_local,
        backend=config.kernel_backend,
    )
