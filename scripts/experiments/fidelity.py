"""Gradient and weight fidelity of the qgZ, hybrid-q and qwZ options along a real training trajectory.

    python -m scripts.experiments.fidelity [--topologies 2x2,2x4] [--steps 100,300,550] [--window 8]
                                           [--out out/fidelity] [--candidate NAME ...] [--drive NAME]

A ZeRO-3 fp32 baseline (by default the mini Table 5 recipe, ``recipes/gpt350m_pile/mini/zero3.yaml``, through
ZeroPPTrainer, with the recipe's global batch at every topology) trains on emulated nodes: one gloo process per
rank, ``LOCAL_WORLD_SIZE`` = ranks per node. In each measured window (``--window`` consecutive steps starting at
each of ``--steps``) every FSDP unit's reduce-scatter input — the ranks' true, unreduced gradients — is also reduced
by each candidate qgZ configuration, and every forward all-gather is also run by each candidate qwZ; the baseline
keeps the exact results, so every candidate is measured on the same gradients and weights.

Per parameter class (matrices, embeddings, 1-D) the script reports the relative L2 error ||q - x|| / ||x|| and the
cosine of each candidate's result q against the exact one x, averaged over the measured steps, and for gradients
also the relative error of their sum over each window, ||sum(q - x)|| / ||sum(x)||: what a momentum-like optimizer
state accumulates, where error feedback and stochastic rounding act. The horizon table follows that sum through each
window, after 1, 2, 4, ... steps: an error that changes sign from step to step shrinks against the summed gradient as
the horizon grows, a repeated one (a bias) does not.

Adam does not see the gradient as L2 does: it divides each element by the root of its own second moment, so an error
of the same L2 size harms far more when it lands on elements whose gradients are small. The "Adam-normalized"
columns compare each gradient as the baseline's optimizer step would normalize it, g / (sqrt(v_hat(g)) + eps),
with v_hat(g) the second moment that step computes from its previous state and g itself (gradient clipping
included; see AdamNormalizer): the error of the update direction rather than of the gradient. An earlier version
weighed the error by the exact run's 1 / sqrt(v_hat) of the step before; where an element's gradient had been zero
(the embedding row of a token not yet seen, any element in the first steps) that weight is 1 / eps, and a few such
elements decided the whole column.

The width-rule table isolates the choice of per-block bit widths on the inter-node hop: one quantization of the exact
reduced shard (1-D slices left out, Hadamard 64, the candidates' block size, 4.125 bits per value on average, as
qgZ's INT4 hop) with the fixed width, with ``gradient_bit_allocation``'s rule (wider where the block's absmax is
larger: least L2 error), with that rule held to at least the fixed width on every block that is not all zero (so the
only bits that move are those the fixed format spends on zero blocks: which part of the gain is free), with it held
to 2 bits (``gradient_bit_allocation_floor: 2``: no nonzero block is sent as zeros), with a rule both ends of the
hop could follow at no extra byte (the block's absmax over the root of a moving average of its own past squared
absmax: wider where a block is larger than it usually is), and with
an oracle no sender has (absmax over the block's RMS of the owner's sqrt(v): wider where a block is larger than
Adam expects, what Adam's normalization asks for). Deterministic (seeded); minutes on 2 cores.

The table of where the Adam-normalized error lies splits it between the "surprising" elements (the exact gradient
beyond SURPRISE times the root of the run's own second moment before the step: Adam normalizes them to about
sqrt((1 - beta2**t) / (1 - beta2)), the rest to about 1) and the others. An option whose error concentrates there
delivers too little exactly where the run's second moment has fallen behind the gradient. In a driven run the
delivery table says whether the driving option had starved those elements before the step: per element, moving
averages with Adam's beta2 of the energy it delivered and of the exact energy (what the run's v holds against what
the exact run's would), the share of steps it delivered an exact 0 where the gradient was not 0, and the share of its
Adam-normalized error that lies on the elements it had given less than half their exact energy.

The hybrid rows measure hybrid sharding's gradient path on the same gradients: preset hybrid-q reduce-scatters each
unit exactly inside the node and averages the node partial sums across nodes with a block-quantized (INT4 by
default) reduce-scatter and all-gather, and preset hybrid does that all-reduce in fp32 (FSDP2's HSDP). Its FSDP2
shards a unit over one node's ranks, so the blocks fall on that layout of the unit's buffer: HybridReduceScatter
lays each rank's unreduced gradients out so, runs the engine's own cross-node all-reduce, and cuts this rank's world
shard from the result. tests/test_fidelity.py checks the layout and the result against the engine's hybrid-q. Their
cross-node bytes are the all-reduce's alone (no weight crosses nodes under hybrid sharding); the fp32 row equals the
exact reduce-scatter to fp32 rounding, a check of the emulation.

``--candidate`` measures only the named gradient rows (after ZeRO++'s own), which makes long windows affordable.
``--drive`` trains on one candidate's results instead of the exact ones, so every candidate is measured along that
candidate's own trajectory rather than the baseline's, and normalized by that run's Adam state (qgZ only: forward
weights stay exact, so the run is the engine's qgZ-only training, which tests/test_fidelity.py checks). An option
can look harmless on the baseline's trajectory and not on its own: Adam's second moment adapts to what the option
delivers, e.g. shrinks where blocks keep getting no bits. Every run reports the validation loss where it stops, so a
driven run and the baseline on the same seed and batches compare in loss too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import hf_zeropp
from hf_zeropp._compat import AllGather, ReduceScatter
from hf_zeropp.comm.comm_meter import CommMeter, MeteredReduceScatter, all_gather_single, allgather_kind, check_sum
from hf_zeropp.config.config import ZeroPPConfig
from hf_zeropp.comm.hybrid import QuantizedCrossNodeAllReduce, record_hsdp_all_reduce
from hf_zeropp.kernels.allocation import block_widths, round_trip_with_widths
from hf_zeropp.kernels.reference import hadamard_rows, num_blocks
from hf_zeropp.comm.layout import parameter_spans
from hf_zeropp.comm.qgz import QuantizedReduceScatter, make_reduce_scatter
from hf_zeropp.comm.qwz import make_all_gather
from hf_zeropp.engine.state import fsdp_modules, zeropp_state
from hf_zeropp.comm.topology import Topology
from hf_zeropp.testing.spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
from scripts.train_gpt import build_datasets, build_model, load_recipe

CLASSES = ("matrices", "embeddings", "1-D", "all")

# name -> ZeroPPConfig overrides of the zeropp preset, or of the preset a "preset" key names (the hybrid rows: see
# HybridReduceScatter); the first row is the reference the others are compared to
GRADIENT_CANDIDATES: dict[str, dict[str, Any]] = {
    "ZeRO++ qgZ (int4/int4, block 256)": {},
    "1-D parameters quantized too": {"gradient_full_precision_1d": False},
    "Hadamard 32": {"gradient_hadamard": 32},
    "Hadamard 64": {"gradient_hadamard": 64},
    "Hadamard 128": {"gradient_hadamard": 128},
    "stochastic rounding": {"stochastic_rounding": True},
    "8-bit intra-node hop": {"gradient_intra_bits": 8},
    "error feedback (inter-node hop)": {"gradient_error_feedback": True},
    "LoCo error feedback (decay 0.5)": {"gradient_error_feedback": True, "gradient_error_feedback_decay": 0.5},
    "Hadamard 64 + 8-bit intra": {"gradient_hadamard": 64, "gradient_intra_bits": 8},
    "Hadamard 64 + 8-bit intra + error feedback": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                   "gradient_error_feedback": True},
    "Hadamard 64 + 8-bit intra + LoCo (decay 0.5)": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                     "gradient_error_feedback": True,
                                                     "gradient_error_feedback_decay": 0.5},
    "Hadamard 64 + SR + 8-bit intra": {"gradient_hadamard": 64, "stochastic_rounding": True,
                                       "gradient_intra_bits": 8},
    "bit allocation (inter-node hop)": {"gradient_bit_allocation": True},
    "Hadamard 64 + 8-bit intra + bit allocation": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                   "gradient_bit_allocation": True},
    "own rows in fp32": {"gradient_full_precision_local": True},
    "Hadamard 64 + 8-bit intra + own rows in fp32": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                     "gradient_full_precision_local": True},
    "Hadamard 64 + 8-bit intra + bit allocation, floor 2 + own rows in fp32": {
        "gradient_hadamard": 64, "gradient_intra_bits": 8, "gradient_bit_allocation": True,
        "gradient_bit_allocation_floor": 2, "gradient_full_precision_local": True},
    "Hadamard 64 + 8-bit intra + bit allocation, floor 2": {"gradient_hadamard": 64, "gradient_intra_bits": 8,
                                                           "gradient_bit_allocation": True,
                                                           "gradient_bit_allocation_floor": 2},
    "Hadamard 64 + 8-bit intra + bit allocation + LoCo (decay 0.5)": {
        "gradient_hadamard": 64, "gradient_intra_bits": 8, "gradient_bit_allocation": True,
        "gradient_error_feedback": True, "gradient_error_feedback_decay": 0.5},
    "hybrid (fp32 across nodes)": {"preset": "hybrid"},
    "hybrid-q (int4 across nodes, block 256)": {"preset": "hybrid-q"},
    "hybrid-q, Hadamard 64": {"preset": "hybrid-q", "gradient_hadamard": 64},
    "hybrid-q, int8 across nodes": {"preset": "hybrid-q", "hybrid_gradient_bits": 8},
    "hybrid-q, error feedback": {"preset": "hybrid-q", "gradient_error_feedback": True},
    "hybrid-q, Hadamard 64 + error feedback": {"preset": "hybrid-q", "gradient_hadamard": 64,
                                               "gradient_error_feedback": True},
}
# ways of choosing the inter-node hop's per-block widths, compared on one quantization of the exact shard
WIDTH_RULES = ("fixed 4 bits (ZeRO++)", "absmax: least L2 error (gradient_bit_allocation)",
               "absmax, no block below 4 bits unless all zero (bits move only from zero blocks)",
               "absmax, no block below 2 bits unless all zero (gradient_bit_allocation_floor: 2)",
               "absmax / RMS of its past absmax (moving average 0.99)",
               "oracle: absmax / the block's RMS of the owner's sqrt(v)")
RULE_HADAMARD, RULE_BITS, RULE_HISTORY_DECAY = 64, 4, 0.99
# an element is "surprising" Adam when its exact gradient exceeds this many times its root second moment before the step
SURPRISE = 3.0
# delivered/exact energy (Deliveries) thresholds: starved, half-starved, over-delivered (quantization noise)
DELIVERY_BINS = (0.1, 0.5, 2.0)
DELIVERY_COLUMNS = ("elements", "no exact gradient before", "delivered energy < 0.1 of the exact",
                    "< 0.5", ">= 2", "steps delivered as exactly 0",
                    "driving option's error on those < 0.5 (share of all its error)")
WEIGHT_CANDIDATES: dict[str, dict[str, Any]] = {
    "ZeRO++ qwZ (int8, block 256, 1-D in full precision)": {},
    "1-D parameters quantized too": {"weight_full_precision_1d": False},
}


def candidate_config(overrides: dict[str, Any]) -> ZeroPPConfig:
    return ZeroPPConfig.from_dict({"preset": "zeropp", **overrides})


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


class Probe:
    """Shared by every unit's wrappers: whether this step is measured, the sums, the candidates' meters."""

    def __init__(self, model: nn.Module, candidates: dict[str, dict[str, Any]]) -> None:
        self.active = False
        self.classes = ParameterClasses(model)
        self.candidates = candidates  # the gradient candidates measured, a subset of GRADIENT_CANDIDATES
        self.drive: int | None = None  # the candidate whose results the model trains on (None: the exact ones)
        self.gradient_sums = Sums(len(candidates))
        self.scaled_gradient_sums = Sums(len(candidates))  # Adam-normalized (AdamNormalizer)
        # over [all elements, the surprised ones]: each candidate's Adam-normalized squared error, then the
        # normalized exact gradient's squared norm, then the number of elements
        self.surprise = torch.zeros(len(candidates) + 2, 2, dtype=torch.float64)
        self.deliveries = Deliveries()
        # Deliveries.bins summed over [the surprised elements, the others] (driven runs only)
        self.delivery = torch.zeros(2, len(DELIVERY_COLUMNS), dtype=torch.float64)
        self.scaled = False  # whether this step had Adam state to weight with
        self.window_scaled = True  # whether every step of this window had
        self.optimizer: Any = None
        self.weight_sums = Sums(len(WEIGHT_CANDIDATES))
        topology = zeropp_state(model).topology
        self.gradient_meters = [CommMeter(topology) for _ in candidates]
        # per gradient candidate, shared by the units as the engine's is: its cross-node all-reduce (hybrid rows)
        self.cross_node = [cross_node_all_reduce(candidate_config(overrides), topology, meter)
                           for overrides, meter in zip(candidates.values(), self.gradient_meters)]
        self.weight_meters = [CommMeter(topology) for _ in WEIGHT_CANDIDATES]
        # per gradient candidate and unit: running sums of (q - x) and x over the window, plain and Adam-normalized
        self.window: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.reduce_scatters: list[GradientProbe] = []
        # this step's measured gradients, weighed by Adam once the optimizer step that consumes them has run
        self.pending: list[MeasuredGradient] = []
        plain = candidate_config({})
        self.rules = WidthRules(plain.gradient_block_size or plain.block_size)

    def classify(self, sums: Sums, candidate: int, positions: list[torch.Tensor], result: torch.Tensor,
                 exact: torch.Tensor) -> None:
        for cls, where in enumerate(positions):
            if where.numel():
                sums.add(candidate, cls, result[where], exact[where])

    def weigh_by_adam(self) -> None:
        """The Adam-normalized sums of this step's measured gradients (call after the optimizer step)."""
        self.scaled = bool(self.pending)
        for measured in self.pending:
            after = adam_moments(self.optimizer, measured.spans, measured.exact.numel())
            if after[2]["step"] <= measured.before[2]["step"]:  # the optimizer skipped the step
                self.scaled = False
                continue
            normalize = AdamNormalizer(measured.before, after, measured.consumed)
            normalized_exact = normalize(measured.exact)
            normalized = [normalize(result) for result in measured.results]
            for c, result in enumerate(normalized):
                self.classify(self.scaled_gradient_sums, c, measured.positions, result, normalized_exact)
                running = self.window[(c, measured.unit)][0]
                running[2] += result - normalized_exact
                running[3] += normalized_exact
            surprised = normalize.surprised(measured.exact)
            self.locate_error(measured.positions, surprised, normalized, normalized_exact)
            if measured.delivered is not None:
                where = torch.cat(measured.positions)
                error = (normalized[self.drive][where] - normalized_exact[where]).pow(2)
                bins = Deliveries.bins(measured.delivered[:, where], error)
                inside = surprised[where]
                self.delivery[0] += bins[:, inside].sum(-1)
                self.delivery[1] += bins[:, ~inside].sum(-1)
            self.rules.measure(self, measured.positions, measured.exact, measured.rotated, measured.history_key,
                               normalize, after[1])
        self.pending.clear()

    def locate_error(self, positions: list[torch.Tensor], surprised: torch.Tensor, normalized: list[torch.Tensor],
                     normalized_exact: torch.Tensor) -> None:
        where = torch.cat(positions)
        inside = surprised[where]
        exact = normalized_exact[where]
        parts = [(result[where] - exact).pow(2) for result in normalized]
        parts += [exact.pow(2), torch.ones_like(exact)]
        for row, values in enumerate(parts):
            self.surprise[row, 0] += values.sum()
            self.surprise[row, 1] += values[inside].sum()

    def reduce_error_location(self) -> tuple[list, list]:
        """This step's surprise and delivery sums over all ranks; zeroes them."""
        totals = torch.cat((self.surprise.flatten(), self.delivery.flatten()))
        dist.all_reduce(totals)
        surprise, delivery = totals.split((self.surprise.numel(), self.delivery.numel()))
        self.surprise.zero_()
        self.delivery.zero_()
        return surprise.view_as(self.surprise).tolist(), delivery.view_as(self.delivery).tolist()

    def start_window(self) -> None:
        self.window.clear()
        self.window_scaled = True
        for probe in self.reduce_scatters:
            for c, candidate in enumerate(probe.candidates):
                if candidate.feedback is not None and c != self.drive:
                    candidate.feedback.reset()  # the previous window's residual belongs to other gradients

    def window_error(self) -> torch.Tensor:
        """||sum over the window so far of (q - x)|| / ||sum of x|| per gradient candidate and class, over all
        ranks; [..., 0] plain, [..., 1] Adam-normalized."""
        totals = torch.zeros(len(self.candidates), len(CLASSES), 2, 2, dtype=torch.float64)
        for (candidate, unit), (sums, positions) in self.window.items():
            for cls, where in enumerate(positions):
                if where.numel():
                    row = sums[:, where].pow(2).sum(-1).view(2, 2)
                    totals[candidate, cls] += row
                    totals[candidate, -1] += row
        dist.all_reduce(totals)
        return (totals[..., 0] / totals[..., 1].clamp_min(1e-300)).sqrt()


