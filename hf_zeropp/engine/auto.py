"""``zeropp: auto`` (``shard_group: auto``): measure the links when sharding starts and choose ZeRO-3, ZeRO++,
hybrid or hybrid-q, and the width of the quantized gradient, for this model on this cluster.

The probe (about a second) times an all-to-all inside the node and one across nodes, at a small size (the per-call
latency) and at sizes growing until one exchange takes 50 ms (the bytes per second each rank sends); then, with every
rank at once, as in training (ranks that share a device or a host's cores slow each other down), the quantization
kernels and an AdamW step, each on a million elements. Every rank measures; the slowest rank's numbers count, and
rank 0 decides and broadcasts, so every rank shards the same way. The model then predicts the part of each
candidate's step time that differs between them: the bytes each rank sends inside and across nodes (the counts
:func:`hf_zeropp.comm_stats` reports, derived from the parameter count and the candidate's widths), the number of
collective calls, the kernel time of its quantization, and its optimizer step, which hybrid sharding runs on
1/(ranks per node) of the model where ZeRO runs it on 1/world. The forward and backward compute is the same for
every candidate, so it drops out of the comparison. ZeRO-3 is kept unless another candidate is predicted at least
``MARGIN`` faster; hybrid is a candidate only when the model's states divided by the ranks of a node fit the memory
free per rank. A quantized choice then gets INT8 gradients instead of INT4 unless INT4 is predicted ``MARGIN``
faster: on a link fast enough for that, accuracy is cheap. Where the candidate has a sibling with the gradient in
full precision (hybrid-q's is hybrid) that is predicted no slower than the INT8 one, it gets that.

The model cannot see how much communication hides behind compute, and on fast links its predictions were 10-30 %
off, the wrong way round as often as not (docs/results/2026-11-27-hybrid-sharding.md). So the prediction only orders
the candidates and rules out the clearly slower ones; :mod:`hf_zeropp.engine.auto_trial` times the rest on the model's
own first batch and keeps the fastest. The rule above decides alone where that trial cannot run.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import kernels
from ..config.config import ZeroPPConfig
from ..config.config_rules import AUTO_KEEPS
from ..comm.hybrid import hybrid_fits
from ..config.presets import PRESETS
from ..comm.topology import Topology

# What auto chooses among, by the name it reports: the presets, and the quantized ones with the gradient widened to
# INT8 (chosen where the link makes the extra bytes cheap: 18x finer steps for twice the gradient's bytes). It never
# narrows a width below its preset's (INT4 weights, say): that would trade accuracy the user did not ask for.
CANDIDATES: dict[str, dict] = {
    "zero3": PRESETS["zero3"],
    "zeropp": PRESETS["zeropp"],
    "zeropp int8 gradients": {**PRESETS["zeropp"], "gradient_bits": 8},
    "hybrid": PRESETS["hybrid"],
    "hybrid-q": PRESETS["hybrid-q"],
    "hybrid-q int8": {**PRESETS["hybrid-q"], "hybrid_gradient_bits": 8},
}
WIDER = {"zeropp": "zeropp int8 gradients", "hybrid-q": "hybrid-q int8"}  # each quantized preset's INT8 variant
# an INT8 variant's sibling with the gradient in full precision: taken instead of it where predicted no slower
FULL_PRECISION = {"hybrid-q int8": "hybrid"}
# A more accurate candidate gives way only to one predicted at least 10 % faster (ZeRO-3 to a quantized or hybrid
# one, INT8 gradients to INT4): the model sees no overlap of communication with compute, and on fast links, where
# every candidate's communication hides behind compute, its predictions were measured 10-20 % off
# (docs/results/2026-11-27-hybrid-sharding.md)
MARGIN = 0.10
PROBE_ENV = "ZEROPP_AUTO_PROBE"  # "0" turns the probe off: auto then keeps ZeRO-3 and says why
# bytes each rank sends to each peer: the latency's message, the first and the largest rate message; the rate
# message grows until one exchange takes _LONG seconds
_SMALL, _MEDIUM, _LARGE, _LONG = 1 << 10, 1 << 16, 1 << 24, 0.05
_COMPUTE_ELEMENTS = 1 << 20  # the size the kernels and the optimizer step are timed at: beyond the caches
_DTYPE_BYTES = {"no": 4, "fp32": 4, "bf16": 2, "fp16": 2}
_QUANTIZED = {8: 1 + 4 / 256, 4: 0.5 + 4 / 256}  # bytes per element by width, with one fp32 scale per 256


@dataclass(frozen=True)
class Links:
    """What the probe measured: per-call latency (s) and the bytes per second a rank sends, inside a node and across
    nodes; seconds per element to quantize and dequantize, and to take an AdamW step, with every rank at work."""

    intra_latency: float
    intra_rate: float
    inter_latency: float
    inter_rate: float
    quantize_seconds_per_element: float
    update_seconds_per_element: float

    def seconds(self, traffic: StepTraffic) -> float:
        """Calls and bytes per rank (``intra``, ``inter``, ``world`` calls pay the slower latency), kernels and the
        optimizer step."""
        calls, sent = traffic.calls, traffic.sent
        latency = (calls.get("intra", 0) * self.intra_latency + calls.get("inter", 0) * self.inter_latency
                   + calls.get("world", 0) * max(self.intra_latency, self.inter_latency))
        return (latency + sent.get("intra", 0.0) / self.intra_rate + sent.get("inter", 0.0) / self.inter_rate
                + traffic.quantized * self.quantize_seconds_per_element
                + traffic.updated * self.update_seconds_per_element)


@dataclass(frozen=True)
class StepTraffic:
    """One rank's work per step that differs between the candidates."""

    calls: dict[str, int]  # collective calls per group kind: intra, inter, world
    sent: dict[str, float]  # bytes sent inside and across nodes
    quantized: float  # elements quantized and dequantized
    updated: float  # parameters this rank's optimizer step updates


