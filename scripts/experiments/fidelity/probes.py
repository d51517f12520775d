"""The FSDP2 comm hooks that run every candidate beside the exact reduce-scatter and all-gather in a measured
step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zeropp._compat import AllGather, ReduceScatter
from hf_zeropp.comm.comm_meter import CommMeter, allgather_kind
from hf_zeropp.comm.layout import parameter_spans
from hf_zeropp.comm.qwz import make_all_gather
from hf_zeropp.engine.state import fsdp_modules, zeropp_state

from .candidates import CLASSES, DELIVERY_COLUMNS, WEIGHT_CANDIDATES, candidate_config
from .hybrid_rows import cross_node_all_reduce, gradient_candidate
from .measures import AdamNormalizer, Deliveries, MeasuredGradient, ParameterClasses, Sums, adam_moments
from .width_rules import WidthRules


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