class GradientProbe(ReduceScatter):
    """A unit's exact reduce-scatter, also run by every candidate qgZ on a copy of its input when measuring."""

    def __init__(self, probe: Probe, unit: nn.Module, index: int, exact: Any, topology) -> None:
        self.probe, self.unit, self.index, self.exact = probe, unit, index, exact
        self.candidates = [gradient_candidate(candidate_config(overrides), cross_node, topology, meter, unit, index)
                           for overrides, meter, cross_node in zip(probe.candidates.values(), probe.gradient_meters,
                                                                   probe.cross_node)]

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.exact.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        drive = self.probe.drive
        results: dict[int, torch.Tensor] = {}
        for c, candidate in enumerate(self.candidates):
            if self.probe.active or c == drive:
                result = torch.empty_like(output_tensor)
                candidate(result, input_tensor.clone(), group, op)  # qgZ zeroes the 1-D slices of its input
                results[c] = result
        work = self.exact(output_tensor, input_tensor, group, op, async_op=async_op)
        if work is not None:
            work.wait()  # FSDP waits for it again: a finished work's wait returns at once
        numel, group_size = output_tensor.numel(), dist.get_world_size(group)
        positions = self.probe.classes.positions(self.unit, True, numel, group_size)
        exact = output_tensor.double()
        delivered = None
        if drive is not None:
            output_tensor.copy_(results[drive])  # the model trains on the driving candidate's gradients
            beta2 = getattr(self.probe.optimizer, "optimizer", self.probe.optimizer).param_groups[0]["betas"][1]
            delivered = self.probe.deliveries.observe(self.index, results[drive].double(), exact, beta2)
        rotated, history_key = self.probe.rules.observe(self.index, exact, positions)  # every step: the history
        if not self.probe.active:
            return work
        results = [results[c].double() for c in range(len(self.candidates))]
        for c, result in enumerate(results):
            self.probe.classify(self.probe.gradient_sums, c, positions, result, exact)
            # rows: plain (q - x), plain x, Adam-normalized (q - x) and x (those two after the step)
            running = self.probe.window.setdefault((c, self.index), [torch.zeros(4, numel, dtype=torch.float64),
                                                                      positions])
            running[0][0] += result - exact
            running[0][1] += exact
        spans = parameter_spans(self.unit, True, numel, group_size)
        consumed = exact if drive is None else results[drive]
        self.probe.pending.append(MeasuredGradient(self.index, spans, positions, exact, consumed, results, rotated,
                                                   history_key, adam_moments(self.probe.optimizer, spans, numel),
                                                   delivered))
        return work