def probe_links(topology: Topology, device: torch.device) -> Links:
    """Time the node's and the cross-node group's all-to-all and the kernels; the slowest rank's numbers.

    The latency is the time of a 1 KiB exchange. The rate comes from the largest message that still takes less than
    ``_LONG`` seconds (growing fourfold from 64 KiB up to ``_LARGE``; the slowest rank decides when to stop, so all
    ranks exchange the same sizes): small messages would show the per-call cost, not the link's rate."""
    measured = []
    for group in (topology.intra_node_group, topology.inter_node_group):
        peers = dist.get_world_size(group)
        small = _time(lambda: _all_to_all(group, peers, _SMALL, device))
        size = _MEDIUM
        while True:
            large = _slowest(_time(lambda: _all_to_all(group, peers, size, device)), device)
            if large >= _LONG or size >= _LARGE:
                break
            size *= 4
        measured += [small, (peers - 1) * (size - _SMALL) / max(large - small, 1e-9)]
    values = torch.randn(_COMPUTE_ELEMENTS, device=device)
    quantize = _time_together(lambda: kernels.dequantize(*kernels.quantize(values, 4, 256), bits=4, block_size=256),
                              device)
    weights = nn.Parameter(values.clone())
    weights.grad = torch.randn_like(values)
    optimizer = torch.optim.AdamW([weights])
    update = _time_together(optimizer.step, device)
    # the slowest rank's latency and compute times, its lowest rate: rates travel as their inverse
    times = torch.tensor([measured[0], 1 / measured[1], measured[2], 1 / measured[3], quantize, update],
                         dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return Links(float(times[0]), 1 / float(times[1]), float(times[2]), 1 / float(times[3]),
                 float(times[4]) / _COMPUTE_ELEMENTS, float(times[5]) / _COMPUTE_ELEMENTS)


def _all_to_all(group: dist.ProcessGroup, peers: int, per_peer: int, device: torch.device) -> None:
    data = torch.empty(peers * per_peer, dtype=torch.uint8, device=device)
    dist.all_to_all_single(torch.empty_like(data), data, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (a world all-reduce), so every rank takes the same decision."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _time(run, repeats: int = 3, before_each=None) -> float:
    run()  # warm-up: connections and buffers
    samples = []
    for _ in range(repeats):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_together(run, device: torch.device) -> float:
    """:func:`_time` with every rank starting each repetition at once (a barrier before it), so that ranks sharing a
    device or a host's cores compete as they do in training."""
    def synchronized() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    def finished() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _time(finished, before_each=synchronized)


def step_traffic(config: ZeroPPConfig, topology: Topology, parameters: int, trainable: int,
                 units: int) -> StepTraffic:
    """One rank's calls, bytes sent, elements quantized and parameters updated for one step of stage 3 under the
    resolved ``config`` (a candidate: its sharding, its widths and dtypes), bytes by the meter's accounting."""
    w, g = _DTYPE_BYTES[config.mixed_precision], _DTYPE_BYTES[config.reduce_dtype]
    d, n, world = topology.node_size, topology.nodes, topology.world_size
    if config.shard_group == "node":
        node_data = 2 * parameters * w + trainable * g
        intra = node_data * (d - 1) / d
        if config.hybrid_gradient_bits is None:
            return StepTraffic({"intra": 3 * units, "inter": units},
                               {"intra": intra, "inter": 2 * trainable * g * (n - 1) / world}, 0.0, trainable / d)
        inter = 2 * trainable * _QUANTIZED[config.hybrid_gradient_bits] * (n - 1) / world
        return StepTraffic({"intra": 3 * units, "inter": 2 * units}, {"intra": intra, "inter": inter},
                           3.0 * trainable / d, trainable / d)
    intra_share, inter_share = (d - 1) / world, (world - d) / world  # of a world collective's buffer, per rank
    if not config.quantized_weights:
        data = 2 * parameters * w + trainable * g
        return StepTraffic({"world": 3 * units}, {"intra": data * intra_share, "inter": data * inter_share}, 0.0,
                           trainable / world)
    # ZeRO++: the forward gathers quantized weights over the world, hpZ's backward gathers over the node, qgZ's two
    # hops send the gradient inside the node, then its 1/node_size across
    forward = parameters * _QUANTIZED[config.weight_bits]
    intra_bits = config.gradient_intra_bits or config.gradient_bits
    sent = {"intra": forward * intra_share + parameters * w * (d - 1) / d
            + trainable * _QUANTIZED[intra_bits] * (d - 1) / d,
            "inter": forward * inter_share + trainable * _QUANTIZED[config.gradient_bits] * (n - 1) / world}
    return StepTraffic({"world": units, "intra": 2 * units, "inter": units}, sent,
                       parameters * 2.0 + trainable * 2.0, trainable / world)


def pick(seconds: dict[str, float], margin: float = MARGIN) -> str:
    """The candidate to take, given the step times (predicted, or measured by the trial) of those that fit: the
    fastest, unless it is not ``margin`` faster than ZeRO-3 (the error of those times); and a quantized one with INT8
    gradients unless INT4 is ``margin`` faster than that, or in full precision where that is no slower than INT8.
    A candidate missing from ``seconds`` (ruled out before it was timed) is never taken."""
    best = min(seconds, key=seconds.get)
    if "zero3" in seconds and seconds[best] > (1 - margin) * seconds["zero3"]:
        return "zero3"
    wider = WIDER.get(best)
    if wider not in seconds or seconds[best] <= (1 - margin) * seconds[wider]:
        return best
    full = FULL_PRECISION.get(wider)
    return full if full in seconds and seconds[full] <= seconds[wider] else wider


@dataclass(frozen=True)
class AutoPlan:
    """What the probe and the model decided when sharding started, for :mod:`hf_zeropp.engine.sharding` and the
    trial."""

    configs: dict[str, ZeroPPConfig]  # every candidate that fits, resolved with the user's kept options
    predicted: dict[str, float]  # their predicted seconds per step (empty where nothing was probed)
    optimizer_step: dict[str, float]  # the predicted optimizer step inside ``predicted``, which the trial adds
    choice: str  # the prediction's pick: what the model is sharded as where no trial runs
    reasoning: str  # what was measured and predicted, and why ``choice``

    @property
    def line(self) -> str:
        """The prediction's choice and why, as rank 0 prints it and ``comm_stats`` records it."""
        return f"auto: {self.choice} ({self.reasoning})"

    @property
    def trial_candidates(self) -> list[str]:
        """The candidates a trial would time, the predicted fastest first."""
        return sorted(self.predicted, key=self.predicted.get)


def choose(model: nn.Module, config: ZeroPPConfig, topology: Topology, device: torch.device,
           units: int) -> AutoPlan:
    """The candidates for ``shard_group: auto``, their predicted step times and the prediction's pick (a
    collective: every rank probes, rank 0's pick is broadcast)."""
    keep = {f: getattr(config, f) for f in AUTO_KEEPS}
    configs = {name: ZeroPPConfig.from_dict({**options, **keep}) for name, options in CANDIDATES.items()}

    def unprobed(why: str) -> AutoPlan:
        return AutoPlan({"zero3": configs["zero3"]}, {}, {}, "zero3", why)

    if topology.nodes == 1:
        return unprobed("a single node: no link between nodes to save bytes on")
    if os.environ.get(PROBE_ENV, "1") == "0":
        return unprobed(f"the link probe is off: {PROBE_ENV}=0")
    links = probe_links(topology, device)
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fits = hybrid_fits(model, topology, device)[0]
    configs = {name: c for name, c in configs.items() if fits or c.shard_group != "node"}
    traffic = {name: step_traffic(c, topology, parameters, trainable, units) for name, c in configs.items()}
    predicted = {name: links.seconds(t) for name, t in traffic.items()}
    optimizer_step = {name: t.updated * links.update_seconds_per_element for name, t in traffic.items()}
    names = list(CANDIDATES)
    choice = torch.tensor([names.index(pick(predicted))], device=device)
    dist.broadcast(choice, src=0)  # identical numbers on every rank; rank 0's word is final all the same
    best = names[int(choice)]
    fastest = min(predicted, key=predicted.get)
    widened = ""
    if best == WIDER.get(fastest):
        widened = f"; INT8 gradients: {fastest} is predicted less than {MARGIN:.0%} faster"
    elif best == FULL_PRECISION.get(WIDER.get(fastest)):
        widened = (f"; full-precision gradients: {fastest} is predicted less than {MARGIN:.0%} faster than "
                   f"{WIDER[fastest]}, and {best} no slower than that")
    alternatives = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in sorted(predicted.items(),
                                                                                         key=lambda kv: kv[1]))
    return AutoPlan(configs, predicted, optimizer_step, best, (
        f"predicted communication, quantization and optimizer step per step: {alternatives}; links "
        f"measured: intra-node {links.intra_rate / 1e6:.0f} MB/s + {links.intra_latency * 1e3:.2f} ms per call, "
        f"inter-node {links.inter_rate / 1e6:.0f} MB/s + {links.inter_latency * 1e3:.2f} ms per call; with every "
        f"rank at work, {links.quantize_seconds_per_element * 1e9:.1f} ns per element to quantize and dequantize, "
        f"{links.update_seconds_per_element * 1e9:.1f} ns per parameter for an AdamW step"
        + widened + ("" if fits else "; hybrid left out: the states do not fit a node")))
