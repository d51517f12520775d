"""``zeropp: auto``'s trial: time the model's own first batch under every candidate the prediction cannot separate,
and keep the fastest.

The step model of :mod:`hf_zeropp.engine.auto` adds communication as if nothing overlapped and cannot know the compute
it hides behind; on fast links its predictions were 10-30 % off, as often the wrong way round as not. A measurement of
the user's own forward and backward has neither problem. So when :func:`hf_zeropp.shard_model` gets ``shard_group:
auto`` on more than one node, it leaves the model unsharded, its class prefixed by :class:`AwaitingAutoTrial`, and
the model's first call that computes gradients runs the trial before it runs itself:

* the candidates come in predicted order; one whose predicted communication, quantization and optimizer step add up
  to ``RULE_OUT`` times the fastest step measured so far is not timed (a step lasts at least that long, and the
  probe's rates were within a factor of two of the link's share);
* each other candidate is built as a twin of the model (a deep copy whose parameters share the model's storage and
  whose buffers are its own), sharded by the same :func:`shard_model` call a fixed preset makes, and runs
  ``TRIAL_PASSES`` forward and backward passes of the call's own inputs (backward of the loss the model returns,
  else of the mean of its first output that needs a gradient). The torch RNG state is restored before every pass,
  and the gradients go with the twin. A pass lasts as long as on its slowest rank; a candidate scores its fastest
  pass plus its predicted optimizer step, which the trial does not run;
* the candidates scored within ``RETIME_WINDOW`` of the fastest are timed once more, in the reverse order, and keep
  their fastest pass of both rounds. On a loaded machine one round scored a candidate 0.8 to 1.2 times its steady
  step, enough to turn a tie with ZeRO-3 into a loss to it; a pass slowed by whatever else ran is outlived by the
  faster one, and the reverse order times each close candidate once early and once late;
* rank 0 applies :func:`hf_zeropp.engine.auto.pick` to the scores with ``TRIAL_MARGIN`` and broadcasts the winner. The
  RNG state is restored, the model itself is sharded as the winner by that same call, and its first forward runs. The
  model's weights, buffers and RNG state are the ones it had before the trial, so training is that preset's from
  the start, bit for bit.

Optimizers built on the unsharded parameters, before or after ``prepare``, are pointed at the shards: those that
``hf_zeropp.Accelerator.prepare`` was given at once, any other at its first step
(:mod:`hf_zeropp.engine.optimizer_hooks`). The model takes the prediction's pick without a trial, and says why in rank
0's line and in ``comm_stats(model)["implementations"]["auto"]``, where ``ZEROPP_AUTO_TRIAL=0``, where the model is
frozen, and, with one warning on rank 0, where the trial cannot run: fp16 (a gradient scaler may unscale an optimizer
that still holds the unsharded parameters), weights not real on every rank (the twins need them), a first forward
without gradients (an evaluation, ``generate()``), or a use of the model as a sharded one (saving, loading,
``gathered_for_inference``) before its first forward.
"""

from __future__ import annotations

import copy
import gc
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._compat import uncompiled
from .auto import AutoPlan, pick
from ..comm.comm_meter import CommMeter
from .materialize import REAL, agree_on_placement
from .optimizer_hooks import rebind_after_late_sharding
from .state import zeropp_state
from ..comm.topology import Topology

TRIAL_ENV = "ZEROPP_AUTO_TRIAL"  # "0": no trial, the prediction alone decides
# Two passes per candidate: a fresh sharding's first pass also allocates its buffers and initializes FSDP's state
TRIAL_PASSES = 2
# Between measured times, the more accurate candidate gives way only to one at least 3 % faster: two passes of the same
# configuration on the same batch differ by about that much, and the target is to stay within 5 % of the fastest.
TRIAL_MARGIN = 0.03
RULE_OUT = 2.0  # not timed: the part of the step predicted at least this many times the fastest measured step
RETIME_WINDOW = 0.20  # timed twice: the candidates within this fraction of the fastest after one round