def chunk_numel(shape: torch.Size, parts: int) -> int:
    """Elements of one rank's dim-0 chunk of a parameter of ``shape`` sharded over ``parts`` ranks, padded as FSDP2
    pads it (``ceil(dim 0 / parts)`` rows)."""
    return -(-shape[0] // parts) * shape[1:].numel()


def relayout(rows: torch.Tensor, shapes: list[torch.Size], parts: int) -> torch.Tensor:
    """A unit's flat buffer as FSDP2 lays it out over ``rows.shape[0]`` ranks, to the same buffer as FSDP2 lays it
    out over ``parts`` ranks: ``(parts, numel per rank)``. Row ``r`` is the concatenation, over the parameters of
    ``shapes`` (the unit's order), of each one's ``r``-th dim-0 chunk with torch.chunk's sizes (``ceil(dim 0 /
    parts)`` rows), zero-padded to that size; an emptied chunk is all padding."""
    offset, parts_of = 0, []
    for shape in shapes:
        numel, width = shape.numel(), chunk_numel(shape, rows.shape[0])
        padded = rows.new_zeros(parts, chunk_numel(shape, parts))
        padded.view(-1)[:numel] = rows[:, offset:offset + width].reshape(-1)[:numel]
        parts_of.append(padded)
        offset += width
    if offset != rows.shape[1]:
        raise ValueError(f"parameters of {offset} elements per rank laid out on a buffer of {rows.shape[1]}")
    return torch.cat(parts_of, dim=1)


def vector_positions(shapes: list[torch.Size], parts: int) -> torch.Tensor:
    """Where the 1-D parameters of ``shapes`` lie in one rank's row of ``relayout``'s layout over ``parts`` ranks
    (their padding included: it holds zeros)."""
    offset, positions = 0, []
    for shape in shapes:
        width = chunk_numel(shape, parts)
        if len(shape) == 1:
            positions.append(torch.arange(offset, offset + width))
        offset += width
    return torch.cat(positions) if positions else torch.empty(0, dtype=torch.long)


def unit_shapes(unit: nn.Module, rank_numel: int, group_size: int) -> list[torch.Size]:
    """The full shapes of the unit's trainable parameters, in the order of its reduce-scatter buffer, checked against
    FSDP2's layout of ``rank_numel`` elements per rank over ``group_size`` ranks: dim 0 chunked (``relayout``)."""
    spans = parameter_spans(unit, True, rank_numel, group_size)
    if spans is None:
        raise RuntimeError(f"{type(unit).__name__}: the reduce-scatter's buffer ({rank_numel} elements per rank) does "
                           f"not match its FSDP parameters; the hybrid rows cannot lay it out")
    shapes = [param.shape for param, _, _ in spans]  # a DTensor's shape is the full parameter's
    for shape, (_, _, length) in zip(shapes, spans):
        if length != chunk_numel(shape, group_size):
            raise RuntimeError(f"{type(unit).__name__}: a parameter of shape {tuple(shape)} takes {length} elements "
                               f"per rank, not its dim-0 chunk's; the hybrid rows cannot lay it out")
    return shapes


class ExactCrossNodeAllReduce:
    """Preset hybrid's cross-node step: FSDP2's own HSDP all-reduce (an fp32 SUM among the ranks of equal local
    index), metered as the engine meters it (``install_hybrid_all_reduce``)."""

    def __init__(self, topology: Topology, meter: CommMeter) -> None:
        self.group, self.meter = topology.inter_node_group, meter

    def reduce(self, partial: torch.Tensor, unit: int, vectors: torch.Tensor | None = None) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=self.group)
        record_hsdp_all_reduce(self.meter, self.group, total)
        return total


