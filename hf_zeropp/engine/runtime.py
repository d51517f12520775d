"""What a script calls on a sharded model while it trains: communication statistics, switching techniques, gradient
accumulation without synchronisation, gradient clipping over shards, and the bytes a rank holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._compat import fsdp_param_groups, group_gathered_bytes, group_parameters
from .auto_trial import current_meter, is_pending
from .frozen import frozen_weight_bytes, held_weight_bytes
from ..comm.hpz import set_hpz
from .state import fsdp_modules, weight_delta_gathers, zeropp_state


def comm_stats(model: nn.Module, reset: bool = False) -> dict[str, Any]:
    """Bytes this rank sent since the last reset, per collective kind, split into intra_node and inter_node.

    See :mod:`hf_zeropp.comm.comm_meter` for the accounting rule. ``implementations`` lists, per kind, every distinct
    way it ran in this window (e.g. the 2-hop quantized all-to-all for the gradient reduce-scatter, with the kernel
    backend that ran), plus, per requested technique this launch cannot apply, why.
    """
    return current_meter(model).stats(reset=reset)


def set_techniques(model: nn.Module, *, quantized_weights: bool | None = None, hpz: bool | None = None,
                   quantized_gradients: bool | None = None) -> dict[str, bool]:
    """Switch qwZ, hpZ and qgZ on or off between optimizer steps without re-wrapping the model (e.g. the ZeRO++
    paper's "qgZ for the first 50 % of training"). None leaves a technique as it is; returns what is on now.

    qwZ and qgZ can be switched on even if the model was sharded without them (stages 1-3); hpZ only if it was
    configured (``hpz_partition_size > 1``), since its process groups are built at sharding time.
    """
    state = zeropp_state(model)
    if state.config.stage == 0 and (quantized_weights or hpz or quantized_gradients):
        raise ValueError("stage 0 (plain data parallel) has no sharded collectives to quantize; use stage 3")
    if quantized_weights is not None:
        for comm in state.all_gathers:
            comm.enabled = quantized_weights
    if quantized_gradients is not None:
        for comm in state.reduce_scatters:
            comm.enabled = quantized_gradients
    if hpz is not None and hpz != state.hpz_enabled:
        set_hpz(model, state.topology, hpz)
        state.hpz_enabled = hpz
    return active_techniques(model)


def active_techniques(model: nn.Module) -> dict[str, bool]:
    """What is in effect now: a technique switched on that this launch cannot apply (qwZ with every rank on one
    node, where no gather crosses nodes) is reported off."""
    state = zeropp_state(model)
    return {
        "quantized_weights": any(c.enabled and c.applies() for c in state.all_gathers),
        "hpz": state.hpz_enabled,
        "quantized_gradients": any(c.enabled for c in state.reduce_scatters),
    }


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Micro-batches inside this context accumulate gradients for a later synchronising backward.

    Stage 0 skips the all-reduce and stage 1 the reduce-scatter (and keeps weights gathered); stages 2 and 3
    reduce-scatter every micro-batch as ZeRO-2/3 do, so their gradients stay sharded. A model awaiting auto's
    trial is left as it is: every candidate is stage 3.
    """
    stage = 3 if is_pending(model) else zeropp_state(model).config.stage
    if stage not in (0, 1):
        yield
        return
    root = model
    root.set_requires_gradient_sync(False)
    if stage == 1:
        root.set_reshard_after_backward(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
        if stage == 1:
            root.set_reshard_after_backward(True)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models: the norm of the full gradients (each rank's shards'
    norms combined over the ranks, per device mesh), returned as a plain tensor equal on every rank (collective)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    for mesh, group in by_mesh.items():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, DTensor.from_local(total, mesh) if mesh is not None else total)
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds at rest: parameter shards (INT8-stored frozen weights included), gradients and optimizer
    state. Gathered weights held beyond the shards are :func:`gathered_parameter_bytes`."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def size(t: torch.Tensor) -> int:
        return local(t).numel() * local(t).element_size()

    # FSDP's world-sharded parameters: between a forward and its backward (or after a no-grad forward) a unit's
    # registered parameters are its gathered or hpZ-sharded ones instead; plus those FSDP2 left whole on every rank
    fsdp_params = [param for module in fsdp_modules(model) for group in fsdp_param_groups(module)
                   for param, _ in group_parameters(group)]
    replicated = zeropp_state(model).replicated.parameters(model) if hasattr(model, "_zeropp") else []
    shards = [*fsdp_params, *replicated] if fsdp_params or replicated else list(model.parameters())
    result = {
        "parameters": sum(size(t) for t in shards) + frozen_weight_bytes(model),
        "gradients": sum(size(t.grad) for t in shards if t.grad is not None),
        "optimizer_state": 0,
    }
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    result["optimizer_state"] += size(value)
    return result


def gathered_parameter_bytes(model: nn.Module) -> int:
    """Bytes of gathered weights this rank holds right now beyond its shards: full unsharded parameters of units
    that are not resharded, hpZ's post-forward (secondary) slices, the copies ``weight_deltas`` keeps between steps,
    and frozen INT8 weights held dequantized by :func:`hf_zeropp.gathered_for_inference`."""
    fsdp = sum(group_gathered_bytes(group) for module in fsdp_modules(model) for group in fsdp_param_groups(module))
    copies = sum(comm.kept_bytes() for comm in weight_delta_gathers(model))
    return fsdp + copies + held_weight_bytes(model)


__all__ = ["active_techniques", "clip_grad_norm_", "comm_stats", "gathered_parameter_bytes", "no_sync",
           "set_techniques", "state_bytes"]
