"""Table 5 / Fig. 14 analog: final validation loss per configuration, gap to the baseline, and the loss curves.

    python -m scripts.experiments.report_convergence out/gpt_mini --baseline zero3 [--out out/gpt_mini/report]

Reads every ``<run>/metrics.jsonl`` under the given folders (written by scripts/train_gpt.py); unfinished runs are
skipped. Runs of one recipe
with different seeds are aggregated: the final loss is reported as mean ± sample standard deviation over seeds, and
the gap to the baseline is computed per seed against the baseline run of the same seed (same initialisation and
data order), then averaged — at mini scale the seed-to-seed spread is larger than the effects being measured, so
only paired gaps are comparable. With two or more paired seeds the gap also gets its 95 % confidence interval
(Student's t over the per-seed gaps: the seeds are the independent samples). Writes the markdown table to ``<out>/table.md`` and the mean validation-loss curves
(band: min–max over seeds) to ``<out>/validation_loss.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PAPER_TABLE5 = {"zero3": 2.1218, "zeropp": 2.1656, "zeropp_qgz_half": 2.1340, "zeropp_no_qgz": 2.1217}


def _seed_of(records: list[dict], path: Path) -> int:
    """The run's seed: recorded by train_gpt.py, else a ``seed<N>`` folder in its path, else 0."""
    if "seed" in records[0]:
        return int(records[0]["seed"])
    for part in path.parts:
        match = re.fullmatch(r"seed(\d+)", part)
        if match:
            return int(match.group(1))
    return 0


def load_runs(folders: list[Path]) -> dict[str, dict[int, dict]]:
    """recipe name -> seed -> {curve, final, runtime, path}."""
    runs: dict[str, dict[int, dict]] = defaultdict(dict)
    for folder in folders:
        for path in sorted(folder.glob("**/metrics.jsonl")):
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
            if not evals:
                continue
            name = records[0].get("recipe", path.parent.name)
            seed = _seed_of(records, path)
            if not any("train_runtime" in r for r in records):
                print(f"skipping {path}: the run has not finished (no train_runtime record)", file=sys.stderr)
                continue
            if seed in runs[name]:
                raise SystemExit(f"two runs of {name!r} with seed {seed}: {runs[name][seed]['path']} and {path}; "
                                 "pass only one of them")
            runtime = next((r["train_runtime"] for r in records if "train_runtime" in r), None)
            runs[name][seed] = {"curve": sorted(dict(evals).items()), "final": evals[-1][1], "runtime": runtime,
                                "path": str(path)}
    return dict(runs)


def _mean_spread(values: list[float], digits: int, signed: bool = False) -> str:
    """mean ± sample standard deviation (the mean alone for one value)."""
    mean = f"{statistics.fmean(values):{'+' if signed else ''}.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ± {statistics.stdev(values):.{digits}f}"


def student_t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """The t distribution's quantile, by bisection on its CDF (Simpson's rule on the density): the confidence
    interval needs it for 1-7 degrees of freedom, where the normal quantile would understate the interval by up to
    6x, and the project does not depend on scipy."""
    if not 0.5 <= probability < 1 or degrees_of_freedom < 1:
        raise ValueError(f"need 0.5 <= probability < 1 and degrees_of_freedom >= 1, got {probability}, "
                         f"{degrees_of_freedom}")
    nu = degrees_of_freedom
    log_norm = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)

    def density(x: float) -> float:
        return math.exp(log_norm - (nu + 1) / 2 * math.log1p(x * x / nu))

    def cdf(x: float, intervals: int = 2000) -> float:
        h = x / intervals
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, intervals))
        return 0.5 + h / 3 * (density(0.0) + inner + density(x))

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


def confidence_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Two-sided Student's t interval for the mean of ``values`` (two or more)."""
    mean, n = statistics.fmean(values), len(values)
    half = student_t_quantile(0.5 + level / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean - half, mean + half


def table(runs: dict[str, dict[int, dict]], baseline: str, paper: bool = True) -> str:
    """The markdown table; ``paper``: a column with ZeRO++ Table 5's figure for each row of the paper's study."""
    if baseline not in runs:
        raise SystemExit(f"baseline run {baseline!r} not found among {sorted(runs)}")
    base = runs[baseline]
    header = ("| configuration | seeds | final validation loss | gap to baseline | 95 % CI of the gap | gap per seed "
              + ("| paper (Table 5) " if paper else "") + "| train time |")
    lines = [header, "|---|---:|---:|---:|---:|---|" + ("---:|" if paper else "") + "---:|"]
    for name, by_seed in sorted(runs.items(), key=lambda item: (item[0] != baseline, item[0])):
        seeds = sorted(by_seed)
        paired = [s for s in seeds if s in base]
        gaps = [(by_seed[s]["final"] - base[s]["final"]) / base[s]["final"] * 100 for s in paired]
        gap_text = _mean_spread(gaps, 2, signed=True) + " %" if gaps else "no paired baseline"
        per_seed = ", ".join(f"{gap:+.2f}" for gap in gaps) if len(gaps) > 1 else "—"
        interval = "[{:+.2f}, {:+.2f}] %".format(*confidence_interval(gaps)) if len(gaps) > 1 else "—"
        reported = PAPER_TABLE5.get(name)
        paper_text = f"{reported:.4f} ({(reported - PAPER_TABLE5['zero3']) / PAPER_TABLE5['zero3'] * 100:+.2f} %)" \
            if reported else "diverged" if "nonblocked" in name else "—"
        runtimes = [by_seed[s]["runtime"] for s in seeds if by_seed[s]["runtime"]]
        runtime = f"{statistics.fmean(runtimes):.0f} s" if runtimes else "—"
        finals = _mean_spread([by_seed[s]["final"] for s in seeds], 4)
        paper_cell = f"| {paper_text} " if paper else ""
        lines.append(f"| {name} | {','.join(map(str, seeds))} | {finals} | {gap_text} | {interval} | {per_seed} "
                     f"{paper_cell}| {runtime} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, by_seed in sorted(runs.items()):
        curves = [dict(run["curve"]) for run in by_seed.values()]
        steps = sorted(set.intersection(*(set(curve) for curve in curves)))
        values = [[curve[step] for curve in curves] for step in steps]
        line, = axes.plot(steps, [statistics.fmean(v) for v in values], marker="o", markersize=3,
                          label=f"{name} (n={len(curves)})")
        if len(curves) > 1:
            axes.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                              alpha=0.15)
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss (mean over seeds)")
    axes.set_title("Validation loss (ZeRO++ Fig. 14 analog)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--baseline", default="zero3")
    parser.add_argument("--out", type=Path, default=None, help="default: <first folder>/report")
    parser.add_argument("--paper", action=argparse.BooleanOptionalAction, default=True,
                        help="the ZeRO++ Table 5 column (--no-paper for studies other than the GPT-350M one)")
    args = parser.parse_args()
    runs = load_runs(args.folders)
    if not runs:
        raise SystemExit(f"no metrics.jsonl with evaluations under {[str(f) for f in args.folders]}")
    out = args.out or args.folders[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    markdown = table(runs, args.baseline, args.paper)
    (out / "table.md").write_text(markdown + "\n")
    plot(runs, out / "validation_loss.png")
    print(markdown)
    print(f"\nwritten: {out / 'table.md'}, {out / 'validation_loss.png'}")


if __name__ == "__main__":
    main()
