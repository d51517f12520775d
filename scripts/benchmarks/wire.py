"""The gloo wire rule and the veth byte counters: how many bytes a node's link carries per logical (meter) byte.

``hf_zeropp.comm_stats`` counts LOGICAL bytes (what each rank must deliver to each peer, algorithm-independent);
gloo's algorithms put a fixed multiple of that on the wire between nodes (:func:`wire_factors`). The counters are
read from ``/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics`` on each node's first rank; TCP payload = bytes - 66 B x
packets (Ethernet + IPv4 + TCP-with-timestamps headers; a pure ACK counts 0).
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_zeropp.comm.comm_meter import gloo_reduce_scatter_as_all_to_all

KINDS = ("fwd_allgather", "bwd_allgather", "grad_reduce_scatter", "grad_allreduce", "qgz_intra", "qgz_inter",
         "qgz_1d_full_precision", "torch_reduce_scatter", "hybrid_allreduce", "hybrid_reduce_scatter",
         "hybrid_all_gather", "hybrid_1d_full_precision", "hybrid_row_mask", "replicated_grad_allreduce",
         "unused_parameter_flags")
HEADER_BYTES = 66


def wire_factors(world: int, node_size: int) -> dict[str, float]:
    """Inter-node wire bytes per logical inter-node byte, per meter kind, for gloo with ranks in node order."""
    g, d = world, node_size
    if g == d:
        return {kind: 0.0 for kind in KINDS}
    ring = (g - 1) / (d * (g - d))
    plain_reduce_scatter = 1.0 if gloo_reduce_scatter_as_all_to_all(g, d) else 2 * ring
    return {
        "fwd_allgather": ring,              # world-group ring all-gather (qwZ: codes and scales alike)
        "bwd_allgather": ring,              # world group without hpZ; with hpZ the meter's inter bytes are 0
        "grad_reduce_scatter": plain_reduce_scatter,  # hf_zeropp's on gloo: all-to-all + local sum, or the ring
        "grad_allreduce": ring,             # meter counts 2 M (g-1)/g per rank, the ring sends 2 M (g-1)/g per node
        "replicated_grad_allreduce": ring,  # the same all-reduce over the world group, for parameters kept whole
        "unused_parameter_flags": ring,     # one int32 per parameter, all-reduced over the world group
        "qgz_intra": 1.0,                   # node-local (inter bytes are 0)
        "qgz_inter": 1.0,                   # pairwise all-to-all among one rank per node
        "qgz_1d_full_precision": plain_reduce_scatter,  # qgZ's plain reduce-scatter of 1-D parameters
        "torch_reduce_scatter": 2 * ring,   # torch's gloo reduce-scatter (the stock peer) = ring all-reduce
        # hybrid sharding: collectives among one rank per node, every peer on another node (ring or pairwise)
        "hybrid_allreduce": 1.0,
        "hybrid_reduce_scatter": 1.0,
        "hybrid_all_gather": 1.0,
        "hybrid_1d_full_precision": 1.0,
        "hybrid_row_mask": 1.0,
    }


def expected_node_wire(per_rank_stats: list[dict], world: int, node_size: int) -> list[float]:
    """Wire bytes each node's link should carry for these per-rank meter stats (meter inter-node bytes x factor)."""
    factors = wire_factors(world, node_size)
    out = [0.0] * (world // node_size)
    for rank, stats in enumerate(per_rank_stats):
        for kind in KINDS:
            out[rank // node_size] += stats.get(kind, {}).get("inter_node", 0) * factors[kind]
    return out


def read_counters() -> dict[str, int] | None:
    """This node's veth counters, on the node's first rank inside the emulated cluster (else None)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    base = Path("/sys/class/net") / ifname / "statistics"
    if not base.exists():
        return None
    return {name: int((base / name).read_text()) for name in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")}


def counter_delta(before, after) -> dict[str, int] | None:
    """after - before, plus the TCP payload bytes each way."""
    if before is None or after is None:
        return None
    out = {k: after[k] - before[k] for k in before}
    out["tx_payload_bytes"] = out["tx_bytes"] - HEADER_BYTES * out["tx_packets"]
    out["rx_payload_bytes"] = out["rx_bytes"] - HEADER_BYTES * out["rx_packets"]
    return out

