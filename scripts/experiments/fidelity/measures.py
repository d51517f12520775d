"""What is measured per candidate and parameter class: error sums, Adam's normalization of a gradient, and what a
driving option delivered to each element."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hf_zeropp.comm.layout import parameter_spans

from .candidates import CLASSES, DELIVERY_BINS, SURPRISE


class Sums:
    """Per candidate and parameter class, this rank's sums of (q - x)^2, x^2, q.x and q^2 over its shard parts."""

    def __init__(self, candidates: int) -> None:
        self.values = torch.zeros(candidates, len(CLASSES), 4, dtype=torch.float64)

    def add(self, candidate: int, cls: int, candidate_result: torch.Tensor, exact: torch.Tensor) -> None:
        q, x = candidate_result.double(), exact.double()
        row = torch.stack(((q - x).pow(2).sum(), x.pow(2).sum(), (q * x).sum(), q.pow(2).sum()))
        self.values[candidate, cls] += row
        self.values[candidate, -1] += row

    def reduce_and_reset(self) -> torch.Tensor:
        """(relative L2 error, cosine) per candidate and class over all ranks; zeroes the sums."""
        totals = self.values.clone()
        dist.all_reduce(totals)
        self.values.zero_()
        err2, ref2, dot, cand2 = totals.unbind(-1)
        relative = (err2 / ref2.clamp_min(1e-300)).sqrt()
        cosine = dot / (ref2 * cand2).sqrt().clamp_min(1e-300)
        return torch.stack((relative, cosine), dim=-1)


