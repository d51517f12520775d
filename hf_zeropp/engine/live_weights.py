"""Stage 3's memory knobs in FSDP2 terms: which units keep their gathered weights from forward to backward, which
parameters are never sharded, and how far ahead gathers start (DeepSpeed's ``stage3_*`` keys, docs/design.md,
"Stage 3's memory knobs").

DeepSpeed's coordinator traces the order in which submodules run (forward, then backward) and, when a submodule is
done, keeps each of its parameters gathered if the trace uses it again within ``max_reuse_distance`` elements of
other parameters; ``max_live_parameters`` bounds how much its prefetcher may hold. FSDP2's unit is a transformer
block and its switch is ``reshard_after_forward`` per unit, so the same rule is applied per unit, once, when the
model is sharded:

* a unit's reuse distance is the elements gathered between its forward and its backward: every unit that runs after
  it in forward (in ``model.modules()`` order, the execution order of transformers models) and the root's own
  weights, each once in forward and once in backward;
* units are considered from the one nearest the loss (shortest distance) back to the first; each is kept gathered
  while its distance is under ``max_reuse_distance`` and the weights live at the end of forward (the root's, the
  kept units') stay within ``max_live_parameters``. The rest reshard after forward, as plain ZeRO-3.

DeepSpeed's defaults (1e9 both) keep every unit of a model under about 0.5e9 parameters gathered: one all-gather
per unit per step and no backward gather, which is what stage 2 does. The prefetch depth answers to the same live
budget (:func:`plan_prefetch`). Keeping and prefetching change only when weights are gathered, never what they are:
training is equal to plain ZeRO-3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._compat import set_unshard_async_op
from ..config.config import ZeroPPConfig


def resolve_hidden_size_auto(model: nn.Module, config: ZeroPPConfig) -> ZeroPPConfig:
    """``"auto"`` in ``persistence_threshold`` / ``prefetch_bucket_size`` filled as Transformers' DeepSpeed
    integration fills them from the model's hidden size: 10 x hidden and int(0.9 x hidden²)."""
    wanted = {name: getattr(config, name) for name in ("persistence_threshold", "prefetch_bucket_size")}
    if "auto" not in wanted.values():
        return config
    hidden = _hidden_size(getattr(model, "config", None))
    if hidden is None:
        names = [name for name, value in wanted.items() if value == "auto"]
        raise ValueError(f"{', '.join(f'{name}=auto' for name in names)} is filled from the model's hidden size "
                         f"(model.config.hidden_size or hidden_sizes), which {type(model).__name__} does not have; "
                         f"give a number of elements instead")
    filled = {"persistence_threshold": 10 * hidden, "prefetch_bucket_size": int(0.9 * hidden * hidden)}
    return dataclasses.replace(config, **{name: filled[name] for name, value in wanted.items() if value == "auto"})


def _hidden_size(model_config: Any) -> int | None:
    for source in (model_config, getattr(model_config, "text_config", None)):
        if hasattr(source, "hidden_size"):
            return source.hidden_size
        if hasattr(source, "hidden_sizes"):
            return max(source.hidden_sizes)
    return None


def persistent_parameters(model: nn.Module, config: ZeroPPConfig) -> tuple[dict[str, str], str | None]:
    """The parameters of at most ``persistence_threshold`` elements, by name, with the reason each is kept whole;
    and, when the threshold asks for some but they cannot be kept (mixed precision: FSDP2 casts only the weights it
    shards, so a replicated bias would meet bf16 activations in fp32), why not."""
    threshold = config.persistence_threshold
    if not threshold:
        return {}, None
    small = {name: f"{param.numel()} elements <= persistence_threshold {threshold}"
             for name, param in model.named_parameters() if param.numel() <= threshold}
    if small and config.mixed_precision != "no":
        return {}, (f"persistence_threshold={threshold} not applied under mixed_precision={config.mixed_precision}: "
                    f"the {len(small)} parameters at or below it are sharded (FSDP2 casts only the weights it manages "
                    f"to the compute dtype); their bytes travel with their units' gathers")
    return small, None


