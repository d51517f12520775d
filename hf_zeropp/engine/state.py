"""What :func:`hf_zeropp.shard_model` attaches to a model (``model._zeropp``), and how the rest of the package finds
it and the model's FSDP units."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..comm.comm_meter import CommMeter
from ..comm.hpz import reshard_all
from ..comm.weight_deltas import DeltaAllGather
from ..config.config import ZeroPPConfig
from ..comm.topology import Topology


@dataclass
class ZeroPPState:
    """What shard_model attaches to the model (``model._zeropp``)."""

    config: ZeroPPConfig
    topology: Topology
    meter: CommMeter
    units: list[nn.Module]
    all_gathers: list = field(default_factory=list)
    reduce_scatters: list = field(default_factory=list)
    cross_node_all_reduce: Any = None  # hybrid-q's quantized all-reduce (hybrid.QuantizedCrossNodeAllReduce)
    hpz_enabled: bool = False
    replicated: Any = None  # the parameters FSDP2 cannot shard (replicated.ReplicatedParameters)
    inference_depth: int = 0  # open gathered_for_inference blocks


_sharded_models: weakref.WeakSet = weakref.WeakSet()  # every model shard_model returned that is still alive


def attach(model: nn.Module, state: ZeroPPState) -> None:
    model._zeropp = state
    _sharded_models.add(model)


def sharded_models() -> list[nn.Module]:
    """The models of this process that :func:`hf_zeropp.shard_model` sharded and that are still alive."""
    return list(_sharded_models)


def zeropp_state(model: nn.Module) -> ZeroPPState:
    state = getattr(model, "_zeropp", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not sharded by hf_zeropp.shard_model")
    return state


def weight_delta_gathers(model: nn.Module) -> list[DeltaAllGather]:
    """The all-gathers of ``model`` that keep ``weight_deltas`` copies (none where shard_model did not shard it)."""
    state = getattr(model, "_zeropp", None)
    return [comm for comm in (state.all_gathers if state is not None else ()) if isinstance(comm, DeltaAllGather)]


def replacing_weights(model: nn.Module) -> None:
    """The model's weights are about to be replaced from outside the optimizer (a load; collective, every rank): drop
    every gathered copy, FSDP2's and hpZ's and those ``weight_deltas`` keeps, so the next forward gathers the new
    weights whole, not as a difference."""
    reshard_all(model)
    for comm in weight_delta_gathers(model):
        comm.forget()


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


__all__ = ["ZeroPPState", "attach", "fsdp_modules", "replacing_weights", "sharded_models",
           "weight_delta_gathers", "zeropp_state"]