def adam_moments(optimizer: Any, spans: list[tuple[nn.Parameter, int, int]],
                 rank_numel: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Adam's exp_avg and exp_avg_sq laid out like a unit's reduce-scatter output (float64, 0 on FSDP's padding and
    where a parameter has no state yet), with its step count (0 before the first step), betas and eps."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    groups = {id(p): group for group in inner.param_groups for p in group["params"]}
    moments = torch.zeros(2, rank_numel, dtype=torch.float64)
    hyper = {"step": 0.0}
    for param, start, _ in spans:
        group = groups[id(param)]
        hyper.update(beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"])
        state = inner.state.get(param, {})
        if "exp_avg_sq" not in state:
            continue
        hyper["step"] = float(state["step"])
        for row, name in enumerate(("exp_avg", "exp_avg_sq")):
            value = state[name]
            value = (value.to_local() if hasattr(value, "to_local") else value).double().flatten()
            moments[row, start:start + value.numel()] = value
    return moments[0], moments[1], hyper


class AdamNormalizer:
    """A gradient as one Adam step sees it: ``g / (sqrt(v_hat(g)) + eps)``, where ``v_hat(g)`` is the bias-corrected
    second moment that step computes from the optimizer's previous state and ``g`` itself. So every gradient,
    exact or quantized, is divided by the root of its own second moment: bounded by about 1 / sqrt(1 - beta2) per
    element, even where the exact gradient has been zero (weighing a quantized gradient by the exact run's
    1 / sqrt(v_hat) there would give it weight 1 / eps).

    Built from the state before the step (read during backward, before the optimizer runs) and after it: the
    change of exp_avg gives the gradient the step consumed, ``(m_t - beta1 m_{t-1}) / (1 - beta1)``, whose ratio
    to the reduce-scatter's output is the factor FSDP's averaging and gradient clipping applied."""

    def __init__(self, before: tuple, after: tuple, exact: torch.Tensor) -> None:
        (first, self.second, _), (first_after, _, hyper) = before, after
        self.hyper = hyper
        consumed = (first_after - hyper["beta1"] * first) / (1 - hyper["beta1"])
        norm = exact.pow(2).sum()
        self.factor = float((consumed.pow(2).sum() / norm).sqrt()) if norm > 0 else 1.0

    def __call__(self, gradient: torch.Tensor) -> torch.Tensor:
        h = self.hyper
        applied = gradient * self.factor
        second = h["beta2"] * self.second + (1 - h["beta2"]) * applied.pow(2)
        return applied / ((second / (1 - h["beta2"] ** h["step"])).sqrt() + h["eps"])

    def surprised(self, gradient: torch.Tensor) -> torch.Tensor:
        """The elements whose gradient, as the step applies it, exceeds SURPRISE times the root of the run's
        bias-corrected second moment before the step: where the run's v has not seen gradients this large (an
        element the run has starved, or a rare token's first push). Normalized, such an element is near
        sqrt((1 - beta2**t) / (1 - beta2)), far above the ~1 of the rest, so an error there weighs heavily."""
        h = self.hyper
        before = h["step"] - 1
        if before < 1:
            return torch.zeros(gradient.shape, dtype=torch.bool)
        typical = (self.second / (1 - h["beta2"] ** before)).sqrt()
        return (gradient * self.factor).abs() > SURPRISE * typical


class Deliveries:
    """What the driving candidate has delivered to each element so far, as Adam's second moment remembers it: moving
    averages (Adam's beta2) of the delivered q^2 and the exact x^2, of the steps at which q was exactly 0 while x was
    not, and of the steps at which x was not 0. Their ratios say whether the run's v had been starved (q^2 well below
    x^2, or q often 0) on an element before a step, independently of where the error then lands."""

    def __init__(self) -> None:
        self.averages: dict[int, torch.Tensor] = {}  # unit -> (4, numel) float64

    def observe(self, unit: int, delivered: torch.Tensor, exact: torch.Tensor, beta2: float) -> torch.Tensor:
        """The averages before this step (a copy), then folds the step in."""
        averages = self.averages.setdefault(unit, torch.zeros(4, exact.numel(), dtype=torch.float64))
        before = averages.clone()
        nonzero = exact != 0
        step = torch.stack((delivered.pow(2), exact.pow(2), (nonzero & (delivered == 0)).double(), nonzero.double()))
        averages.mul_(beta2).add_(step, alpha=1 - beta2)
        return before

    @staticmethod
    def bins(before: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
        """Per element (over the columns of ``before``): [1, no exact gradient before, delivered/exact energy below
        DELIVERY_BINS[0], below DELIVERY_BINS[1], at least DELIVERY_BINS[2], share of steps delivered as 0, ``error``
        where the energy is below DELIVERY_BINS[1]] (from the third on, only where there was an exact gradient
        before); DELIVERY_COLUMNS names them."""
        delivered, exact, zeros, nonzero = before
        seen = exact > 0
        ratio = delivered / exact.clamp_min(1e-300)
        low, lower, high = DELIVERY_BINS
        return torch.stack((torch.ones_like(exact), (~seen).double(), (seen & (ratio < low)).double(),
                            (seen & (ratio < lower)).double(), (seen & (ratio >= high)).double(),
                            torch.where(seen, zeros / nonzero.clamp_min(1e-300), 0.0),
                            torch.where(seen & (ratio < lower), error, 0.0)))


class MeasuredGradient(NamedTuple):
    """One unit's gradients in a measured step, kept until the optimizer step that consumes them has run."""

    unit: int  # index of the FSDP unit
    spans: list  # parameter_spans of its reduce-scatter output
    positions: list[torch.Tensor]  # per parameter class
    exact: torch.Tensor
    consumed: torch.Tensor  # what the optimizer step receives: exact, or the driving candidate's result
    results: list[torch.Tensor]  # per gradient candidate
    rotated: torch.Tensor  # for the width-rule table (WidthRules.observe)
    history_key: torch.Tensor
    before: tuple  # adam_moments before the step
    delivered: torch.Tensor | None  # the driving candidate's Deliveries averages before the step (None: no drive)


class ParameterClasses:
    """Which class each parameter of the model is, and where each class lies in a unit's part of a collective."""

    def __init__(self, model: nn.Module) -> None:
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        self.of = {id(p): (1 if id(p) in embeddings else 2 if p.dim() == 1 else 0) for p in model.parameters()}
        self._cache: dict[tuple[int, bool, int], list[torch.Tensor]] = {}

    def positions(self, unit: nn.Module, trainable_only: bool, rank_numel: int, group_size: int) -> list[torch.Tensor]:
        key = (id(unit), trainable_only, rank_numel)
        if key not in self._cache:
            spans = parameter_spans(unit, trainable_only, rank_numel, group_size)
            if spans is None:
                raise RuntimeError(f"{type(unit).__name__}: the collective's buffer ({rank_numel} elements per rank) "
                                   f"does not match its FSDP parameters; fidelity cannot classify it")
            per_class: list[list[torch.Tensor]] = [[] for _ in CLASSES[:-1]]
            for param, start, length in spans:
                per_class[self.of[id(param)]].append(torch.arange(start, start + length))
            self._cache[key] = [torch.cat(p) if p else torch.empty(0, dtype=torch.long) for p in per_class]
        return self._cache[key]


