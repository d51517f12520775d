"""Table 5 / Fig. 14 analog: final validation loss per configuration, gap to the baseline, and the loss curves.

    python scripts/report_convergence.py out/gpt_mini --baseline zero3 [--out out/gpt_mini/report]

Reads every ``<run>/metrics.jsonl`` under the given folders (written by scripts/train_gpt.py), prints a markdown
table — final validation loss, gap to the baseline in %, wall time — writes it to ``<out>/table.md`` and plots the
validation-loss curves to ``<out>/validation_loss.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAPER_TABLE5 = {"zero3": 2.1218, "zeropp": 2.1656, "zeropp_qgz_half": 2.1340, "zeropp_no_qgz": 2.1217}


def load_runs(folders: list[Path]) -> dict[str, dict]:
    runs = {}
    for folder in folders:
        for path in sorted(folder.glob("**/metrics.jsonl")):
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
            if not evals:
                continue
            name = records[0].get("recipe", path.parent.name)
            runtime = next((r["train_runtime"] for r in records if "train_runtime" in r), None)
            curve = sorted(dict(evals).items())
            runs[name] = {"curve": curve, "final": evals[-1][1], "runtime": runtime, "path": str(path)}
    return runs


def table(runs: dict[str, dict], baseline: str) -> str:
    if baseline not in runs:
        raise SystemExit(f"baseline run {baseline!r} not found among {sorted(runs)}")
    base = runs[baseline]["final"]
    lines = ["| configuration | final validation loss | gap to baseline | paper (Table 5) | train time |",
             "|---|---:|---:|---:|---:|"]
    for name, run in sorted(runs.items(), key=lambda item: item[0] != baseline):
        gap = (run["final"] - base) / base * 100
        paper = PAPER_TABLE5.get(name)
        paper_text = f"{paper:.4f} ({(paper - PAPER_TABLE5['zero3']) / PAPER_TABLE5['zero3'] * 100:+.2f} %)" \
            if paper else "diverged" if "nonblocked" in name else "—"
        runtime = f"{run['runtime']:.0f} s" if run["runtime"] else "—"
        lines.append(f"| {name} | {run['final']:.4f} | {gap:+.2f} % | {paper_text} | {runtime} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, run in sorted(runs.items()):
        steps, losses = zip(*run["curve"])
        axes.plot(steps, losses, marker="o", markersize=3, label=name)
    axes.set_xlabel("step")
    axes.set_ylabel("validation loss")
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
    args = parser.parse_args()
    runs = load_runs(args.folders)
    if not runs:
        raise SystemExit(f"no metrics.jsonl with evaluations under {[str(f) for f in args.folders]}")
    out = args.out or args.folders[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    markdown = table(runs, args.baseline)
    (out / "table.md").write_text(markdown + "\n")
    plot(runs, out / "validation_loss.png")
    print(markdown)
    print(f"\nwritten: {out / 'table.md'}, {out / 'validation_loss.png'}")


if __name__ == "__main__":
    main()