def cross_node_all_reduce(config: ZeroPPConfig, topology: Topology,
                          meter: CommMeter) -> QuantizedCrossNodeAllReduce | ExactCrossNodeAllReduce | None:
    """What a hybrid-sharding candidate runs across nodes, sending on ``meter``; None for a ZeRO++ (qgZ) one."""
    if config.shard_group != "node":
        return None
    if config.hybrid_gradient_bits is None:
        return ExactCrossNodeAllReduce(topology, meter)
    return QuantizedCrossNodeAllReduce(config, topology, meter)


class HybridReduceScatter:
    """Hybrid sharding's gradient path (presets hybrid, hybrid-q) run on a world-sharded unit's reduce-scatter input,
    so that it is measured on the very gradients the qgZ candidates get.

    Hybrid sharding's FSDP2 shards the unit over the ranks of one node, so its cross-node all-reduce quantizes the
    node layout of the unit's flat buffer, not the world layout FSDP hands this probe: the blocks would fall
    elsewhere. So the input (each rank's unreduced gradients, world layout) is laid out as FSDP2 on the node's mesh
    would (``relayout``), reduce-scattered exactly inside the node, and its node partial sum is reduced across nodes
    by the engine's own all-reduce (``cross_node.reduce``: the SUM over all ranks, as the exact reduce-scatter's;
    FSDP divides either by the world size afterwards). The node's shards of that sum are then gathered, a step of
    the emulation alone (not metered: the engine keeps the node layout), and this rank's world shard cut from them.
    """

    def __init__(self, cross_node: QuantizedCrossNodeAllReduce | ExactCrossNodeAllReduce, config: ZeroPPConfig,
                 topology: Topology, meter: CommMeter, unit: nn.Module, index: int) -> None:
        self.cross_node, self.topology, self.unit, self.index = cross_node, topology, unit, index
        self.full_precision_1d = config.gradient_full_precision_1d
        error_feedback = config.gradient_error_feedback
        self.intra_node = MeteredReduceScatter(meter)  # no byte of it crosses nodes
        # what Probe.start_window resets, as qgZ's ErrorFeedback: the residuals belong to the last window's gradients
        self.feedback = SimpleNamespace(reset=cross_node.reset_feedback) if error_feedback else None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> None:
        check_sum(op)
        topo = self.topology
        shapes = unit_shapes(self.unit, output_tensor.numel(), topo.world_size)
        node_layout = relayout(input_tensor.view(topo.world_size, -1), shapes, topo.node_size)
        partial = node_layout.new_empty(node_layout.shape[1])
        self.intra_node(partial, node_layout.reshape(-1), topo.intra_node_group, op)
        vectors = vector_positions(shapes, topo.node_size) if self.full_precision_1d else None
        total = self.cross_node.reduce(partial, self.index, vectors)
        gathered = total.new_empty(topo.node_size * total.numel())
        all_gather_single(gathered, total, topo.intra_node_group)
        output_tensor.copy_(relayout(gathered.view(topo.node_size, -1), shapes, topo.world_size)[topo.rank])


