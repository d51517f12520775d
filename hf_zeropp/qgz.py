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

The intra-node all-to-alls of all stages are issued asynchronously up front, and stage ``s``'s inter-node hop runs
while stage ``s + 1`` is reduced — the overlap Alg. 2 pipelines for. The result is the plain SUM that FSDP asked
for; FSDP then divides by the world size exactly once (``set_force_sum_reduction_for_comms``), so the gradient is
the true mean, never ``node_size`` times it. A single node runs one hop; shards that do not split evenly into
stages are zero-padded. What ran is recorded in ``comm_stats(...)["implementations"]``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from . import kernels
from .comm_meter import CommMeter, MeteredReduceScatter, _PlainAlloc, check_sum, nbytes
from .topology import Topology

if TYPE_CHECKING:
    from .sharding import ZeroPPState


class QuantizedReduceScatter(_PlainAlloc, ReduceScatter):
    def __init__(self, meter: CommMeter, topology: Topology, intra_bits: int, inter_bits: int, block_size: int,
                 stages: int, stochastic: bool, seed: int) -> None:
        self.meter = meter
        self.topology = topology
        self.intra_bits = intra_bits
        self.inter_bits = inter_bits
        self.block_size = block_size
        self.stages = stages
        self.stochastic = stochastic
        self.seed = seed
        self.enabled = True  # schedules switch qgZ off and on between steps
        self._calls = itertools.count()
        self._plain = MeteredReduceScatter(meter)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        check_sum(op)
        topo = self.topology
        if not self.enabled:
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
        if slice_len * stages != shard_numel:
            padded = chunks.new_zeros(topo.world_size, slice_len * stages)
            padded[:, :shard_numel] = chunks
            chunks = padded
        seed = self._seed()
        # one rank per node has no intra-node hop: quantize straight to the inter-node width
        first_bits = self.intra_bits if node_size > 1 else self.inter_bits
        codes, scales = kernels.swizzle_quantize(chunks.reshape(-1), nodes, node_size, stages, first_bits,
                                                 self.block_size, stochastic=self.stochastic, seed=seed)
        rows_per_stage = node_size * nodes
        codes = codes.view(stages, rows_per_stage, -1)
        scales = scales.view(stages, rows_per_stage, -1)

        # hop 1 (intra-node): every stage's all-to-all goes out now; the node's D contributions arrive stacked
        if node_size > 1:
            received = [self._all_to_all(codes[s], scales[s], topo.intra_node_group, "qgz_intra", first_bits)
                        for s in range(stages)]
        else:  # one rank per node: nothing to exchange inside the node
            received = [(None, codes[s].unsqueeze(0), scales[s].unsqueeze(0)) for s in range(stages)]

        result = output_tensor.new_empty(stages, slice_len) if slice_len * stages != shard_numel \
            else output_tensor.view(stages, slice_len)
        if nodes == 1:  # single node: one hop, reduce straight to full precision
            for s, (work, got_codes, got_scales) in enumerate(received):
                _wait(work)
                kernels.dequant_reduce(got_codes, got_scales, bits=first_bits, block_size=self.block_size,
                                       length=slice_len, dtype=output_tensor.dtype, out=result[s:s + 1])
        else:
            partials = []
            for s, (work, got_codes, got_scales) in enumerate(received):
                _wait(work)
                if node_size > 1:
                    got_codes, got_scales = kernels.dequant_reduce_quant(
                        got_codes, got_scales, in_bits=first_bits, out_bits=self.inter_bits,
                        block_size=self.block_size, length=slice_len, stochastic=self.stochastic,
                        seed=seed + 1 + s)
                else:
                    got_codes, got_scales = got_codes[0], got_scales[0]
                # hop 2 (inter-node): row m of the partial sums goes to node m
                partials.append(self._all_to_all(got_codes, got_scales, topo.inter_node_group, "qgz_inter",
                                                 self.inter_bits))
            for s, (work, got_codes, got_scales) in enumerate(partials):
                _wait(work)
                kernels.dequant_reduce(got_codes, got_scales, bits=self.inter_bits, block_size=self.block_size,
                                       length=slice_len, dtype=output_tensor.dtype, out=result[s:s + 1])
        if result.data_ptr() != output_tensor.data_ptr():
            output_tensor.copy_(result.reshape(-1)[:shard_numel])
        return None

    def _seed(self) -> int:
        """A fresh seed per call and rank, so stochastic rounding errors are independent across steps and ranks."""
        return (self.seed * 1_000_003 + next(self._calls) * 7919 + self.topology.rank * 104_729) & 0xFFFFFFFF

    def _all_to_all(self, codes: torch.Tensor, scales: torch.Tensor, group: dist.ProcessGroup, kind: str,
                    bits: int):
        """Asynchronous all-to-all of equal row blocks; returns (work, codes (g, rows/g, ·), scales (g, rows/g, ·))."""
        peers = dist.get_world_size(group)
        got_codes = torch.empty_like(codes)
        got_scales = torch.empty_like(scales)
        codes_work = dist.all_to_all_single(got_codes, codes, group=group, async_op=True)
        scales_work = dist.all_to_all_single(got_scales, scales, group=group, async_op=True)
        per_peer = (nbytes(codes) + nbytes(scales)) // peers
        self.meter.record(kind, group, per_peer, self.describe())
        return ((codes_work, scales_work), got_codes.view(peers, -1, codes.shape[-1]),
                got_scales.view(peers, -1, scales.shape[-1]))

    def describe(self) -> str:
        topo = self.topology
        hops = "1-hop (single node)" if topo.nodes == 1 else "2-hop"
        return (f"qgZ {hops} all-to-all int{self.intra_bits}/int{self.inter_bits}, block {self.block_size}, "
                f"{self.stages} stage(s), {topo.nodes}x{topo.node_size}"
                + (", stochastic rounding" if self.stochastic else ""))


def _wait(work) -> None:
    if work is not None:
        for w in work:
            w.wait()


def make_reduce_scatter(state: ZeroPPState) -> QuantizedReduceScatter | None:
    """The qgZ reduce-scatter for a unit, or None when qgZ is off."""
    config = state.config
    if not config.quantized_gradients:
        return None
    return QuantizedReduceScatter(
        state.meter, state.topology,
        intra_bits=config.gradient_intra_bits or config.gradient_bits,
        inter_bits=config.gradient_bits,
        block_size=config.gradient_block_size or config.block_size,
        stages=config.qgz_pipeline_stages,
        stochastic=config.stochastic_rounding,
        seed=config.seed,
    )
