"""hpZ: a node-local secondary copy of the weights, so the backward all-gather never leaves the node.

FSDP2 realises it natively: ``fully_shard(reshard_after_forward=k)`` keeps, after forward, a 1/k slice of each
gathered parameter instead of freeing it, and the backward all-gather then runs over the k consecutive ranks
that share those slices — one node when ranks are numbered node by node and ``k = node_size``. Optimizer state
and gradients stay sharded over the whole world (the reduce-scatter always uses the full group). Cost: each rank
holds 1/k of the unsharded weights in the compute dtype between forward and backward (ZeRO++ Fig. 4).

FSDP2 builds a new device mesh, hence new process groups, for every ``fully_shard`` call with an integer
reshard (pytorch#153302); :func:`shared_hpz_mesh` hands every call the topology's one hpZ mesh instead.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .._compat import (
    drop_pending_gather,
    fsdp_param_groups,
    group_is_sharded,
    group_reshards_after_forward,
    hsdp_mesh_info,
    post_forward_mesh_info_override,
    set_post_forward_mesh_info,
)
from .topology import Topology


def _mesh_info(topology: Topology) -> Any:
    """FSDP2's description of the topology's hpZ mesh, one per world group as the mesh itself (equal topologies
    of two worlds, as after a restart of the process group or in ranks that are threads, get their own)."""
    return _mesh_info_of_world(dist.group.WORLD, topology)


@functools.lru_cache(maxsize=None)
def _mesh_info_of_world(world: dist.ProcessGroup, topology: Topology) -> Any:
    return hsdp_mesh_info(topology.hpz_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


@contextlib.contextmanager
def shared_hpz_mesh(topology: Topology) -> Iterator[None]:
    """Make FSDP2 use the topology's one hpZ mesh instead of building a new one per fully_shard call."""
    hpz_mesh = topology.hpz_mesh
    if hpz_mesh is None:
        yield
        return
    shared = _mesh_info(topology)

    def post_forward_mesh_info(reshard_after_forward, mesh_info):
        if type(reshard_after_forward) is int and reshard_after_forward == topology.hpz_size:
            return shared
        return None  # FSDP's own

    with post_forward_mesh_info_override(post_forward_mesh_info):
        yield


def reshard_all(model: nn.Module) -> None:
    """Drop every gathered weight and hpZ secondary shard, back to the world-sharded parameters.

    Always safe outside a backward pass; needed before weights change other than through the optimizer (loading
    a checkpoint), or a secondary shard left by an evaluation forward would serve stale weights (DeepSpeed #7606).
    A prefetched gather not consumed yet is dropped too, for the same reason.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module):
                drop_pending_gather(group)
            module.reshard()


def set_hpz(model: nn.Module, topology: Topology, enabled: bool) -> None:
    """Switch hpZ on (secondary shard over the hpZ group) or off (plain ZeRO-3 resharding) between steps."""
    if topology.hpz_mesh is None:
        raise ValueError(
            "hpZ was not configured for this model; shard it with hpz_partition_size > 1 to switch hpZ on and off"
        )
    reshard_all(model)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            if not group_reshards_after_forward(group):
                continue  # a unit that keeps its weights gathered after forward (stage 1/2): nothing to reshard
            if not group_is_sharded(group):
                raise RuntimeError("switch hpZ between optimizer steps, not during a backward pass")
            set_post_forward_mesh_info(group, _mesh_info(topology) if enabled else None)  # None: the group's own