def gradient_candidate(config: ZeroPPConfig, cross_node: QuantizedCrossNodeAllReduce | ExactCrossNodeAllReduce | None,
                       topology: Topology, meter: CommMeter, unit: nn.Module,
                       index: int) -> QuantizedReduceScatter | HybridReduceScatter:
    """The unit's reduce-scatter under the gradient candidate ``config``: qgZ's (ZeRO++), or hybrid sharding's
    through ``cross_node``, the candidate's all-reduce (cross_node_all_reduce)."""
    if cross_node is None:
        return make_reduce_scatter(config, topology, meter, unit)
    return HybridReduceScatter(cross_node, config, topology, meter, unit, index)


class WidthRules:
    """The width-rule table: one inter-node quantization of the exact reduced shard under each of WIDTH_RULES (see
    the module docstring), plain and Adam-normalized. The history rule's moving average runs over every step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.history: dict[int, list] = {}  # unit -> [moving average of each block's squared absmax, updates]
        self.sums = Sums(len(WIDTH_RULES))
        self.scaled_sums = Sums(len(WIDTH_RULES))

    def observe(self, unit: int, exact: torch.Tensor, positions: list[torch.Tensor]):
        """This step's rotated row (1-D slices zeroed, zero-padded to whole blocks) and the history rule's keys,
        after folding this step's block scales into the moving average."""
        row = torch.zeros(num_blocks(exact.numel(), self.block_size) * self.block_size)
        kept = torch.cat(positions[:2])
        row[kept] = exact[kept].float()
        rotated = hadamard_rows(row[None], RULE_HADAMARD)
        absmax = rotated.view(1, -1, self.block_size).abs().amax(-1)
        average = self.history.setdefault(unit, [torch.zeros_like(absmax), 0])
        average[0].mul_(RULE_HISTORY_DECAY).add_(absmax.pow(2), alpha=1 - RULE_HISTORY_DECAY)
        average[1] += 1
        typical = (average[0] / (1 - RULE_HISTORY_DECAY ** average[1])).sqrt()
        return rotated, torch.where(absmax > 0, absmax / typical.clamp_min(1e-30), torch.zeros_like(absmax))

    def measure(self, probe: Probe, positions: list[torch.Tensor], exact: torch.Tensor, rotated: torch.Tensor,
                history_key: torch.Tensor, normalize: AdamNormalizer, second_moment: torch.Tensor) -> None:
        length = rotated.shape[-1]
        absmax = rotated.view(1, -1, self.block_size).abs().amax(-1)
        second = torch.zeros(length, dtype=torch.float32)
        second[:second_moment.numel()] = second_moment.float()
        typical = second.view(1, -1, self.block_size).mean(-1).sqrt()  # the block's RMS gradient, as Adam knows it
        oracle_key = torch.where(absmax > 0, absmax / typical.clamp_min(1e-30), torch.zeros_like(absmax))
        normalized_exact = normalize(exact)
        rules = ((None, 0), (absmax, 0), (absmax, RULE_BITS), (absmax, 2), (history_key, 0), (oracle_key, 0))
        for r, (key, floor) in enumerate(rules):
            widths = (torch.full(absmax.shape, RULE_BITS, dtype=torch.int64) if key is None
                      else block_widths(key, length, RULE_BITS, self.block_size, floor))
            result = hadamard_rows(round_trip_with_widths(rotated, widths, self.block_size), RULE_HADAMARD)
            result = result[0, :exact.numel()].double()
            probe.classify(self.sums, r, positions[:2], result, exact)
            probe.classify(self.scaled_sums, r, positions[:2], normalize(result), normalized_exact)


class WeightProbe(AllGather):
    """A unit's exact all-gather; in a measured step's forward, also run by every candidate qwZ."""

    def __init__(self, probe: Probe, unit: nn.Module, exact: Any, topology) -> None:
        self.probe, self.unit, self.exact = probe, unit, exact
        self.candidates = [make_all_gather(candidate_config(overrides), topology, meter, unit)
                           for overrides, meter in zip(WEIGHT_CANDIDATES.values(), probe.weight_meters)]

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.exact.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        work = self.exact(output_tensor, input_tensor, group, async_op=async_op)
        if not self.probe.active or allgather_kind() != "fwd_allgather":
            return work
        if work is not None:
            work.wait()  # FSDP waits for it again: a finished work's wait returns at once
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        shard_numel = input_tensor.numel()
        positions = self.probe.classes.positions(self.unit, False, shard_numel, world)
        exact_rows = output_tensor.view(world, shard_numel)
        for c, candidate in enumerate(self.candidates):
            result = torch.empty_like(output_tensor)
            rows = result.view(world, shard_numel)
            rows[rank].copy_(exact_rows[rank])  # FSDP's input is this rank's slot of the output
            candidate(result, rows[rank], group, async_op=False)
            for r in range(world):
                self.probe.classify(self.probe.weight_sums, c, positions, rows[r], exact_rows[r])
        return work


def install(model: nn.Module, candidates: dict[str, dict[str, Any]]) -> Probe:
    state = zeropp_state(model)
    if state.config.stage != 3 or state.config.quantized_weights or state.config.quantized_gradients:
        raise SystemExit(f"the fidelity baseline must be plain ZeRO-3 (stage 3, no qwZ/qgZ), got {state.config}")
    probe = Probe(model, candidates)
    for index, (unit, gather, reduce_scatter) in enumerate(zip(fsdp_modules(model), state.all_gathers,
                                                              state.reduce_scatters)):
        gradients = GradientProbe(probe, unit, index, reduce_scatter, state.topology)
        unit.set_custom_all_gather(WeightProbe(probe, unit, gather, state.topology))
        unit.set_custom_reduce_scatter(gradients)
        probe.reduce_scatters.append(gradients)
    return probe


def measured_steps(starts: list[int], window: int) -> dict[int, tuple[int, int]]:
    """step -> (the index of its window in ``starts``, how many steps of the window it completes); 0-based global
    steps."""
    steps: dict[int, tuple[int, int]] = {}
    for w, start in enumerate(starts):
        for step in range(start, start + window):
            steps[step] = (w, step - start + 1)
    return steps


