"""Where each rank sits: world, nodes, hpZ group size, and the process groups ZeRO++ needs, built once per launch.

:meth:`Topology.from_config` checks a :class:`~hf_zeropp.config.config.ZeroPPConfig` against a launch (world size, ranks
per node) and fills in the node size (recording where it came from) and the hpZ group size; it needs no process
group, so ``python -m hf_zeropp env`` shows the topology of a launch before it happens. :func:`get_topology` builds
it for the live process group, once per launch; the meshes and groups are built lazily, on first use.

Ranks are numbered node by node (rank = node * node_size + local_rank), as torchrun and accelerate number them.
One 2-D device mesh ``(nodes, node_size)`` gives both the intra-node group (a row) and the inter-node group
(a column: the ranks with my local index on every node). hpZ's secondary-shard mesh ``(world / k, k)`` is the
same mesh when ``k == node_size``. FSDP2 would otherwise build a new mesh and two process groups for every
``fully_shard(reshard_after_forward=int)`` call (pytorch#153302); sharing them keeps a 100-block model at a
handful of groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._compat import process_group_timeout
from ..config.config import ZeroPPConfig
from .node_size import detect_node_size


class _built_once:
    """``functools.cached_property`` without its lock: before Python 3.12 one lock serves every instance, so a rank
    building a group (a collective) while holding it would block the other ranks of a process that runs ranks as
    threads (:mod:`hf_zeropp.testing.threaded_ranks`) before they could join that collective."""

    def __init__(self, build: Callable[[Any], Any]):
        self.build, self.__doc__ = build, build.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, topology: Any, owner: type | None = None) -> Any:
        if topology is None:
            return self
        if self.name not in topology.__dict__:
            topology.__dict__[self.name] = self.build(topology)
        return topology.__dict__[self.name]


@dataclass(frozen=True)
class Topology:
    """A launch: ``world_size`` ranks in nodes of ``node_size`` (found from ``node_size_source``), this ``rank``,
    hpZ groups of ``hpz_size`` ranks (1 = off), collectives on ``device_type``."""

    world_size: int
    rank: int
    node_size: int
    device_type: str
    hpz_size: int
    node_size_source: str = "given"

    @classmethod
    def from_config(cls, config: ZeroPPConfig, world_size: int, *, rank: int = 0, device_type: str = "cpu",
                    local_world_size: int | None = None) -> Topology:
        """Check ``config`` against a launch of ``world_size`` ranks and fill in the node and hpZ sizes.

        The node size is, in order: ``node_size`` of the config (``ZEROPP_NODE_SIZE``), ``local_world_size`` if
        given, the launcher's variables (``LOCAL_WORLD_SIZE``, SLURM, Open MPI, MPICH, MVAPICH), or the ranks' host
        names (a collective, only when a process group is initialised; see :mod:`hf_zeropp.comm.node_size`). Builds no
        process group: the meshes and groups are built on first use."""
        if config.node_size is not None:
            node_size, source = config.node_size, "node_size in the hf_zeropp config"
        elif local_world_size is not None:
            node_size, source = local_world_size, "given"
        else:
            node_size, source = detect_node_size(world_size)
        if node_size > world_size or world_size % node_size:
            raise ValueError(
                f"node_size={node_size} does not divide the world size {world_size} (node size from {source}); set "
                f"node_size to the number of ranks per node (a divisor of {world_size})"
            )
        hpz = node_size if config.hpz_partition_size == "node" else int(config.hpz_partition_size)
        if hpz > world_size or world_size % hpz:
            raise ValueError(
                f"hpz_partition_size={hpz} must divide the world size {world_size}; use the number of ranks per "
                f"node ({node_size}) or a divisor of it"
            )
        if hpz > 1 and node_size % hpz:
            raise ValueError(
                f"hpz_partition_size={hpz} does not fit in a node of {node_size} ranks: its backward all-gather "
                f"would cross nodes; use {node_size} ('node') or a divisor of it"
            )
        return cls(world_size=world_size, rank=rank, node_size=node_size, device_type=device_type, hpz_size=hpz,
                   node_size_source=source)

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

    @_built_once
    def world_mesh(self) -> DeviceMesh:
        return _mesh(self.device_type, (self.world_size,), ("dp",))

    @_built_once
    def replicated_mesh(self) -> DeviceMesh:
        """``(world, 1)``: FSDP2 on it replicates the weights and all-reduces the gradients (stage 0)."""
        return _mesh(self.device_type, (self.world_size, 1), ("replicate", "shard"))

    @_built_once
    def node_mesh(self) -> DeviceMesh:
        return _mesh(self.device_type, (self.nodes, self.node_size), ("inter_node", "intra_node"))

    @property
    def node_shard_mesh(self) -> DeviceMesh:
        """The ranks of my node as a 1-D mesh: FSDP2 on it shards within the node and replicates across nodes, and
        leaves the cross-node gradient all-reduce to a hook (hybrid sharding with a quantized all-reduce)."""
        return self.node_mesh["intra_node"]

    @property
    def intra_node_group(self) -> dist.ProcessGroup:
        return self.node_mesh.get_group("intra_node")

    @property
    def inter_node_group(self) -> dist.ProcessGroup:
        return self.node_mesh.get_group("inter_node")

    @_built_once
    def hpz_mesh(self) -> DeviceMesh | None:
        """``(world / k, k)``: row = the k consecutive ranks that hold one secondary copy of the weights."""
        if self.hpz_size <= 1 or self.hpz_size == self.world_size:
            return None
        if self.hpz_size == self.node_size:
            return self.node_mesh
        return _mesh(self.device_type, (self.world_size // self.hpz_size, self.hpz_size), ("hpz_replica", "hpz"))

    @_built_once
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
    return process_group_timeout(dist.group.WORLD, device_type)


def _mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh whose 2-D groups carry the world's timeout; rank r sits at position r (row-major). One per
    world group: a process that starts a new world (or holds several, as threaded ranks do) gets new groups."""
    return _mesh_of_world(dist.group.WORLD, device_type, shape, names)


@functools.lru_cache(maxsize=None)
def _mesh_of_world(world: dist.ProcessGroup, device_type: str, shape: tuple[int, ...], names: tuple[str, ...]
                   ) -> DeviceMesh:
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


def get_topology(config: ZeroPPConfig, device_type: str) -> Topology:
    """The shared topology of this launch for ``config`` (one per node size, hpZ size, node-size source and device
    type): :meth:`Topology.from_config` for the live process group. Every check runs before any group is built."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "hf_zeropp needs torch.distributed initialised (launch with torchrun / accelerate launch, or call "
            "torch.distributed.init_process_group first)"
        )
    topology = Topology.from_config(config, dist.get_world_size(), rank=dist.get_rank(), device_type=device_type)
    key = (topology.world_size, topology.node_size, topology.hpz_size, topology.node_size_source, device_type,
           id(dist.group.WORLD))
    return _topologies.setdefault(key, topology)
