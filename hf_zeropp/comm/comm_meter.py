"""Byte accounting for every collective hf_zeropp runs, and the plain (unquantized) FSDP2 comms that use it.

Accounting rule — the same for the baseline and for ZeRO++, so ratios between them are meaningful: a collective
is counted as the *logical* bytes this rank must deliver to each other rank of the group, whatever algorithm the
backend uses underneath:

* all-gather: this rank's shard to every peer → ``(g - 1) / g`` of the gathered buffer;
* reduce-scatter: peer ``j``'s chunk to peer ``j`` → ``(g - 1) / g`` of the input buffer;
* all-to-all: peer ``j``'s piece to peer ``j`` (own piece excluded);
* all-reduce: counted as reduce-scatter + all-gather → ``2 (g - 1) / g`` of the buffer.

Each count is split into ``intra_node`` (the peer is on this rank's node) and ``inter_node``. Quantized payloads
count their codes and scales.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._compat import ReduceScatter, in_backward
from .topology import Topology


class CommMeter:
    """Per-rank byte counters by collective kind and by intra/inter node."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._bytes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._errors: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        self._implementations: dict[str, list[str]] = collections.defaultdict(list)
        # requested techniques this launch cannot apply, and why: shown in every window, never reset
        self.conditions: dict[str, str] = {}
        self.track_errors = False  # quantized comms also measure their own error (costs one extra dequantize)
        self.resets = 0  # 0: the counts cover everything since the model was sharded

    def record(self, kind: str, group: dist.ProcessGroup, bytes_per_peer: int, implementation: str) -> None:
        """``bytes_per_peer`` go from this rank to every other rank of ``group``."""
        intra_peers, inter_peers = self.topology.peers_on_my_node(group)
        counter = self._bytes[kind]
        counter["intra_node"] += intra_peers * bytes_per_peer
        counter["inter_node"] += inter_peers * bytes_per_peer
        counter["calls"] += 1
        self.note(kind, implementation)

    def note(self, kind: str, implementation: str) -> None:
        """Record that ``kind`` ran as ``implementation`` in this window (each distinct one once, in order)."""
        seen = self._implementations[kind]
        if implementation not in seen:
            seen.append(implementation)

    def record_allreduce(self, group: dist.ProcessGroup, buffer_bytes: int, implementation: str,
                         kind: str = "grad_allreduce") -> None:
        """An all-reduce of ``buffer_bytes``: reduce-scatter plus all-gather, ``2 / g`` of the buffer per peer."""
        group_size = dist.get_world_size(group)
        intra_peers, inter_peers = self.topology.peers_on_my_node(group)
        counter = self._bytes[kind]
        counter["intra_node"] += 2 * buffer_bytes * intra_peers // group_size
        counter["inter_node"] += 2 * buffer_bytes * inter_peers // group_size
        counter["calls"] += 1
        self.note(kind, implementation)

    def record_error(self, kind: str, original: torch.Tensor, restored: torch.Tensor) -> None:
        """Accumulate the squared error of a quantize/dequantize round trip of this rank's own data."""
        original = original.float()
        totals = self._errors[kind]
        totals[0] += float((restored.float() - original).pow(2).sum())
        totals[1] += float(original.pow(2).sum())

    def stats(self, reset: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = {
            kind: {"intra_node": c["intra_node"], "inter_node": c["inter_node"], "calls": c["calls"]}
            for kind, c in self._bytes.items()
        }
        result["total"] = {
            "intra_node": sum(c["intra_node"] for c in self._bytes.values()),
            "inter_node": sum(c["inter_node"] for c in self._bytes.values()),
        }
        result["implementations"] = {**{kind: list(seen) for kind, seen in self._implementations.items()},
                                     **{technique: [why] for technique, why in self.conditions.items()}}
        if self._errors:
            # relative L2 error ||x - deq(q(x))|| / ||x|| of what this rank quantized, per collective kind
            result["quantization_error"] = {kind: (err / ref) ** 0.5 if ref > 0 else 0.0
                                            for kind, (err, ref) in self._errors.items()}
        if reset:
            self.resets += 1
            self._bytes.clear()
            self._errors.clear()
            self._implementations.clear()
        return result


def allgather_kind() -> str:
    return "bwd_allgather" if in_backward() else "fwd_allgather"


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _PlainAlloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class MeteredReduceScatter(_PlainAlloc, ReduceScatter):
    """FSDP2's reduce-scatter as a SUM (FSDP divides by the world size afterwards), with its bytes counted under
    ``kind``."""

    def __init__(self, meter: CommMeter, kind: str = "grad_reduce_scatter") -> None:
        self.meter = meter
        self.kind = kind

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        check_sum(op)
        self.meter.record(self.kind, group, nbytes(output_tensor), f"reduce_scatter {input_tensor.dtype}")
        peers_on_my_node, _ = self.meter.topology.peers_on_my_node(group)
        return reduce_scatter_single(output_tensor, input_tensor, group=group, op=dist.ReduceOp.SUM, async_op=async_op,
                                     ranks_per_node=peers_on_my_node + 1)


def check_sum(op: Any) -> None:
    if op != dist.ReduceOp.SUM:
        raise RuntimeError(
            f"hf_zeropp's reduce-scatter expects FSDP to request SUM (set_force_sum_reduction_for_comms) but got "
            f"{op}; this is a bug in hf_zeropp's FSDP setup"
        )


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """torch >= 2.13 renamed all_gather_into_tensor; call whichever this torch has."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: Any,
                          async_op: bool = False, ranks_per_node: int = 1):
    """A reduce-scatter that puts no more bytes between nodes than the cheaper of gloo's two ways on every backend.

    gloo runs ``reduce_scatter_tensor`` as a full ring all-reduce, and a SUM can also run as an all-to-all of the
    chunks followed by a local sum in rank order; which sends fewer cross-node bytes depends on the topology
    (:func:`gloo_reduce_scatter_as_all_to_all`). ``ranks_per_node``: how many of ``group``'s ranks share a node
    (1, the default, treats every peer as remote). NCCL's native one is always kept."""
    if (op == dist.ReduceOp.SUM and dist.get_backend(group) == dist.Backend.GLOO
            and gloo_reduce_scatter_as_all_to_all(dist.get_world_size(group), ranks_per_node)):
        return _reduce_scatter_as_all_to_all(output, input, group, async_op)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def gloo_reduce_scatter_as_all_to_all(group_size: int, ranks_per_node: int) -> bool:
    """Whether an all-to-all plus local sum crosses nodes with fewer bytes than gloo's ring all-reduce.

    With ranks in node order, each node's one ring edge to the next node carries ``2 (g-1) / g`` of the buffer; an
    all-to-all sends ``d (g-d) / g`` from a node holding ``d`` of the ``g`` ranks — the logical bytes. So the
    all-to-all wins at 2 nodes x 2 (1.0 vs 1.5 of the logical bytes, measured on the veth counters) and 4 x 2, the
    ring at 2 x 4 (0.875) and with more ranks per node. On a tie the all-to-all is kept: it sends half the ring's
    bytes inside the node, and on hybrid's node group of 4 ranks it took 12-32 ms less CPU per step and rank than
    gloo's own, measured side by side with the choice switched by hand (``scripts/benchmarks/step_cpu.py``: 2 x 4
    ranks on 2 cores)."""
    return 2 * (group_size - 1) >= ranks_per_node * (group_size - ranks_per_node)


def _reduce_scatter_as_all_to_all(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                                  async_op: bool) -> dist.Work | None:
    peers = dist.get_world_size(group)
    chunks = input.contiguous().view(peers, -1)
    arrived = torch.empty_like(chunks)
    # as bytes: gloo's all-to-all moves any dtype that way, bf16 included
    work = dist.all_to_all_single(arrived.view(torch.uint8), chunks.view(torch.uint8), group=group, async_op=True)

    def sum_arrivals() -> None:
        total = arrived[0].float()
        for part in arrived[1:]:
            total += part.float()
        output.copy_(total.view(output.shape))

    return finish_after(work, sum_arrivals, async_op)


class DeferredWork(dist.Work):
    """A started collective whose result needs one more local step (dequantize, sum) once it arrives; FSDP and the
    callers hold it like any ``dist.Work`` and the step runs at the first ``wait``."""

    def __init__(self, work: dist.Work, finish: Callable[[], None]) -> None:
        super().__init__()
        self._work = work
        self._finish = finish

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            self._work.wait()
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def finish_after(work: dist.Work, finish: Callable[[], None], async_op: bool) -> dist.Work | None:
    """``work`` with ``finish`` run after it: now (``async_op=False``, returns None) or at the first wait."""
    deferred = DeferredWork(work, finish)
    if async_op:
        return deferred
    deferred.wait()
    return None