@dataclass
class PendingTrial:
    """What a model awaiting its trial holds (``model._zeropp_pending``) until its first forward."""

    plan: AutoPlan
    shard: Callable[..., nn.Module]  # hf_zeropp.shard_model, handed down by it
    topology: Topology
    device: torch.device
    runs_schedule: bool
    original_class: type
    meter: CommMeter  # comm_stats before the first forward, and the Trainer's error-tracking switch
    then: list[Callable[[nn.Module], None]] = field(default_factory=list)  # run on the model once it is sharded


class AwaitingAutoTrial:
    """Put in front of the class of a model that ``zeropp: auto`` shards at its first forward (see the module)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pending = _pending(self)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            _run_trial(self, pending, args, kwargs)
        else:
            _settle(self, pending, "its first forward ran without gradients (an evaluation or generate())")
        return self(*args, **kwargs)  # now the sharded model's own call

    @property
    def _zeropp(self) -> Any:
        _settle(self, _pending(self), "it was used as a sharded model (saved, loaded, gathered for inference) "
                                      "before its first forward")
        return self._zeropp


def is_pending(model: Any) -> bool:
    """Whether ``model`` (or the model a ``torch.compile`` wrapper holds) awaits auto's trial: unsharded until its
    first forward."""
    return isinstance(uncompiled(model), AwaitingAutoTrial)


def after_sharding(model: nn.Module, call: Callable[[nn.Module], None]) -> None:
    """Run ``call(model)`` once the trial has sharded ``model`` (``torch.compile`` of its units, which the trial's
    twins, copies of the unsharded model, must not share)."""
    _pending(model).then.append(call)


def current_meter(model: nn.Module) -> CommMeter:
    """The model's meter; for a model awaiting its trial, the one that reports it, without sharding the model."""
    return _pending(model).meter if is_pending(model) else zeropp_state(model).meter


def start_trial(model: nn.Module, plan: AutoPlan, shard: Callable[..., nn.Module], topology: Topology,
                device: torch.device, runs_schedule: bool, frozen: bool) -> str | None:
    """Leave ``model`` unsharded until its first forward, which times the plan's candidates (returns None); or the
    line to report where no trial runs, the prediction's pick then being final. A collective: rank 0 decides."""
    if len(plan.predicted) < 2:
        return plan.line
    why, warn = _why_no_trial(model, plan, topology, frozen)
    if why:
        if warn:
            _warn_on_rank0(topology, plan, why)
        return f"auto: {plan.choice} ({plan.reasoning}; no trial: {why})"
    line = (f"auto: timing {', '.join(plan.trial_candidates)} on the first batch before choosing ({plan.reasoning}; "
            f"the prediction alone picks {plan.choice})")
    meter = CommMeter(topology)
    meter.conditions["auto"] = line
    original_class = type(model)
    model.__class__ = _awaiting_class(original_class)
    model._zeropp_pending = PendingTrial(plan, shard, topology, device, runs_schedule, original_class, meter)
    if topology.rank == 0:
        print(f"hf_zeropp {line}", flush=True)
    return None


def _why_no_trial(model: nn.Module, plan: AutoPlan, topology: Topology, frozen: bool) -> tuple[str, bool]:
    """('', False) where the trial can run; else why not, and whether that deserves a warning. Rank 0's answer."""
    real = agree_on_placement(model, topology) == REAL  # a collective: every rank takes it
    if os.environ.get(TRIAL_ENV, "1") == "0":
        answer = (f"{TRIAL_ENV}=0", False)
    elif frozen or not any(p.requires_grad for p in model.parameters()):
        answer = ("a frozen model has no backward to time", False)
    elif plan.configs[plan.choice].mixed_precision == "fp16":
        answer = ("fp16: a gradient scaler could unscale an optimizer still holding the unsharded parameters", True)
    elif not real:
        answer = ("the weights are not real on every rank (meta device, or rank 0 only), which the twins need", True)
    else:
        answer = ("", False)
    shared = [answer]
    dist.broadcast_object_list(shared, src=0, group=topology.control_group)
    return shared[0]


