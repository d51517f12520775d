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
per unit per step and no backward gather, which is what stage 2 does. Keeping changes only when weights are
gathered, never what they are: training is equal to plain ZeRO-3.
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
        if distance >= config.max_reuse_distance or live + size > config.max_live_parameters:
            break
        kept.append(unit)
        live += size
        after += size
    line = (f"{len(kept)} of {len(ordered)} units keep their gathered weights from forward to backward "
            f"(max_live_parameters={config.max_live_parameters:.3g}, max_reuse_distance="
            f"{config.max_reuse_distance:.3g}: {live:,} elements live at the end of forward, the root's {root:,} "
            f"included); the other {len(ordered) - len(kept)} reshard after forward")
    return kept, line


def prefetch_gathers(model: nn.Module, units: list[nn.Module], config: ZeroPPConfig, ignored: set[nn.Parameter],
                     device: torch.device) -> None:
    """Start gathers ahead of use: ``prefetch_bucket_size`` elements of the following units in forward and in
    backward (at least one unit), or, without it, one unit ahead in forward on CPU.

    On CUDA, FSDP runs its gathers on a separate stream and the host runs ahead, so one unit ahead overlaps by
    itself (FSDP2's default). On CPU a collective called without ``async_op`` blocks until its bytes have arrived,
    so FSDP is told to issue every gather asynchronously and, in forward, to start a unit's gather when the unit
    before it starts computing (backward prefetches one unit ahead by default). Units are chained in the order
    ``model.modules()`` visits them, the execution order of transformers models; where it is not, a gather starts
    early and its weights are held longer, nothing else. A prefetched gather that no forward consumed is dropped by
    :func:`hf_zeropp.comm.hpz.reshard_all`, so an optimizer step never leaves one holding old weights."""
    bucket = config.prefetch_bucket_size
    if bucket is None and device.type != "cpu":
        return
    ordered = _in_execution_order(model, units)
    sizes = {id(unit): _numel(unit, ignored, ordered) for unit in ordered}
    forward = [model, *ordered]
    for position, current in enumerate(forward[:-1]):
        current.set_modules_to_forward_prefetch(_ahead(forward[position + 1:], sizes, bucket))
    if bucket is not None:
        backward = [model, *reversed(ordered)]
        for position, current in enumerate(backward[:-1]):
            current.set_modules_to_backward_prefetch(_ahead(backward[position + 1:], sizes, bucket))
    if device.type == "cpu":
        set_unshard_async_op(model, True)


def _ahead(following: list[nn.Module], sizes: dict[int, int], bucket: int | None) -> list[nn.Module]:
    """The next unit, then those after it while their elements together stay within ``bucket``."""
    chosen, total = following[:1], sizes[id(following[0])]
    for unit in following[1:] if bucket is not None else []:
        total += sizes[id(unit)]
        if total > bucket:
            break
        chosen.append(unit)
    return chosen


def _in_execution_order(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    position = {id(module): index for index, module in enumerate(model.modules())}
    return sorted(units, key=lambda unit: position[id(unit)])


def _numel(module: nn.Module, ignored: set[nn.Parameter], units: list[nn.Module]) -> int:
    """Elements ``module`` gathers itself: its parameters but those of the units inside it and the replicated."""
    inside = {id(p) for unit in units if unit is not module for p in unit.parameters()}
    skip = inside | {id(p) for p in ignored}
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


__all__ = ["persistent_parameters", "prefetch_gathers", "resolve_hidden_size_auto", "units_kept_gathered"]
