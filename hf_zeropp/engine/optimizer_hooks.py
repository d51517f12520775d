"""Process-wide optimizer-step hooks that keep a sharded model's weights right, and the rebinding of an optimizer
built before sharding.

:func:`hf_zeropp.shard_model` replaces a model's parameters by their shards. An optimizer built on the old ones
would train nothing, and one no-grad forward between backward and step would leave gathered weights that survive
the step. The hooks here refuse the first and drop the second; :func:`rebind_optimizer` points an optimizer that
was built too early at the shards.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..comm.comm_meter import in_backward
from ..comm.hpz import reshard_all

# id(parameter before sharding) -> (weak reference to it, weak reference to the shard that replaced it, or None for
# a frozen weight now stored INT8): lets an optimizer built before sharding be pointed at the shards, and lets the
# optimizer-step guard below recognise one that was not.
_replaced: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}
# ids of replaced parameters that an optimizer was right to hold: auto sharded their model only at its first forward
# (hf_zeropp.engine.auto_trial), after the optimizer was built on them as documented. Pointed at the shards, not
# refused.
_rebound_at_step: set[int] = set()
# optimizers rebind_optimizer has seen (every one hf_zeropp.Accelerator.prepare was given): pointed at the shards as
# soon as a model is sharded late, so that a gradient scaler's unscale or a clip over their parameters before the step
# sees the shards
_prepared: weakref.WeakSet = weakref.WeakSet()


def remember_replaced_parameters(before: dict[str, nn.Parameter], after: dict[str, nn.Parameter]) -> None:
    for name, old in before.items():
        new = after.get(name)
        if new is old:
            continue
        key = id(old)

        def forget(_: weakref.ref, key: int = key) -> None:
            _replaced.pop(key, None)
            _rebound_at_step.discard(key)

        _replaced[key] = (weakref.ref(old, forget), weakref.ref(new) if new is not None else None)


def rebind_after_late_sharding(before: list[nn.Parameter]) -> None:
    """``before`` (a model's parameters) were just replaced by shards after optimizers may have been built on them
    (``zeropp: auto`` shards at the first forward): point every optimizer prepared by hf_zeropp at the shards now,
    and any other at its next step instead of refusing it."""
    _rebound_at_step.update(id(param) for param in before if id(param) in _replaced)
    for optimizer in list(_prepared):
        rebind_optimizer(optimizer)


def _replacement(param: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """(whether shard_model replaced ``param``, its replacement or None for a frozen weight stored INT8)."""
    entry = _replaced.get(id(param))
    if entry is None or entry[0]() is not param:
        return False, None
    return True, entry[1]() if entry[1] is not None else None


def rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer built on a model's parameters *before* :func:`shard_model` at the shards that replaced them,
    and drop the frozen weights now stored INT8 (they need no optimizer slot, and holding them would keep the full
    weights alive). Raises if the optimizer has already stepped: its state cannot be re-sharded."""
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            replaced, new = _replacement(param)
            if not replaced:
                params.append(param)
                continue
            if optimizer.state.get(param):
                raise ValueError("the optimizer has already taken a step on the unsharded model: its state cannot be "
                                 "re-sharded; build or prepare the optimizer before its first step")
            if new is not None:
                params.append(new)
        group["params"] = params
    _prepared.add(optimizer)


_hooks_installed = False


def install_optimizer_hooks() -> None:
    """Two process-wide optimizer-step hooks, for the rules that keep a sharded model's weights right:

    * before a step, fail if the optimizer holds parameters shard_model replaced: they receive no gradients any
      more, so the step would silently train nothing (DDP keeps the parameters; FSDP2 and hf_zeropp do not);
    * after a step, drop the gathered weights and hpZ secondary shards of every model it updated. Normally there
      are none (backward reshards), but a no-grad forward between backward and step (an evaluation, generate(),
      a reward) leaves them, and the next forward would compute with the pre-step weights. Cost: nothing in the
      usual order; after such a forward, the next forward gathers again, as it must.
    """
    global _hooks_installed
    if _hooks_installed:
        return

    def refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not _replaced:
            return
        if any(id(param) in _rebound_at_step for group in optimizer.param_groups for param in group["params"]):
            rebind_optimizer(optimizer)
        for group in optimizer.param_groups:
            for param in group["params"]:
                replaced, new = _replacement(param)
                if replaced and new is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds parameters from before hf_zeropp sharded the model; they "
                        f"no longer receive gradients, so this step would train nothing. Build the optimizer after "
                        f"shard_model on model.parameters(), or pass it to accelerator.prepare (together with the "
                        f"model or in a later call), which points it at the shards"
                    )

    def drop_stale_copies(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if in_backward():  # an optimizer stepping inside backward: FSDP still needs its gathered weights
            return
        models = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                model = getattr(param, "_zeropp_model", lambda: None)()
                if model is not None:
                    models[id(model)] = model
        for model in models.values():
            reshard_all(model)

    register_optimizer_step_pre_hook(refuse_replaced_parameters)
    register_optimizer_step_post_hook(drop_stale_copies)
    _hooks_installed = True


def watch_parameters(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """After sharding ``model`` (whose parameters were ``before``): remember what replaced what, install the hooks, and
    tag every parameter with its model so that a step can find the model whose gathered copies it makes stale."""
    remember_replaced_parameters(before, dict(model.named_parameters()))
    install_optimizer_hooks()
    for param in model.parameters():
        param._zeropp_model = weakref.ref(model)


__all__ = ["install_optimizer_hooks", "rebind_after_late_sharding", "rebind_optimizer", "remember_replaced_parameters",
           "watch_parameters"]