def horizons(window: int) -> list[int]:
    """The numbers of steps into a window after which the summed error is recorded: powers of two, and the window."""
    return sorted({2 ** k for k in range(window.bit_length()) if 2 ** k <= window} | {window})


def build_trainer(recipe_path: str, global_batch: int, workdir: str, callbacks: list,
                  zeropp: dict[str, Any] | None = None) -> Any:
    """The recipe's ZeroPPTrainer as fidelity runs it: ``global_batch`` sequences per step over this world, no
    evaluation, checkpoint or log during training; ``zeropp`` replaces the recipe's engine config (the tests train
    the engine's own qgZ this way, to compare with a driven run)."""
    recipe = load_recipe(Path(recipe_path))
    world = dist.get_world_size()
    if global_batch % world:
        raise SystemExit(f"--global-batch {global_batch} does not split over {world} ranks")
    train, validation, vocab = build_datasets(recipe["data"])
    training = {**recipe["training"], "output_dir": workdir, "per_device_train_batch_size": global_batch // world,
                "eval_strategy": "no", "save_strategy": "no", "logging_steps": 10_000, "report_to": "none",
                "dataloader_num_workers": 0}
    if zeropp is not None:
        training["zeropp"] = zeropp
    torch.manual_seed(training["seed"])
    model = build_model(recipe["model"], vocab, int(recipe["data"]["seq_len"]))
    return hf_zeropp.ZeroPPTrainer(model=model, args=hf_zeropp.ZeroPPTrainingArguments(**training),
                                   train_dataset=train, eval_dataset=validation, callbacks=callbacks)


def run_rank(recipe_path: str, starts: list[int], window: int, global_batch: int, workdir: str,
             candidate_names: list[str], drive: str | None = None) -> dict:
    from transformers import TrainerCallback

    steps = measured_steps(starts, window)
    recorded = set(horizons(window))
    last = max(steps)
    candidates = {name: GRADIENT_CANDIDATES[name] for name in candidate_names}
    per_step: dict[int, dict[str, list]] = {}
    windows: list[dict] = []  # per window and horizon: the summed error so far

    class Measure(TrainerCallback):
        probe: Probe | None = None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if self.probe is None:
                self.probe = install(model, candidates)
                self.probe.drive = None if drive is None else candidate_names.index(drive)
            self.probe.optimizer = kwargs["optimizer"]
            step = state.global_step
            if steps.get(step, (0, 0))[1] == 1:
                self.probe.start_window()
            self.probe.active = step in steps

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step - 1
            if not self.probe.active:
                return
            self.probe.active = False
            self.probe.weigh_by_adam()  # on_step_end runs after the optimizer step
            scaled = self.probe.scaled_gradient_sums.reduce_and_reset().tolist()
            surprise, delivery = self.probe.reduce_error_location()
            self.probe.window_scaled &= self.probe.scaled
            per_step[step] = {"gradients": self.probe.gradient_sums.reduce_and_reset().tolist(),
                              "weights": self.probe.weight_sums.reduce_and_reset().tolist(),
                              "adam_scaled_gradients": scaled if self.probe.scaled else None,
                              "surprise": surprise if self.probe.scaled else None,
                              "delivery": delivery if self.probe.scaled and drive is not None else None,
                              "width_rules": self.probe.rules.sums.reduce_and_reset().tolist(),
                              "adam_scaled_width_rules": (self.probe.rules.scaled_sums.reduce_and_reset().tolist()
                                                          if self.probe.scaled else None)}
            index, into = steps[step]
            if into in recorded:
                windows.append({"window": index, "horizon": into, "errors": self.probe.window_error().tolist(),
                                "scaled": self.probe.window_scaled})
            if step >= last:
                control.should_training_stop = True

    measure = Measure()
    trainer = build_trainer(recipe_path, global_batch, workdir, [measure])
    parameters = list(trainer.model.parameters())
    model = (f"{type(trainer.model).__name__}, {sum(p.numel() for p in parameters):,} parameters "
             f"({sum(p.numel() for p in parameters if p.dim() == 1):,} in 1-D ones)")
    trainer.train()
    probe = measure.probe
    measured = len(per_step)
    ran = [trainer.state.global_step if c == probe.drive else measured for c in range(len(candidates))]
    return {
        "model": model,
        "gradient_candidates": candidate_names,
        "drive": drive,
        "validation_loss": trainer.evaluate()["eval_loss"],
        "last_step": trainer.state.global_step,
        "steps": per_step,
        "windows": windows,
        "gradient_inter_node_mb": [m.stats()["total"]["inter_node"] / n / 1e6
                                   for m, n in zip(probe.gradient_meters, ran)],
        "weight_inter_node_mb": [m.stats()["total"]["inter_node"] / measured / 1e6 for m in probe.weight_meters],
    }


