#!/usr/bin/env python3
"""A cost model for a training step from measured bytes per collective: check it on the emulated clusters, then
ask it about clusters this machine cannot build.

    python -m scripts.benchmarks.cost_model out/bench_cluster_2x2 [out/bench_cluster_2x4 ...] [--out out/predict]

Each argument is a ``scripts/benchmarks/cluster.py`` output folder (its ``results.json``, one topology, several links,
the unshaped link among them). For every configuration the model takes, from that run:

* ``T0``: the step time on the unshaped link (compute plus communication at memory speed);
* per collective kind, the logical bytes per step from ``comm_stats`` (for stock FSDP2, derived from its units),
  turned into wire bytes on each node's link with gloo's algorithm factors (scripts/benchmarks/wire.py; a ring
  all-gather and NCCL's ring carry the same bytes across a node boundary).

and predicts the step time at link rate ``B`` (bytes/s) as

    T(B) = T0 + blocking / B + max(0, forward / B - T0 / 3) + max(0, backward / B - 2 T0 / 3)

``blocking`` is the wire bytes of collectives the host waits for before computing on (every collective of stock
FSDP2 on gloo, whose gathers are synchronous on CPU; hf_zeropp's gradient reduction, which FSDP calls
synchronously); ``forward`` and ``backward`` those of hf_zeropp's prefetched gathers, issued one unit ahead, which
can hide only behind the compute of their own pass: a third of the step for forward, two thirds for backward (a
backward pass costs two forwards). The prediction error against every shaped link's measured median is printed
per configuration.

Then the same model, with NCCL's streams (everything overlappable: ``T = max(compute, communication)``; the sum
is printed as the no-overlap bound), for the ZeRO++ paper's cluster: GPT-style models of 18B and 138B parameters,
1k and 2k tokens per GPU, 8 GPUs per node, 100 and 400 Gbit/s per node across nodes, NVLink inside. Compute per
step is ``6 x parameters x tokens per GPU / achieved FLOP/s`` (``--gpu-tflops``, default 40: what a V100 reaches
in large-model training, the paper's hardware); bytes per collective kind follow ZeRO-3 (forward and backward
all-gathers of M = 2 bytes x parameters, reduce-scatter of M) and ZeRO++ (INT8 forward gather 0.5 M + scales,
hpZ backward gather inside the node, qgZ INT4 0.25 M + scales across nodes), the fractions measured here.

Writes ``predictions.json``, ``predictions.md`` and ``speedup_vs_link.png`` (measured points and the model's
curves of ZeRO++'s speedup over stock FSDP2 and over ZeRO-3 against link rate) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


from .analysis import link_bytes_per_s
from .wire import wire_factors

FORWARD_GATHERS = ("fwd_allgather", "frozen_allgather")
BACKWARD_GATHERS = ("bwd_allgather",)
PAPER_MODELS = {"18B": 18e9, "138B": 138e9}
PAPER_TOKENS = (1024, 2048)
PAPER_LINKS_GBIT = (100, 400)
PAPER_GPUS_PER_NODE = 8
PAPER_NODES = 48  # 384 GPUs, the paper's largest runs; the ratios barely depend on it past a few nodes
NVLINK_BYTES_PER_S = 150e9  # V100 NVLink, per GPU and direction


def wire_by_kind(row: dict, world: int, node_size: int) -> dict[str, float]:
    """Wire bytes per node per step on the link, per collective kind (the mean node)."""
    factors = wire_factors(world, node_size)
    nodes = world // node_size
    return {kind: logical * factors.get(kind, 1.0) / nodes
            for kind, logical in row.get("logical_inter_by_kind_per_step", {}).items()}


def split_blocking(name: str, by_kind: dict[str, float]) -> tuple[float, float, float]:
    """(blocking, forward-overlappable, backward-overlappable) wire bytes per node per step on CPU/gloo."""
    if name == "FSDP2":  # stock: synchronous gathers and reduce-scatter on CPU
        return sum(by_kind.values()), 0.0, 0.0
    forward = sum(v for k, v in by_kind.items() if k in FORWARD_GATHERS)
    backward = sum(v for k, v in by_kind.items() if k in BACKWARD_GATHERS)
    return sum(by_kind.values()) - forward - backward, forward, backward


def predict_step(t0: float, blocking: float, forward: float, backward: float, rate: float) -> float:
    return t0 + blocking / rate + max(0.0, forward / rate - t0 / 3) + max(0.0, backward / rate - 2 * t0 / 3)


def validate(results: dict) -> list[dict]:
    """Predicted vs measured median step for every configuration and shaped link of one bench_cluster run."""
    links = results["links"]
    if "none" not in links:
        raise SystemExit("the run has no unshaped link ('none'): the model needs its step times as T0")
    settings = results["settings"]
    world = settings["nodes"] * settings["nproc_per_node"]
    node_size = settings["nproc_per_node"]
    out = []
    for link, data in links.items():
        rate = link_bytes_per_s(link)
        if rate is None:
            continue
        for name, row in data["rows"].items():
            reference = links["none"]["rows"].get(name)
            if reference is None or "logical_inter_by_kind_per_step" not in reference:
                continue
            predicted = predict_step(reference["median_step_s"],
                                     *split_blocking(name, wire_by_kind(reference, world, node_size)), rate)
            out.append({"topology": f"{world // node_size}x{node_size} {settings['precision']}", "link": link,
                        "config": name,
                        "measured_s": row["median_step_s"], "predicted_s": predicted,
                        "error": predicted / row["median_step_s"] - 1})
    return out


def measured_fractions(results: dict) -> dict[str, float]:
    """ZeRO++'s cross-node bytes per model byte M, from the run's meter: the forward gather (INT8 codes, scales, the
    1-D parameters in bf16) and the 1-D parameters' full-precision reduce-scatter as fractions of ZeRO-3's world
    collectives, and qgZ's inter-node hop as the fraction of M a node sends across per step, per (n - 1) / n."""
    settings = results["settings"]
    nodes, node_size = settings["nodes"], settings["nproc_per_node"]
    world = nodes * node_size
    rows = results["links"]["none"]["rows"]
    zero3, zeropp = rows["ZeRO-3"]["logical_inter_by_kind_per_step"], rows["ZeRO++"]["logical_inter_by_kind_per_step"]
    # every rank's share of a world collective of M crosses to (world - node_size) of its peers: M (g - d) / g
    model_bytes = zero3["grad_reduce_scatter"] / world / ((world - node_size) / world)
    hop_per_node = zeropp.get("qgz_inter", 0) / nodes
    return {"forward": zeropp["fwd_allgather"] / zero3["fwd_allgather"],
            "gradients_1d": zeropp.get("qgz_1d_full_precision", 0) / zero3["grad_reduce_scatter"],
            "gradients_hop": hop_per_node / (model_bytes * (nodes - 1) / nodes)}


