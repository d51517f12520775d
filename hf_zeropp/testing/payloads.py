"""A qgZ payload without quantization, for tests: the same reorder and the same two hops as
:class:`hf_zeropp.comm.qgz.BlockQuantizedPayload`, with fp32 rows. Passed as ``QuantizedReduceScatter(...,
payload=...)`` it isolates placement and averaging from quantization error."""

from __future__ import annotations

import functools

import torch

from hf_zeropp import kernels


class FullPrecisionPayload:
    """``BlockQuantizedPayload``'s three steps on unquantized fp32 rows (empty scales)."""

    def swizzle(self, flat, nodes, node_size, stages, bits, seed):
        rows = flat.float().view(nodes * node_size * stages, -1)
        ordered = rows[kernels.swizzle_source_slices(nodes, node_size, stages).to(flat.device)]
        return ordered, ordered.new_empty(ordered.shape[0], 0)

    def reduce_requantize(self, payload, scales, in_bits, out_bits, length, seed):
        total = functools.reduce(torch.add, payload)  # row by row, in order, as the quantized payload sums
        return total, total.new_empty(total.shape[0], 0)

    def reduce(self, payload, scales, bits, length, out, crossed_nodes: bool, own=None) -> None:
        out.copy_(functools.reduce(torch.add, payload))  # every row is exact already: ``own`` is never given