def summarize(result: dict) -> dict:
    """Means (and min/max) over the measured steps of each metric, per candidate and class."""
    def table(kind: str, names: list[str]) -> list[dict] | None:
        measured = [step[kind] for step in result["steps"].values() if step[kind] is not None]
        if not measured:
            return None
        stacked = torch.tensor(measured, dtype=torch.float64)
        rows = []
        for c, name in enumerate(names):
            row = {"name": name}
            for k, cls in enumerate(CLASSES):
                row[cls] = {"relative_error": stacked[:, c, k, 0].mean().item(),
                            "relative_error_range": [stacked[:, c, k, 0].min().item(),
                                                     stacked[:, c, k, 0].max().item()],
                            "cosine": stacked[:, c, k, 1].mean().item()}
            rows.append(row)
        return rows

    names = result["gradient_candidates"]
    gradients = table("gradients", names)
    scaled = table("adam_scaled_gradients", names)
    full = max(w["horizon"] for w in result["windows"])

    def summed(horizon: int, adam: bool) -> torch.Tensor | None:
        """Mean over the windows of the error summed over ``horizon`` steps, per candidate (all classes)."""
        errors = [w["errors"] for w in result["windows"] if w["horizon"] == horizon and (w["scaled"] or not adam)]
        return torch.tensor(errors, dtype=torch.float64)[:, :, -1, int(adam)].mean(0) if errors else None
    by_horizon = {h: (summed(h, False), summed(h, True)) for h in sorted({w["horizon"] for w in result["windows"]})}
    for c, row in enumerate(gradients):
        row["window_sum_error"] = by_horizon[full][0][c].item()
        row["summed_over_steps"] = {h: {"plain": plain[c].item(), "adam_normalized": None if adam is None
                                        else adam[c].item()} for h, (plain, adam) in by_horizon.items()}
        row["inter_node_mb_per_step"] = result["gradient_inter_node_mb"][c]
        if scaled is not None:
            row["adam_scaled"] = {cls: scaled[c][cls] for cls in CLASSES}
            adam = by_horizon[full][1]
            row["adam_scaled_window_sum_error"] = None if adam is None else adam[c].item()
    weights = table("weights", list(WEIGHT_CANDIDATES))
    for c, row in enumerate(weights):
        row["inter_node_mb_per_step"] = result["weight_inter_node_mb"][c]
    surprise = [step["surprise"] for step in result["steps"].values() if step["surprise"] is not None]
    if surprise:
        totals = torch.tensor(surprise, dtype=torch.float64).sum(0)
        energy, count = totals[-2], totals[-1]
        for c, row in enumerate(gradients):
            error = totals[c]
            elsewhere = (error[0] - error[1]) / (energy[0] - energy[1]).clamp_min(1e-300)
            row["error_on_surprised"] = {"share_of_squared_error": (error[1] / error[0].clamp_min(1e-300)).item(),
                                         "relative_error_elsewhere": elsewhere.sqrt().item()}
    delivery = [step["delivery"] for step in result["steps"].values() if step["delivery"] is not None]
    deliveries = None
    if delivery:  # recorded at the same steps as the surprise sums, which hold the driving option's whole error
        driving_error = max(totals[names.index(result["drive"])][0].item(), 1e-300)
        deliveries = {}
        for group, (elements, unseen, *shares, starved_error) in zip(
                ("surprised", "others"), torch.tensor(delivery, dtype=torch.float64).sum(0).tolist()):
            seen = max(elements - unseen, 1e-300)
            deliveries[group] = {"elements": elements,
                                 "share_without_earlier_gradient": unseen / max(elements, 1e-300),
                                 **{column: value / seen for column, value in zip(DELIVERY_COLUMNS[2:-1], shares)},
                                 DELIVERY_COLUMNS[-1]: starved_error / driving_error}
    rules = table("width_rules", list(WIDTH_RULES))
    scaled_rules = table("adam_scaled_width_rules", list(WIDTH_RULES))
    for c, row in enumerate(rules):
        if scaled_rules is not None:
            row["adam_scaled"] = {cls: scaled_rules[c][cls] for cls in CLASSES}
    return {"model": result["model"], "drive": result["drive"], "validation_loss": result["validation_loss"],
            "last_step": result["last_step"], "gradients": gradients, "weights": weights, "width_rules": rules,
            "surprised": None if not surprise else {"share_of_elements": (count[1] / count[0]).item(),
                                                    "share_of_normalized_energy": (energy[1] / energy[0]).item()},
            "deliveries": deliveries,
            "measured_steps": sorted(int(s) for s in result["steps"])}


def _cell(entry: dict) -> str:
    return f"{entry['relative_error']:.4f} ({entry['cosine']:.5f})"


def horizon_table(topology: str, summary: dict) -> list[str]:
    """The error of the gradients summed over the first h steps of each window, as h grows: an error that changes
    from step to step shrinks against the summed gradient, one that repeats (a bias) does not."""
    rows = summary["gradients"]
    spans = list(rows[0]["summed_over_steps"])
    if len(spans) < 2:
        return []
    lines = ["", f"### {topology}: the error of the gradients summed over h consecutive steps (all classes; "
             "plain, then Adam-normalized), mean over the windows", "",
             "| configuration | " + " | ".join(f"h = {h}" for h in spans) + " | "
             + " | ".join(f"Adam h = {h}" for h in spans) + f" | ZeRO++'s Adam error / this at h = {spans[-1]} |",
             "|---|" + "---:|" * (2 * len(spans) + 1)]
    reference = rows[0]["summed_over_steps"][spans[-1]]["adam_normalized"]
    for row in rows:
        cells = row["summed_over_steps"]
        adam = [cells[h]["adam_normalized"] for h in spans]
        lines.append(f"| {row['name']} | " + " | ".join(f"{cells[h]['plain']:.4f}" for h in spans) + " | "
                     + " | ".join("—" if a is None else f"{a:.4f}" for a in adam) + " | "
                     + ("—" if None in (reference, adam[-1]) else f"{reference / max(adam[-1], 1e-30):.2f}x") + " |")
    return lines


def surprise_table(topology: str, summary: dict) -> list[str]:
    """How much of each row's Adam-normalized error lies on the elements whose exact gradient surprises the run's
    second moment (AdamNormalizer.surprised), and the error on the rest."""
    if summary["surprised"] is None:
        return []
    share = summary["surprised"]
    lines = ["", f"### {topology}: where the Adam-normalized error lies: elements whose exact gradient exceeds "
             f"{SURPRISE:g}x the root of the run's second moment before the step "
             f"({share['share_of_elements']:.3%} of the elements, {share['share_of_normalized_energy']:.1%} of the "
             "normalized exact gradient's squared norm)", "",
             "| configuration | share of its squared error on those elements | relative error on the other elements |",
             "|---|---:|---:|"]
    for row in summary["gradients"]:
        cell = row["error_on_surprised"]
        lines.append(f"| {row['name']} | {cell['share_of_squared_error']:.1%} | "
                     f"{cell['relative_error_elsewhere']:.4f} |")
    return lines


def delivery_table(topology: str, summary: dict) -> list[str]:
    """Whether the driving option had starved the surprising elements before the step (Deliveries)."""
    deliveries = summary["deliveries"]
    if deliveries is None:
        return []
    lines = ["", f"### {topology}: what {summary['drive']!r} had delivered before the step (moving averages with "
             "Adam's beta2; the energy columns and the zero share over the elements that had an exact gradient "
             "before)", "",
             "| elements | count (all steps) | no exact gradient before | " + " | ".join(DELIVERY_COLUMNS[2:]) + " |",
             "|---|" + "---:|" * (len(DELIVERY_COLUMNS))]
    for group, cells in deliveries.items():
        lines.append(f"| {group} | {cells['elements']:,.0f} | {cells['share_without_earlier_gradient']:.1%} | "
                     + " | ".join(f"{cells[column]:.1%}" for column in DELIVERY_COLUMNS[2:]) + " |")
    return lines