def paper_step(params: float, tokens: int, link_gbit: float, fractions: dict[str, float] | None, tflops: float,
               latency_s: float) -> dict[str, float]:
    """Compute and communication seconds per step on the paper's cluster (ZeRO-3 if ``fractions`` is None)."""
    nodes, d = PAPER_NODES, PAPER_GPUS_PER_NODE
    g = nodes * d
    model_bytes = 2 * params
    compute = 6 * params * tokens / (tflops * 1e12)
    link = link_gbit * 1e9 / 8
    ring = (g - 1) / g  # a ring collective of M puts (g - 1) / g M on each node's link
    if fractions is None:
        cross = 3 * ring * model_bytes
        inside = 0.0
    else:
        cross = ((fractions["forward"] + fractions["gradients_1d"]) * ring
                 + fractions["gradients_hop"] * (nodes - 1) / nodes) * model_bytes
        # per GPU over its NVLink: hpZ's backward gather (M) and qgZ's INT4 first hop (M / 4)
        inside = 1.25 * model_bytes * (d - 1) / d
    communication = cross / link + inside / NVLINK_BYTES_PER_S + latency_s
    return {"compute_s": compute, "communication_s": communication,
            "step_s": max(compute, communication), "no_overlap_step_s": compute + communication}


def paper_table(fractions: dict[str, float], tflops: float, latency_s: float) -> list[dict]:
    out = []
    for model, params in PAPER_MODELS.items():
        for tokens in PAPER_TOKENS:
            for gbit in PAPER_LINKS_GBIT:
                zero3 = paper_step(params, tokens, gbit, None, tflops, latency_s)
                zeropp = paper_step(params, tokens, gbit, fractions, tflops, latency_s)
                out.append({"model": model, "tokens_per_gpu": tokens, "link_gbit": gbit,
                            "zero3_step_s": zero3["step_s"], "zeropp_step_s": zeropp["step_s"],
                            "speedup": zero3["step_s"] / zeropp["step_s"],
                            "speedup_no_overlap": zero3["no_overlap_step_s"] / zeropp["no_overlap_step_s"],
                            "compute_s": zero3["compute_s"]})
    return out


