"""Where each rank sits: world, nodes, and the process groups ZeRO++ needs, built once per launch.

Ranks are numbered node by node (rank = node * node_size + local_rank), as torchrun and accelerate number them.
One 2-D device mesh ``(nodes, node_size)`` gives both the intra-node group (a row) and the inter-node group
(a column: the ranks with my local index on every node). hpZ's secondary-shard mesh ``(world / k, k)`` is the
same mesh when ``k == node_size``. FSDP2 would otherwise build a new mesh and two process groups for every
``fully_shard(reshard_after_forward=int)`` call (pytorch#153302); sharing them keeps a 100-block model at a
handful of groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .config import ResolvedConfig


@dataclass(frozen=True)
class Topology:
    world_size: int
    rank: int
    node_size: int
    device_type: str
    hpz_size: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def node(self) -> int:
        return self.rank // self.node_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.node_size

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.node_size

    @functools.cached_property
    def world_mesh(self) -> DeviceMesh:
        return _mesh(self.device_type, (self.world_size,), ("dp",))

    @functools.cached_property
    def node_mesh(self) -> DeviceMesh:
        return _mesh(self.device_type, (self.nodes, self.node_size), ("inter_node", "intra_node"))

    @property
    def intra_node_group(self) -> dist.ProcessGroup:
        return self.node_mesh.get_group("intra_node")

    @property
    def inter_node_group(self) -> dist.ProcessGroup:
        return self.node_mesh.get_group("inter_node")

    @functools.cached_property
    def hpz_mesh(self) -> DeviceMesh | None:
        """``(world / k, k)``: row = the k consecutive ranks that hold one secondary copy of the weights."""
        if self.hpz_size <= 1 or self.hpz_size == self.world_size:
            return None
        if self.hpz_size == self.node_size:
            return self.node_mesh
        return _mesh(self.device_type, (self.world_size // self.hpz_size, self.hpz_size), ("hpz_replica", "hpz"))

    @functools.cached_property
    def control_group(self) -> dist.ProcessGroup:
        """A gloo group of the whole world used only for ``monitored_barrier``: it tells which ranks did not join a
        collective (a save called on rank 0 alone) without mixing its messages with the training collectives."""
        return dist.new_group(backend="gloo", timeout=_world_timeout(self.device_type))

    def peers_on_my_node(self, group: dist.ProcessGroup) -> tuple[int, int]:
        """(peers on this node, peers on other nodes) of ``group``, this rank excluded."""
        return _peer_split(self.node_size, self.rank, tuple(dist.get_process_group_ranks(group)))


@functools.lru_cache(maxsize=None)
def _peer_split(node_size: int, rank: int, ranks: tuple[int, ...]) -> tuple[int, int]:
    same = sum(1 for r in ranks if r != rank and r // node_size == rank // node_size)
    return same, len(ranks) - 1 - same


def _world_timeout(device_type: str):
    """The default group's timeout, so that a hung peer fails collectives on every hf_zeropp group as soon as it
    fails them on the world group (a DeviceMesh's own groups would get torch's 30-minute default)."""
    backend = dist.group.WORLD._get_backend(torch.device(device_type))
    return getattr(getattr(backend, "options", None), "_timeout", None)


@functools.lru_cache(maxsize=None)
def _mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh whose 2-D groups carry the world's timeout; rank r sits at position r (row-major)."""
    grid = torch.arange(dist.get_world_size()).view(shape)
    if len(shape) == 1:
        return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh=grid, mesh_dim_names=names)
    timeout = _world_timeout(device_type)
    rank = dist.get_rank()
    mine = []
    for lines in (grid.t(), grid):  # dim 0 groups are the columns, dim 1 groups the rows
        for line in lines:  # every rank creates every group, in the same order
            group = dist.new_group(line.tolist(), timeout=timeout)
            if rank in line.tolist():
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=names)


_topologies: dict[tuple, Topology] = {}


def get_topology(resolved: ResolvedConfig, device_type: str) -> Topology:
    """The shared topology of this launch (one per node size, hpZ size and device type)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hf_zeropp needs torch.distributed initialised (launch with torchrun / accelerate launch, or call "
            "torch.distributed.init_process_group first)"
        )
    key = (resolved.world_size, resolved.node_size, resolved.hpz_size, device_type, id(dist.group.WORLD))
    if key not in _topologies:
        _topologies[key] = Topology(
            world_size=resolved.world_size,
            rank=dist.get_rank(),
            node_size=resolved.node_size,
            device_type=device_type,
            hpz_size=resolved.hpz_size,
        )
    return _topologies[key]