def markdown(topology: str, summary: dict) -> str:
    steps = summary["measured_steps"]
    reference = summary["gradients"][0]["all"]["relative_error"]
    trained_on = ("the exact gradients (the ZeRO-3 baseline)" if summary["drive"] is None
                  else f"the gradients of {summary['drive']!r} (its own trajectory; forward weights exact)")
    lines = [f"### {topology}: gradients (qgZ result vs the exact reduce-scatter), {len(steps)} steps {steps}", "",
             f"model: {summary['model']}; trained on {trained_on}; validation loss after "
             f"{summary['last_step']} steps: {summary['validation_loss']:.4f}", "",
             "relative L2 error (cosine) per parameter class, mean over the measured steps; window sum = error of "
             "the gradients summed over each window", "",
             "| configuration | cross-node MB/step (rank 0) | matrices | embeddings | 1-D | all | "
             "ZeRO++'s error / this | window sum |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["gradients"]:
        lines.append(f"| {row['name']} | {row['inter_node_mb_per_step']:.3f} | "
                     + " | ".join(_cell(row[cls]) for cls in CLASSES)
                     + f" | {reference / max(row['all']['relative_error'], 1e-30):.2f}x | "
                       f"{row['window_sum_error']:.4f} |")
    if "adam_scaled" in summary["gradients"][0]:
        reference = summary["gradients"][0]["adam_scaled"]["all"]["relative_error"]
        lines += ["", f"### {topology}: gradients as Adam normalizes them (g / (sqrt(v_hat(g)) + eps), the "
                  "step of the run that consumes them): the error of the update direction", "",
                  "| configuration | matrices | embeddings | 1-D | all | ZeRO++'s error / this | window sum |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in summary["gradients"]:
            window = row["adam_scaled_window_sum_error"]
            lines.append(f"| {row['name']} | " + " | ".join(_cell(row["adam_scaled"][cls]) for cls in CLASSES)
                         + f" | {reference / max(row['adam_scaled']['all']['relative_error'], 1e-30):.2f}x | "
                         + ("—" if window is None else f"{window:.4f}") + " |")
    lines += horizon_table(topology, summary)
    lines += surprise_table(topology, summary)
    lines += delivery_table(topology, summary)
    rule_classes = ("matrices", "embeddings", "all")
    fixed = summary["width_rules"][0]
    scaled = "adam_scaled" in fixed
    lines += ["", f"### {topology}: per-block widths on the inter-node hop: one quantization of the exact shard "
              f"(Hadamard {RULE_HADAMARD}, 1-D left out, {RULE_BITS}-bit budget)", "",
              "relative L2 error per class"
              + (", then the same of the Adam-normalized gradients" if scaled else ""), "",
              "| width rule | " + " | ".join(rule_classes) + " | fixed's error / this |"
              + (" Adam: " + " | ".join(rule_classes) + " | fixed's error / this |" if scaled else ""),
              "|---|" + "---:|" * (8 if scaled else 4)]

    def ratio(row: dict, reference: dict) -> str:
        return f"{reference['all']['relative_error'] / max(row['all']['relative_error'], 1e-30):.2f}x"
    for row in summary["width_rules"]:
        line = (f"| {row['name']} | " + " | ".join(f"{row[c]['relative_error']:.4f}" for c in rule_classes)
                + f" | {ratio(row, fixed)} |")
        if scaled:
            line += (" " + " | ".join(f"{row['adam_scaled'][c]['relative_error']:.4f}" for c in rule_classes)
                     + f" | {ratio(row['adam_scaled'], fixed['adam_scaled'])} |")
        lines.append(line)
    lines += ["", f"### {topology}: weights (qwZ forward gather vs the exact one)", "",
              "| configuration | cross-node MB/step (rank 0) | matrices | embeddings | 1-D | all |",
              "|---|---:|---:|---:|---:|---:|"]
    for row in summary["weights"]:
        lines.append(f"| {row['name']} | {row['inter_node_mb_per_step']:.3f} | "
                     + " | ".join(_cell(row[cls]) for cls in CLASSES) + " |")
    return "\n".join(lines) + "\n"


def parse_topology(text: str) -> tuple[int, int]:
    nodes, _, per_node = text.partition("x")
    if not (nodes.isdigit() and per_node.isdigit()) or int(nodes) < 2:
        raise SystemExit(f"--topologies entry {text!r} must be NODESxRANKS_PER_NODE with at least 2 nodes, e.g. 2x2")
    return int(nodes), int(per_node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes/gpt350m_pile/mini/zero3.yaml"))
    parser.add_argument("--topologies", default="2x2,2x4", help="NODESxRANKS_PER_NODE, comma-separated")
    parser.add_argument("--steps", default="100,300,550", help="first (0-based) step of each measured window")
    parser.add_argument("--window", type=int, default=8, help="consecutive steps measured per window")
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per step over all ranks")
    parser.add_argument("--candidate", action="append", default=None, metavar="NAME",
                        help="measure only these gradient candidates (repeat the flag; exact row names); the first "
                             f"row, {next(iter(GRADIENT_CANDIDATES))!r}, is always measured. Default: every row")
    parser.add_argument("--drive", default=None, metavar="NAME",
                        help="train on this gradient candidate's results instead of the exact ones, measuring every "
                             "candidate along its trajectory (qgZ only: the forward weights stay exact); it is "
                             "measured too. Default: the exact baseline")
    parser.add_argument("--out", default="out/fidelity")
    args = parser.parse_args(argv)
    reference = next(iter(GRADIENT_CANDIDATES))
    named = [("--candidate", name) for name in args.candidate or ()]
    if args.drive is not None:
        named.append(("--drive", args.drive))
    for flag, name in named:
        if name not in GRADIENT_CANDIDATES:
            raise SystemExit(f"{flag} {name!r} is not a row of the table; choose from "
                             + ", ".join(repr(name) for name in GRADIENT_CANDIDATES))
    candidates = list(GRADIENT_CANDIDATES) if args.candidate is None else [
        reference, *dict.fromkeys(name for name in [*args.candidate, args.drive] if name not in (reference, None))]
    starts = sorted(int(s) for s in args.steps.split(","))
    if args.window < 1 or any(b < a + args.window for a, b in zip(starts, starts[1:])):
        raise SystemExit(f"--steps {args.steps} with --window {args.window}: windows must not overlap")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report, results = [], {}
    for text in args.topologies.split(","):
        nodes, per_node = parse_topology(text)
        world = nodes * per_node
        raw = run_distributed(run_rank, world, args.recipe, starts, args.window, args.global_batch,
                              str(out / f"run_{text}"), candidates, args.drive, node_size=per_node,
                              timeout=3600)[0]
        results[text] = summarize(raw)
        report.append(markdown(f"{nodes} nodes x {per_node} ranks", results[text]))
        print(report[-1], flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(report))
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