def _run_trial(model: nn.Module, pending: PendingTrial, args: tuple, kwargs: dict) -> None:
    start = time.perf_counter()
    inputs = _detached(args), _detached(kwargs)
    rng = _rng_state()
    plan, group = pending.plan, pending.topology.control_group
    scores: dict[str, float] = {}
    not_timed: dict[str, float] = {}
    try:
        for name in plan.trial_candidates:
            fastest = min(scores.values(), default=None)
            if fastest is not None and plan.predicted[name] >= RULE_OUT * fastest:
                not_timed[name] = plan.predicted[name]
                continue
            passes = _time_candidate(model, pending, name, inputs, rng, fastest)
            if passes is None:
                _settle(model, pending, "its first forward returned no output that needs a gradient: nothing to "
                                        "take a backward of")
                return
            scores[name] = min(passes) + plan.optimizer_step[name]
        first_round = min(scores.values())
        retimed = [name for name in reversed(list(scores)) if scores[name] < (1 + RETIME_WINDOW) * first_round]
        if len(retimed) == 1:
            retimed = []  # the fastest, and nothing close to it: one round decides
        for name in retimed:
            passes = _time_candidate(model, pending, name, inputs, rng, None)
            scores[name] = min(scores[name], min(passes) + plan.optimizer_step[name])
    finally:
        _set_rng(rng)
    names = list(plan.configs)
    decided = [names.index(pick(scores, TRIAL_MARGIN))]
    dist.broadcast_object_list(decided, src=0, group=group)  # identical scores on every rank; rank 0's word is final
    winner = names[decided[0]]
    cost = _slowest(time.perf_counter() - start, group)
    timed = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in sorted(scores.items(), key=lambda kv: kv[1]))
    skipped = ""
    if not_timed:
        skipped = (f"; not timed, predicted at least {RULE_OUT:g}x the fastest measured step: "
                   + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in not_timed.items()))
    again = ""
    if retimed:
        again = f"; timed in a second round, within {RETIME_WINDOW:.0%} of the fastest: {', '.join(retimed)}"
    _shard_as(model, pending, winner, (
        f"auto: {winner} (timed on the first batch, forward and backward, the slowest rank's fastest of "
        f"{TRIAL_PASSES} passes plus the predicted optimizer step: {timed}{skipped}{again}; the trial took "
        f"{cost:.2f} s; before it, {plan.reasoning})"))


def _time_candidate(model: nn.Module, pending: PendingTrial, name: str, inputs: tuple[tuple, dict],
                    rng: tuple, fastest: float | None) -> list[float] | None:
    """The slowest rank's seconds of each forward and backward pass of a twin sharded as ``name`` (a second pass
    only where the first is not already ``RULE_OUT`` times ``fastest``); None where the output has nothing to
    take a backward of (on any rank: all ranks then skip the backward, whose collectives need them all)."""
    twin = _twin(model, pending)
    with warnings.catch_warnings():  # what the winner reports, it reports when the model itself is sharded
        warnings.simplefilter("ignore")
        pending.shard(twin, pending.plan.configs[name], device=pending.device, runs_schedule=pending.runs_schedule)
    group, seconds = pending.topology.control_group, []
    args, kwargs = inputs
    for _ in range(TRIAL_PASSES):
        _set_rng(rng)
        dist.barrier(group=group)
        begin = time.perf_counter()
        loss = _loss(twin(*args, **kwargs))
        if _slowest(float(loss is None), group):
            seconds = None
            break
        loss.backward()
        if pending.device.type == "cuda":
            torch.cuda.synchronize(pending.device)
        seconds.append(_slowest(time.perf_counter() - begin, group))
        twin.zero_grad(set_to_none=True)
        if fastest is not None and seconds[-1] >= RULE_OUT * fastest:
            break
    del twin
    gc.collect()  # FSDP's states and hooks hold cycles: free this twin's shards before the next is built
    return seconds