def units_kept_gathered(model: nn.Module, units: list[nn.Module], config: ZeroPPConfig,
                        ignored: set[nn.Parameter]) -> tuple[list[nn.Module], str | None]:
    """The units that skip resharding after forward under ``max_live_parameters`` and ``max_reuse_distance`` (the
    rule in this module's docstring), and a line saying what was decided (None when the knobs are off)."""
    if not config.max_live_parameters and not config.max_reuse_distance:
        return [], None
    ordered = _in_execution_order(model, units)
    sizes = [_numel(unit, ignored, ordered) for unit in ordered]
    root = _numel(model, ignored, ordered)
    live, after, kept = root, root, []
    for unit, size in zip(reversed(ordered), reversed(sizes)):
        distance = 2 * after
        if distance >= config.max_reuse_distance or live + size > (config.max_live_parameters or 0):
            break
        kept.append(unit)
        live += size
        after += size
    line = (f"{len(kept)} of {len(ordered)} units keep their gathered weights from forward to backward "
            f"(max_live_parameters={config.max_live_parameters or 0:.3g}, max_reuse_distance="
            f"{config.max_reuse_distance:.3g}: {live:,} elements live at the end of forward, the root's {root:,} "
            f"included); the other {len(ordered) - len(kept)} reshard after forward")
    return kept, line


@dataclasses.dataclass
class PrefetchPlan:
    """Which units each unit starts gathering ahead of use: ``forward[i]`` for the i-th of (root, units in forward
    order), ``backward[i]`` for the i-th of (root, units in reverse); and at how many backward points the live budget
    leaves room for none while units remain to gather (``over_budget``)."""

    forward: list[list[nn.Module]]
    backward: list[list[nn.Module]]
    over_budget: int


def plan_prefetch(model: nn.Module, units: list[nn.Module], config: ZeroPPConfig, ignored: set[nn.Parameter],
                  kept: list[nn.Module]) -> PrefetchPlan:
    """DeepSpeed's coordinator's rule, per unit: when a unit starts, the units after it are prefetched up to
    ``prefetch_bucket_size`` elements (at least one unit; one without it), and no more than ``max_live_parameters``
    leaves: the budget less the weights live there (the root's, the kept units' before it and its own). In backward
    the kept units ahead are still gathered, so they are neither fetched nor counted."""
    bucket, budget = config.prefetch_bucket_size or None, config.max_live_parameters
    ordered = _in_execution_order(model, units)
    sizes = {id(unit): _numel(unit, ignored, ordered) for unit in [model, *ordered]}
    forward_live, backward_live = _live_when_running(ordered, sizes, sizes[id(model)], kept)
    forward, backward = [model, *ordered], [model, *reversed(ordered)]
    unfetched = [[unit for unit in backward[position + 1:] if not any(unit is k for k in kept)]
                 for position in range(len(backward) - 1)]
    backward_depths = [_ahead(following, sizes, bucket, backward_live[position], budget)
                       for position, following in enumerate(unfetched)]
    return PrefetchPlan(
        forward=[_ahead(forward[position + 1:], sizes, bucket, forward_live[position], budget)
                 for position in range(len(forward) - 1)],
        backward=backward_depths,
        over_budget=sum(bool(following) and not chosen for following, chosen in zip(unfetched, backward_depths)))


