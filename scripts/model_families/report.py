"""``python -m scripts.model_families``: the whole sweep, its JSON records and the Markdown table.

Every (head, family) of Transformers' auto mappings under zero3 on 2 gloo ranks against stock on one process, and the
ZeRO++ subset (the CI slice) on 2 emulated nodes of 2 ranks; the table goes to stdout (or ``--table``).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

from .catalog import MAPPINGS, entries
from .run import TOLERANCE, timed_sweep
from .slice import CI_SLICE

CLASSES = ("pass", "explained", "refused", "fail", "stock-cannot-build", "not-built")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.model_families", description=__doc__)
    parser.add_argument("--heads", default=",".join(MAPPINGS), help="comma-separated heads (default: all)")
    parser.add_argument("--families", default="", help="comma-separated families (default: every one)")
    parser.add_argument("--zeropp", default="slice", choices=("slice", "all", "none"),
                        help="which families also run ZeRO++ on 2 x 2 ranks (default: the CI slice)")
    parser.add_argument("--zero3", default="all", choices=("all", "none"),
                        help="whether the chosen families run zero3 against stock (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one family may take (default 120)")
    parser.add_argument("--json", type=Path, help="write every record here")
    parser.add_argument("--table", type=Path, help="write the Markdown table here (default: stdout)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    heads, families = args.heads.split(","), set(filter(None, args.families.split(",")))
    chosen = [(h, f) for h, f in entries() if h in heads and (not families or f in families)]
    subset = {"slice": [e for e in chosen if e in CI_SLICE], "all": chosen, "none": []}[args.zeropp]
    with tempfile.TemporaryDirectory() as workdir:
        zero3, zero3_time = (timed_sweep(chosen, "zero3", Path(workdir), args.timeout) if args.zero3 == "all"
                             else ([], 0.0))
        zeropp, zeropp_time = timed_sweep(subset, "zeropp", Path(workdir), args.timeout) if subset else ([], 0.0)
    if args.json:
        args.json.write_text(json.dumps({"zero3": zero3, "zeropp": zeropp}, indent=1))
    table = markdown(zero3, zeropp, {"zero3": zero3_time, "zeropp": zeropp_time})
    if args.table:
        args.table.write_text(table)
    else:
        print(table)
    return 0 if not any(r["class"] == "fail" for r in zero3 + zeropp) else 1


def counts(records: list[dict]) -> str:
    """Pass / refused / fail / ... per head, and the totals, as Markdown."""
    by_head = collections.defaultdict(collections.Counter)
    for record in records:
        by_head[record["head"]][record["class"]] += 1
        by_head["all"][record["class"]] += 1
    rows = ["| head | families | " + " | ".join(CLASSES) + " |", "|---|---:|" + "---:|" * len(CLASSES)]
    for head in [*MAPPINGS, "all"]:
        if head in by_head:
            row = by_head[head]
            rows.append(f"| {head} | {sum(row.values())} | " + " | ".join(str(row[c]) for c in CLASSES) + " |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:220]


def records_table(records: list[dict]) -> str:
    rows = ["| head | family | result | loss | gradient (L2) | worst parameter | loss after the step | reason |",
            "|---|---|---|---:|---:|---:|---:|---|"]
    for record in records:
        errors = record.get("errors")
        numbers = (" | ".join(f"{errors[k]:.1e}" for k in ("loss", "grad", "worst_grad", "loss_after"))
                   if errors else " | | | ")
        reason = record.get("reason") or "; ".join(record.get("warnings", []))
        rows.append(f"| {record['head']} | {record['family']} | {record['class']} | {numbers} | {_cell(reason)} |")
    return "\n".join(rows)


def markdown(zero3: list[dict], zeropp: list[dict], seconds: dict) -> str:
    parts = []
    if zero3:
        parts += [f"### zero3, 2 ranks, against one process ({len(zero3)} families, {seconds['zero3']:.0f} s)",
                  "", counts(zero3), ""]
    if zeropp:
        parts += [f"### ZeRO++ (INT8 weights, INT4 gradients, hpZ), 2 nodes x 2 ranks ({len(zeropp)} families, "
                  f"{seconds['zeropp']:.0f} s)", "", counts(zeropp), ""]
    bounds = "; ".join(f"{preset}: " + ", ".join(f"{k} {v:g}" for k, v in tol.items())
                       for preset, tol in TOLERANCE.items())
    parts += [f"Relative errors against stock; a family passes within {bounds}. *explained*: outside the gradient "
              "bounds only, for a cause traced to quantization (`scripts/model_families/explained.py`).", ""]
    if zero3:
        parts += ["#### Every family, zero3", "", records_table(zero3), ""]
    if zeropp:
        parts += ["#### ZeRO++", "", records_table(zeropp), ""]
    return "\n".join(parts)