def _twin(model: nn.Module, pending: PendingTrial) -> nn.Module:
    """A deep copy of the unsharded ``model`` with its original class, whose parameters are new ``Parameter``
    objects over the model's own storage (sharding copies out of them and never writes them: the ranks' weights
    are equal already) and whose buffers are copies (a forward may update them)."""
    shared = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()}
    shared[id(pending)] = None
    awaiting = type(model)
    model.__class__ = pending.original_class
    try:
        twin = copy.deepcopy(model, shared)
    finally:
        model.__class__ = awaiting
    del twin._zeropp_pending
    return twin


def _settle(model: nn.Module, pending: PendingTrial, why: str) -> None:
    """Shard ``model`` as the prediction's pick without a trial (collective), warning once on rank 0."""
    _warn_on_rank0(pending.topology, pending.plan, why)
    _shard_as(model, pending, pending.plan.choice,
              f"auto: {pending.plan.choice} ({pending.plan.reasoning}; no trial: {why})")


def _shard_as(model: nn.Module, pending: PendingTrial, name: str, line: str) -> None:
    """Shard ``model`` as candidate ``name`` with the call a fixed preset makes, then record and print ``line``."""
    model.__class__ = pending.original_class
    del model._zeropp_pending
    before = list(model.parameters())
    pending.shard(model, pending.plan.configs[name], device=pending.device, runs_schedule=pending.runs_schedule)
    meter = zeropp_state(model).meter
    meter.conditions["auto"] = line
    meter.track_errors = pending.meter.track_errors
    rebind_after_late_sharding(before)
    if pending.topology.rank == 0:
        print(f"hf_zeropp {line}", flush=True)
    for call in pending.then:
        call(model)


def _warn_on_rank0(topology: Topology, plan: AutoPlan, why: str) -> None:
    if topology.rank == 0:
        warnings.warn(f"hf_zeropp auto: no trial, {why}; the model is sharded as the prediction's pick, "
                      f"{plan.choice}", stacklevel=4)


def _pending(model: nn.Module) -> PendingTrial:
    return vars(uncompiled(model))["_zeropp_pending"]


_AWAITING_CLASSES: dict[type, type] = {}


def _awaiting_class(original_class: type) -> type:
    """``AwaitingAutoTrial`` + the model's class, named as the original (``save_pretrained`` before the first forward
    records the class name as the model's architecture)."""
    if original_class not in _AWAITING_CLASSES:
        _AWAITING_CLASSES[original_class] = type(original_class.__name__, (AwaitingAutoTrial, original_class),
                                                 {"__module__": original_class.__module__,
                                                  "__qualname__": original_class.__qualname__})
    return _AWAITING_CLASSES[original_class]


def _loss(output: Any) -> torch.Tensor | None:
    """What the trial takes a backward of: the model's own loss, else the mean of its first output that needs a
    gradient (the backward's cost is the network's, whatever loss the script computes from that output)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss if loss.dim() == 0 else loss.float().mean()
    for tensor in _tensors(output):
        if tensor.requires_grad and tensor.is_floating_point():
            return tensor.float().mean()
    return None


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _detached(value: Any) -> Any:
    """The call's inputs, cut from any graph: a backward in the trial must not reach the script's tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if type(value) in (list, tuple):
        return type(value)(_detached(item) for item in value)
    if type(value) is dict:
        return {key: _detached(item) for key, item in value.items()}
    return value


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _slowest(seconds: float, group: dist.ProcessGroup) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value)


__all__ = ["AwaitingAutoTrial", "PendingTrial", "current_meter", "is_pending", "start_trial"]