def speedup_curves(results: dict, rates: list[float]) -> dict[str, list[float]]:
    """The model's ZeRO++ speedup over FSDP2 and over ZeRO-3 at each link rate (bytes/s)."""
    settings = results["settings"]
    world, node_size = settings["nodes"] * settings["nproc_per_node"], settings["nproc_per_node"]
    rows = results["links"]["none"]["rows"]
    steps = {}
    for name in ("FSDP2", "ZeRO-3", "ZeRO++"):
        split = split_blocking(name, wire_by_kind(rows[name], world, node_size))
        steps[name] = [predict_step(rows[name]["median_step_s"], *split, r) for r in rates]
    return {"vs FSDP2": [f / z for f, z in zip(steps["FSDP2"], steps["ZeRO++"])],
            "vs ZeRO-3": [f / z for f, z in zip(steps["ZeRO-3"], steps["ZeRO++"])],
            "steps": steps}


def matching_slowdown(results: dict) -> float:
    """How many times slower a link ZeRO++ can run on and still match ZeRO-3 at 100 Mbit/s (the model's answer to
    the paper's "ZeRO++ on a 4x slower link matches ZeRO-3")."""
    settings = results["settings"]
    world, node_size = settings["nodes"] * settings["nproc_per_node"], settings["nproc_per_node"]
    rows = results["links"]["none"]["rows"]
    zero3_at_100 = predict_step(rows["ZeRO-3"]["median_step_s"],
                                *split_blocking("ZeRO-3", wire_by_kind(rows["ZeRO-3"], world, node_size)), 12.5e6)
    split = split_blocking("ZeRO++", wire_by_kind(rows["ZeRO++"], world, node_size))
    low, high = 1.0, 1e4  # slowdown factor; ZeRO++'s step grows as the link slows
    if predict_step(rows["ZeRO++"]["median_step_s"], *split, 12.5e6) > zero3_at_100:
        return 1.0
    for _ in range(60):
        mid = math.sqrt(low * high)
        if predict_step(rows["ZeRO++"]["median_step_s"], *split, 12.5e6 / mid) > zero3_at_100:
            high = mid
        else:
            low = mid
    return low


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharex=True)
    rates = [10e6 / 8 * 10 ** (i / 20) for i in range(61)]  # bytes/s: 10 Mbit/s .. 10 Gbit/s
    for index, (topology, results) in enumerate(runs.items()):
        color = f"C{index % 10}"  # every run gets its own colour (a fixed list of four dropped a fifth run)
        curves = speedup_curves(results, rates)
        for ax, key, base in zip(axes, ("vs FSDP2", "vs ZeRO-3"), ("FSDP2", "ZeRO-3")):
            ax.plot([r * 8 / 1e6 for r in rates], curves[key], color=color, label=f"{topology} model")
            points = [(link_bytes_per_s(link) * 8 / 1e6, data["rows"][base]["median_step_s"]
                       / data["rows"]["ZeRO++"]["median_step_s"])
                      for link, data in results["links"].items() if link_bytes_per_s(link)
                      and base in data["rows"] and "ZeRO++" in data["rows"]]
            ax.scatter(*zip(*points), color=color, marker="o", label=f"{topology} measured")
    for ax, title in zip(axes, ("ZeRO++ speedup per step over stock FSDP2", "ZeRO++ speedup per step over ZeRO-3")):
        ax.set_xscale("log")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xlabel("cross-node link rate (Mbit/s per node)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(validation: list[dict], paper: list[dict], slowdowns: dict[str, float], args) -> str:
    lines = ["| topology | link | config | measured s | predicted s | error |", "|---|---|---|---:|---:|---:|"]
    for v in validation:
        lines.append(f"| {v['topology']} | {v['link']} | {v['config']} | {v['measured_s']:.3f} | "
                     f"{v['predicted_s']:.3f} | {v['error'] * 100:+.1f} % |")
    errors = [abs(v["error"]) for v in validation]
    if errors:
        lines += ["", f"Prediction error over {len(errors)} measured steps: median {statistics.median(errors) * 100:.1f} %, "
                      f"max {max(errors) * 100:.1f} %."]
    lines += ["", "ZeRO++ on an N-times slower link matches ZeRO-3 at 100 Mbit/s (model): "
              + ", ".join(f"{t} N = {s:.1f}" for t, s in slowdowns.items()) + ".", "",
              f"Paper's cluster ({PAPER_NODES} nodes x {PAPER_GPUS_PER_NODE} GPUs, {args.gpu_tflops:.0f} TFLOP/s "
              f"achieved per GPU, {args.latency_ms:.0f} ms latency per step; ZeRO++/ZeRO-3 speedup with overlap, "
              "and without):", "",
              "| model | tokens/GPU | link | compute s | ZeRO-3 s | ZeRO++ s | speedup | no-overlap speedup |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in paper:
        lines.append(f"| {p['model']} | {p['tokens_per_gpu']} | {p['link_gbit']} Gbit/s | {p['compute_s']:.2f} | "
                     f"{p['zero3_step_s']:.2f} | {p['zeropp_step_s']:.2f} | {p['speedup']:.2f}x | "
                     f"{p['speedup_no_overlap']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output folders of scripts.benchmarks.cluster")
    parser.add_argument("--out", type=Path, default=Path("out/predict"))
    parser.add_argument("--gpu-tflops", type=float, default=40.0, help="achieved FLOP/s per GPU, in TFLOP/s")
    parser.add_argument("--latency-ms", type=float, default=5.0,
                        help="fixed communication latency per step on the paper's cluster, ms")
    args = parser.parse_args(argv)
    runs = {}
    for folder in args.runs:
        results = json.loads((folder / "results.json").read_text())
        settings = results["settings"]
        runs[f"{settings['nodes']}x{settings['nproc_per_node']} {settings['precision']}"] = results
    validation = [v for results in runs.values() for v in validate(results)]
    slowdowns = {topology: matching_slowdown(results) for topology, results in runs.items()}
    # the paper's M is 16-bit weights and gradients: ZeRO++'s fractions of it come from a bf16 run
    half = [results for results in runs.values() if results["settings"]["precision"] == "bf16"]
    if not half:
        raise SystemExit("give at least one bf16 run: the paper's byte fractions are of 16-bit weights")
    fractions = measured_fractions(half[0])
    paper = paper_table(fractions, args.gpu_tflops, args.latency_ms / 1e3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "predictions.json").write_text(json.dumps(
        {"validation": validation, "matching_slowdown": slowdowns, "fractions": fractions, "paper": paper}, indent=2))
    table = markdown(validation, paper, slowdowns, args)
    (args.out / "predictions.md").write_text(table)
    plot(runs, args.out / "speedup_vs_link.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