def prefetch_gathers(model: nn.Module, units: list[nn.Module], config: ZeroPPConfig, ignored: set[nn.Parameter],
                     device: torch.device, kept: list[nn.Module]) -> str | None:
    """Start gathers ahead of use as :func:`plan_prefetch` says. Without ``prefetch_bucket_size`` on CUDA nothing
    is set: FSDP2's default, one unit ahead in backward, with the host running ahead of its gather stream.

    On CPU a collective called without ``async_op`` blocks until its bytes have arrived, so FSDP is told to issue
    every gather asynchronously and, in forward, to start a unit's gather when the unit before it starts computing.
    Units are chained in the order ``model.modules()`` visits them, the execution order of transformers models;
    where it is not, a gather starts early and its weights are held longer, nothing else. A prefetched gather that
    no forward consumed is dropped by :func:`hf_zeropp.comm.hpz.reshard_all`, so an optimizer step never leaves one
    holding old weights.

    FSDP2 reads an empty backward list as its default of one unit ahead, so where the live budget leaves room for
    none the backward still prefetches one: returned as a line to warn and record (None when the budget is met)."""
    plan = plan_prefetch(model, units, config, ignored, kept)
    ordered = _in_execution_order(model, units)
    if config.prefetch_bucket_size or device.type == "cpu":
        for current, chosen in zip([model, *ordered], plan.forward):
            current.set_modules_to_forward_prefetch(chosen)
    if config.prefetch_bucket_size:
        for current, chosen in zip([model, *reversed(ordered)], plan.backward):
            current.set_modules_to_backward_prefetch(chosen)
    if device.type == "cpu":
        set_unshard_async_op(model, True)
    if not plan.over_budget:
        return None
    return (f"max_live_parameters={config.max_live_parameters:.3g} leaves no room for a backward prefetch at "
            f"{plan.over_budget} of {len(plan.backward)} units, but FSDP2 cannot turn it off there (an empty list is "
            f"its default of one unit ahead): the backward holds one unit's weights more than the budget there")


def _live_when_running(ordered: list[nn.Module], sizes: dict[int, int], root: int,
                       kept: list[nn.Module]) -> tuple[list[int], list[int]]:
    """Elements gathered while each unit runs, in forward order (the root, then the units) and in backward order
    (the root, then the units in reverse): the root's, those of the kept units before it (held from their forward
    to their backward) and its own. The root runs first in forward with its own weights alone, and its backward
    hook first with every kept unit's."""
    kept_ids = {id(unit) for unit in kept}
    at_unit, held = [], 0
    for unit in ordered:
        at_unit.append(root + held + sizes[id(unit)])
        held += sizes[id(unit)] if id(unit) in kept_ids else 0
    return [root, *at_unit], [root + held, *reversed(at_unit)]


def _ahead(following: list[nn.Module], sizes: dict[int, int], bucket: int | None, live: int,
           max_live: int | None) -> list[nn.Module]:
    """The next unit, then those after it while their elements together stay within ``bucket`` (none more without
    one); then, with a live budget, only as many of those, in order, as fit whole in what ``max_live`` leaves above
    ``live``. DeepSpeed counts parameters and may stop inside a unit; FSDP2 gathers whole units."""
    chosen, total = following[:1], sum(sizes[id(unit)] for unit in following[:1])
    for unit in following[1:] if bucket is not None else []:
        total += sizes[id(unit)]
        if total > bucket:
            break
        chosen.append(unit)
    if max_live is None:
        return chosen
    fitting, total = [], live
    for unit in chosen:
        total += sizes[id(unit)]
        if total > max_live:
            break
        fitting.append(unit)
    return fitting


def _in_execution_order(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    position = {id(module): index for index, module in enumerate(model.modules())}
    return sorted(units, key=lambda unit: position[id(unit)])


def _numel(module: nn.Module, ignored: set[nn.Parameter], units: list[nn.Module]) -> int:
    """Elements ``module`` gathers itself: its parameters but those of the units inside it and the replicated."""
    inside = {id(p) for unit in units if unit is not module for p in unit.parameters()}
    skip = inside | {id(p) for p in ignored}
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


__all__ = ["PrefetchPlan", "persistent_parameters", "plan_prefetch", "prefetch_gathers", "resolve_hidden_size_auto",
           "units_kept_gathered"]
