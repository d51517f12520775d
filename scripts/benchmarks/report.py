"""The report: results.md (tables: step times and wire bytes, targets, compiled vs reference kernels, where the
time goes, the gloo probe), results.png (throughput and speedup per link) and results.json."""

from __future__ import annotations

import json
from pathlib import Path

from .breakdown import PHASES, is_kernel


def _link_label(link: str) -> str:
    return {"none": "unshaped", "100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s"}.get(link, link)


def markdown(summary: dict, args) -> str:
    """results.md."""
    first = next(iter(summary["links"].values()))
    lines = [*_regime_header(summary, args), "",
        f"GPT-2 from config: n_embd {args.n_embd}, {args.n_layer} layers, {args.n_head} heads, vocab {args.vocab}"
        f"{' (untied output head)' if args.untied else ''}, "
        f"{first['params'] / 1e6:.2f}M parameters; {args.batch_per_rank} x {args.seq_len} tokens per rank, "
        f"{first['tokens_per_step']} tokens per step; {args.nodes} emulated nodes x {args.nproc_per_node} ranks "
        f"(gloo), {args.precision} weights and gradient reduction. Median step time over "
        f"{args.rounds * args.steps} timed steps per configuration (rounds interleaved) after {args.warmup} warm-up; "
        "a step's time is the slowest rank's. Load average of the machine before/after each link's run: " +
        ", ".join(f"{_link_label(l)} {d['loadavg_before_after'][0][0]:.1f}/{d['loadavg_before_after'][1][0]:.1f}"
                  for l, d in summary["links"].items() if d.get("loadavg_before_after")) + ".",
        "",
        "Wire bytes are per node per step over the node's veth (TCP payload = tx_bytes - 66 B x packets); "
        "'expected' = comm_stats logical inter-node bytes x gloo's algorithm factor (all-gather ring "
        "(g-1)/(d(g-d)); torch's reduce-scatter (stock FSDP2) = ring all-reduce 2(g-1)/(d(g-d)); hf_zeropp's "
        "reduce-scatter = the cheaper of that ring and an all-to-all, 1; all-to-alls 1). Link efficiency = the busiest node's measured wire time at the link "
        "rate (frames and all) / the step time. Stock FSDP2 has no "
        "meter: its logical bytes are derived from its FSDP2 units with the meter's rule (the same derivation "
        "applied to ZeRO-3 matches ZeRO-3's meter; see results.json derived_vs_meter).",
        "",
        "| link | config | step s (p25–p75) | step / max(unshaped, wire) | tokens/s | vs FSDP2 | vs ZeRO-3 "
        "| ÷ DeepSpeed | logical inter (MB/step, all ranks) | expected wire (MB/node/step) "
        "| measured wire (MB/node/step) | meter vs counter | link efficiency |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link, data in summary["links"].items():
        for name, row in data["rows"].items():
            logical = row.get("logical_inter_bytes_per_step")
            expected = row.get("expected_wire_per_node_per_step")
            measured = row.get("measured_wire_per_node_per_step")
            error = row.get("wire_error")
            cells = [_link_label(link), name,
                     f"{row['median_step_s']:.3f} ({row['p25_step_s']:.2f}–{row['p75_step_s']:.2f})",
                     f"{row['bound_ratio']:.2f} ({row['bound']})" if "bound_ratio" in row else "-",
                     f"{row['tokens_per_s']:.0f}",
                     f"{row['speedup_vs_fsdp2']:.2f}x" if "speedup_vs_fsdp2" in row else "-",
                     f"{row['speedup_vs_zero3']:.2f}x" if "speedup_vs_zero3" in row else "-",
                     f"{row['twin_over_deepspeed']:.2f}" if "twin_over_deepspeed" in row else "-",
                     f"{logical / 1e6:.2f}" if logical is not None else "-"]
            lines.append("| " + " | ".join(cells) + " | ")
            lines[-1] += (" / ".join(f"{e / 1e6:.2f}" for e in expected) if expected else "-") + " | "
            lines[-1] += (" / ".join(f"{m / 1e6:.2f}" for m in measured) if measured else "-") + " | "
            lines[-1] += (" / ".join(f"{x * 100:+.1f} %" for x in error if x is not None) if error else "-") + " | "
            lines[-1] += (f"{row['link_efficiency'] * 100:.0f} %" if "link_efficiency" in row else "-") + " |"
    not_run = {name: reason for data in summary["links"].values() for name, reason in data.get("not_run", {}).items()}
    if not_run:
        lines += ["", "Asked for, but they do not run here (each raised on every rank at its first step):", ""]
        lines += [f"* {name}: {reason}" for name, reason in not_run.items()]
    lines += ["", "Targets (ratios from the same launch per link):", ""]
    for t in summary["targets"]:
        verdict = {True: "MET", False: "MISSED", None: "NOT EVALUATED"}[t["met"]]
        lines.append(f"* {verdict}: {t['target']} — {t['value']}")
    choices = {link: (data.get("implementations") or {}).get("auto") for link, data in summary["links"].items()}
    choices = {link: note for link, note in choices.items() if note and note.get("auto")}
    if choices:
        lines += ["", "What auto chose, and why (rank 0's comm_stats at the end of the run):", ""]
        lines += [f"* {_link_label(link)}: {note['auto'][0]}" for link, note in choices.items()]
    kernel_rows = []
    for link, data in summary["links"].items():
        rows = data["rows"]
        if "ZeRO++" in rows and "ZeRO++ ref" in rows:
            kernel_rows.append(f"| {_link_label(link)} | {rows['ZeRO++']['median_step_s']:.3f} | "
                               f"{rows['ZeRO++ ref']['median_step_s']:.3f} | "
                               f"{rows['ZeRO++ ref']['median_step_s'] / rows['ZeRO++']['median_step_s']:.2f}x |")
    if kernel_rows:
        lines += ["", "Quantization kernels (ZeRO++ step time): compiled vs reference (plain torch)", "",
                  "| link | compiled (s) | reference (s) | reference / compiled |", "|---|---:|---:|---:|",
                  *kernel_rows]
    kernels_seen = any(is_kernel(event) and count > 0 for data in summary["links"].values()
                       for row in data["rows"].values()
                       for event, count in row.get("profiler_events_per_step", {}).items())
    breakdown_rows = []
    for link, data in summary["links"].items():
        for name, row in data["rows"].items():
            b = row.get("breakdown_s_per_step")
            if not b:
                continue
            gather, gather_k, reduce, reduce_k = (b.get(key, 0.0) for key in
                                                  ("gather call", "gather kernels", "reduce call", "reduce kernels"))
            cells = [gather, gather_k, reduce, reduce_k, gather - gather_k + reduce - reduce_k]
            if not kernels_seen:  # this hf_zeropp's kernels do not show in the profiler: kernel time unknown
                cells = [gather, None, reduce, None, None]
            breakdown_rows.append(f"| {_link_label(link)} | {name} | {b['step']:.3f} | " + " | ".join(
                f"{c:.3f}" if c is not None else "-" for c in cells) + " |")
    if breakdown_rows:
        lines += ["", "Where the time goes (torch.profiler over extra steps, mean over ranks, seconds per step): "
                  "gather / reduce = wall time inside hf_zeropp's all-gather hook (profiler range "
                  "hf_zeropp.comm.qwz.all_gather: qwZ when on, else the plain gather) and gradient reduce-scatter hook "
                  "(hf_zeropp.comm.qgz.reduce_scatter: qgZ when on, else the plain reduce-scatter); FSDP2 calls both "
                  "synchronously on CPU, so this is the whole collective. kernels = the hf_zeropp::* quantization "
                  "ops inside them, wait = the rest of those calls (gloo transfers, and peers that are still "
                  "computing: 4 ranks share 2 cores). The step column includes the profiler's own overhead."
                  + ("" if kernels_seen else " No hf_zeropp::* kernel event was recorded (kernels not visible to "
                     "the profiler in this hf_zeropp): kernel and wait columns unknown."), "",
                  "| link | config | step | gather | gather kernels | reduce | reduce kernels | wait in both |",
                  "|---|---|---:|---:|---:|---:|---:|---:|", *breakdown_rows]
    names = list(PHASES.values())
    phase_rows = [f"| {_link_label(link)} | {name} | {row['breakdown_s_per_step']['step']:.3f} | "
                  + " | ".join(f"{row['breakdown_phase_s_per_step'].get(phase, 0.0):.3f}" for phase in names) + " |"
                  for link, data in summary["links"].items() for name, row in data["rows"].items()
                  if row.get("breakdown_phase_s_per_step")]
    if phase_rows:
        lines += ["", "Where the step waits (the same profiled steps, mean over ranks, seconds per step; "
                  "scripts/benchmarks/breakdown.py, phases): each pass's wall time, and inside it FSDP2's waits for "
                  "gathers and its gradient reduce-scatter; a pass's compute is its time less those.", "",
                  "| link | config | step | " + " | ".join(names) + " |", "|---|---|" + "---:|" * (len(names) + 1),
                  *phase_rows]
    probe = next((d["probe"] for d in summary["links"].values() if d.get("probe")), None)
    if probe:
        lines += ["", f"gloo probe (each collective alone, {probe['buffer_bytes'] / 1e6:.1f} MB buffer): node wire bytes "
                  f"per logical inter-node byte", "", "| collective | rule | measured (node 0 / node 1) |",
                  "|---|---:|---:|"]
        for name, entry in probe.items():
            if isinstance(entry, dict) and "rule_factor" in entry:
                measured = " / ".join(f"{m:.4f}" for m in entry["measured_factor"] if m is not None)
                lines.append(f"| {name} | {entry['rule_factor']:.4f} | {measured} |")
        if "barriers only" in probe:
            lines.append(f"| (barriers around a window, bytes) | - | "
                         f"{' / '.join(str(b) for b in probe['barriers only']['node_tx_payload_bytes'])} |")
    return "\n".join(lines) + "\n"


def _regime_header(summary: dict, args) -> list[str]:
    """Which floor each step sits on, and whether this CPU computes bf16 natively (the measure between machines
    is the ratio to the floor; ratios between configurations shrink where they sit on the compute floor)."""
    cpu = summary.get("machine") or {}
    native = cpu.get("native_bf16")
    lines = [f"Machine: {cpu.get('cpu', 'unknown CPU')}; native bf16: "
             + {True: f"yes ({', '.join(cpu.get('bf16_flags', []))})", False: "no", None: "unknown"}[native] + "."]
    if args.precision == "bf16" and native is False:
        lines.append("This is a bf16 run on a CPU without native bf16: its products are emulated, so every "
                     "configuration is compute-bound (on an AVX2 EPYC the compute took 5-8x the fp32 step) and the "
                     "ratios between configurations shrink; read the regime column, or run fp32.")
    lines.append("Regime: step / max(unshaped step, wire time), with the larger of the two in brackets (compute: "
                 "the same configuration's step on the unshaped link of this launch; wire: the busiest node's "
                 "measured bytes at the link rate). 1.00 is the floor on this machine; unlike a ratio between "
                 "configurations it does not move with the CPU's speed.")
    if "none" not in summary["links"]:
        lines.append("This launch ran no unshaped link (--links ...,none), so the regime column is empty.")
    return lines


def chart(summary: dict, path: Path) -> None:
    """results.png: tokens/s and speedup vs stock FSDP2 per link and configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(summary["links"])
    names = list(next(iter(summary["links"].values()))["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(links))]
        tps = [summary["links"][l]["rows"][name]["tokens_per_s"] for l in links]
        sp = [summary["links"][l]["rows"][name].get("speedup_vs_fsdp2", 0) for l in links]
        axes[0].bar(xs, tps, width, label=name)
        axes[1].bar(xs, sp, width, label=name)
    for ax, title in zip(axes, ("throughput (tokens/s, higher is better)", "speedup per step vs stock FSDP2")):
        ax.set_xticks(range(len(links)), [_link_label(l) for l in links])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="black", lw=0.8)
    axes[1].axhline(3.0, color="red", lw=0.8, ls="--", label="3x target")
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle("ZeRO++ ablation on 2 emulated nodes x 2 ranks (gloo, tc-shaped veth links)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def save(out: Path, stem: str, data, text: str) -> None:
    """``stem``.json (the data) and ``stem``.md (the text) under ``out``, made if missing; the text also goes to
    standard output."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text(text)
    print(text)


def write(summary: dict, args, out: Path) -> str:
    """results.json, results.md and results.png under ``out``; returns the markdown."""
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    table = markdown(summary, args)
    (out / "results.md").write_text(table)
    chart(summary, out / "results.png")
    return table
