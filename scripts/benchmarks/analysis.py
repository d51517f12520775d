"""From the workers' raw results to the summary written as results.json: per link and configuration the step
times (a step's time is the slowest rank's), the meter's logical bytes against the veth counters through gloo's
wire rule, the profiler breakdown (mean over ranks), the speedups, the regime and the targets.

The regime says which floor a step sits on: its unshaped step (compute, and the CPU work of communicating) or its
wire time (the busiest node's bytes at the link rate). ``step / max(unshaped step, wire time)`` is the measure that
travels between machines; a ratio between two configurations does not where either sits on its compute floor,
which a faster CPU lowers. A bf16 run on a CPU without native bf16 is compute-bound everywhere: its products are
emulated (on an AVX2 EPYC, compute took 5-8x the fp32 step)."""

from __future__ import annotations

import statistics
from pathlib import Path

from hf_zeropp.testing.emulated_network import parse_rate

from .configs import deepspeed_peer
from .wire import KINDS, expected_node_wire


def _mean_over_ranks(dicts: list[dict]) -> dict:
    keys = sorted({k for d in dicts for k in d})
    return {k: statistics.fmean(d.get(k, 0.0) for d in dicts) for k in keys}


def analyse(link_results: dict[str, dict], args) -> dict:
    """The summary (results.json without ``settings`` and ``wall_s``) of every link's raw results."""
    summary: dict = {"links": {}}
    for link, res in link_results.items():
        world, node_size = res["world"], res["node_size"]
        nodes = world // node_size
        tokens_per_step = world * args.batch_per_rank * args.seq_len
        per_rank = res["per_rank"]
        rows = {}
        for name in per_rank[0]:
            steps = [max(r[name]["times"][i] for r in per_rank) for i in range(len(per_rank[0][name]["times"]))]
            median = statistics.median(steps)
            n_steps = len(steps)
            metered = per_rank[0][name]["stats"] is not None
            key = "stats" if metered else "derived_stats"
            quartiles = statistics.quantiles(steps, n=4) if len(steps) > 1 else [median, median, median]
            row = {"median_step_s": median, "mean_step_s": statistics.fmean(steps), "steps": steps,
                   "p25_step_s": quartiles[0], "p75_step_s": quartiles[2],
                   "tokens_per_s": tokens_per_step / median, "timed_steps": n_steps}
            if per_rank[0][name].get(key) is not None:
                stats = [r[name][key] for r in per_rank]
                meter_steps = sum(w["steps"] for w in per_rank[0][name]["windows"])
                logical = sum(s.get(k, {}).get("inter_node", 0) for s in stats for k in KINDS)
                expected = expected_node_wire(stats, world, node_size)
                row.update(meter_source="comm_stats" if metered else "derived from FSDP2 units",
                           logical_inter_bytes_per_step=logical / meter_steps,
                           logical_inter_by_kind_per_step={
                               k: sum(s.get(k, {}).get("inter_node", 0) for s in stats) / meter_steps
                               for k in KINDS if any(k in s for s in stats)},
                           expected_wire_per_node_per_step=[e / meter_steps for e in expected])
            windows = per_rank[0][name]["windows"]
            measured = []
            for nd in range(nodes):
                counters = [w["counters"] for w in per_rank[nd * node_size][name]["windows"]]
                if all(c is not None for c in counters):
                    measured.append(sum(c["tx_payload_bytes"] for c in counters) / n_steps)
                    row.setdefault("measured_wire_raw_per_node_per_step", []).append(
                        sum(c["tx_bytes"] for c in counters) / n_steps)
            if measured:
                row["measured_wire_per_node_per_step"] = measured
            if measured and "expected_wire_per_node_per_step" in row:
                row["wire_error"] = [m / e - 1 if e else None
                                     for m, e in zip(measured, row["expected_wire_per_node_per_step"])]
            row["window_s_per_step"] = sum(w["seconds"] for w in windows) / n_steps
            if all(r[name].get("first_step") is not None for r in per_rank):  # holds a compiled run's compile
                row["first_step_s"] = max(r[name]["first_step"] for r in per_rank)
            for source, target in (("breakdown", "breakdown_s_per_step"),
                                   ("breakdown_kernels", "breakdown_kernel_s_per_step"),
                                   ("breakdown_events", "profiler_events_per_step"),
                                   ("breakdown_phases", "breakdown_phase_s_per_step")):
                if any(r[name].get("breakdown") for r in per_rank):  # mean over ranks, 0 where a rank has none
                    row[target] = _mean_over_ranks([r[name].get(source) or {} for r in per_rank
                                                    if r[name].get("breakdown")])
            derived = per_rank[0][name].get("derived_stats")
            if metered and derived is not None:  # the unit-layout derivation against the meter (ZeRO-3)
                derived_total = sum(r[name]["derived_stats"][k]["inter_node"] for r in per_rank
                                    for k in r[name]["derived_stats"])
                row["derived_vs_meter"] = derived_total / (row["logical_inter_bytes_per_step"] * n_steps) - 1
            rows[name] = row
        rate = link_bytes_per_s(link)
        for row in rows.values():
            raw = row.get("measured_wire_raw_per_node_per_step")
            if rate and raw:  # the busiest node's link, frames and all, at the shaped rate
                row["wire_bound_s"] = max(raw) / rate
                row["link_efficiency"] = row["wire_bound_s"] / row["median_step_s"]
        base = rows.get("FSDP2")
        z3 = rows.get("ZeRO-3")
        for name, row in rows.items():
            if deepspeed_peer(name) in rows:  # an hf twin: its step over DeepSpeed's, same config, same launch
                row["twin_over_deepspeed"] = row["median_step_s"] / rows[deepspeed_peer(name)]["median_step_s"]
            if base:
                row["speedup_vs_fsdp2"] = base["median_step_s"] / row["median_step_s"]
            if z3:
                row["speedup_vs_zero3"] = z3["median_step_s"] / row["median_step_s"]
        summary["links"][link] = {"rows": rows, "probe": res.get("probe"), "params": res["params"],
                                  "loadavg_before_after": res.get("loadavg_before_after"),
                                  "tokens_per_step": tokens_per_step, "implementations": res["implementations"],
                                  "not_run": res.get("not_run", {}),
                                  "emulator": {k: v for k, v in res["emulator"].items() if k != "command"}}
    add_regime(summary["links"])
    summary["machine"] = machine()
    summary["targets"] = targets(summary["links"])
    return summary


# where the CPU lists native bf16 arithmetic: x86's AVX-512 BF16 and AMX-BF16 flags, aarch64's bf16 feature
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def machine(cpuinfo: str | None = None) -> dict:
    """The CPU the ranks ran on (the emulated nodes share it) and whether it computes bf16 natively, from
    ``/proc/cpuinfo`` (or ``cpuinfo``); ``native_bf16`` is None where the CPU lists no flags."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    lines = [line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line]
    name = next((value.strip() for key, value in lines if key.strip() in ("model name", "Model name")), "unknown")
    flags = set().union(*(value.split() for key, value in lines if key.strip() in ("flags", "Features")))
    found = sorted(flags & BF16_FLAGS)
    return {"cpu": name, "native_bf16": bool(found) if flags else None, "bf16_flags": found}


def add_regime(links: dict) -> None:
    """Each row's ``bound_ratio``, step / max(unshaped step, wire time), and ``bound``, the larger of the two
    (``compute`` or ``wire``), where the same launch ran the configuration unshaped (``--links ...,none``)."""
    unshaped = links.get("none", {}).get("rows", {})
    for data in links.values():
        for name, row in data["rows"].items():
            if name not in unshaped:
                continue
            compute, wire = unshaped[name]["median_step_s"], row.get("wire_bound_s", 0.0)
            row["unshaped_step_s"] = compute
            row["bound_ratio"] = row["median_step_s"] / max(compute, wire)
            row["bound"] = "wire" if wire > compute else "compute"


def communication_bound_link(links: dict, name: str) -> str | None:
    """The slowest link at which ``name``'s wire time exceeds its unshaped step, or None."""
    bound = [link for link, data in links.items() if data.get("rows", {}).get(name, {}).get("bound") == "wire"]
    return min(bound, key=lambda link: link_bytes_per_s(link) or float("inf"), default=None)


def link_bytes_per_s(link: str) -> float | None:
    """``100mbit`` -> 12.5e6 bytes/s (the emulator's own parsing); None for an unshaped link."""
    bits = parse_rate(link)
    return bits / 8 if bits is not None else None


# the bench's names of what auto chooses among (hf_zeropp.engine.auto.CANDIDATES): the best fixed configuration of a
# link is the fastest of those the launch ran
AUTO_CANDIDATES = ("ZeRO-3", "ZeRO++", "ZeRO++ int8 gradients", "hybrid", "hybrid-q", "hybrid-q int8")


def _speedup_target(links: dict, subject: str, peer: str, factor: float) -> dict:
    """``subject`` >= ``factor`` x faster than ``peer``, at the slowest link where ``peer`` is communication-bound
    (elsewhere the ratio measures this machine's compute, not the bytes); not evaluated (``met`` None) where the
    peer is not communication-bound at any link of the launch."""
    target = f"{subject} >= {factor:g}x faster per step than {peer} where {peer} is communication-bound"
    link = communication_bound_link(links, peer)
    if link is None:
        why = (f"{peer} is compute-bound at every link of this launch (a slower link or a faster CPU puts it on its "
               f"wire floor)" if "none" in links else "the launch ran no unshaped link to compare with (--links ...,none)")
        return {"target": target, "met": None, "value": f"not evaluated: {why}"}
    rows = links[link]["rows"]
    if subject not in rows:
        return {"target": target, "met": None, "value": f"not evaluated: {subject} did not run at {link}"}
    ratio = rows[peer]["median_step_s"] / rows[subject]["median_step_s"]
    floor = rows[subject].get("bound_ratio")
    return {"target": target, "met": ratio >= factor,
            "value": f"{ratio:.2f}x at {link}" + (f"; {subject} there at {floor:.2f}x its floor "
                                                  f"({rows[subject]['bound']}-bound)" if floor else "")}


def targets(links: dict) -> list[dict]:
    """The paper's and the issues' claims at this scale, each with its measured value and whether it is met (None:
    not evaluated in this launch, with the reason)."""
    out = []
    slow = links.get("100mbit", {}).get("rows", {})
    fast = links.get("none", {}).get("rows", {})
    for subject, peer, factor in (("ZeRO++", "FSDP2", 3.0), ("hybrid-q", "ZeRO++", 1.5), ("hybrid-q", "FSDP2", 5.0)):
        if any({subject, peer} <= data.get("rows", {}).keys() for data in links.values()):
            out.append(_speedup_target(links, subject, peer, factor))
    for name in ("ZeRO++", "hybrid-q"):
        if "bound_ratio" in slow.get(name, {}):
            row = slow[name]
            out.append({"target": f"{name} step <= 1.25x max(its unshaped step, its wire time) at 100 Mbit/s",
                        "value": f"{row['bound_ratio']:.2f}x ({row['bound']}-bound: unshaped "
                                 f"{row['unshaped_step_s']:.3f} s, wire {row.get('wire_bound_s', 0.0):.3f} s)",
                        "met": row["bound_ratio"] <= 1.25})
    for rows in (slow, fast):
        if "ZeRO-3" in rows and "FSDP2" in rows and "logical_inter_bytes_per_step" in rows["FSDP2"]:
            mine, stock = (rows[n]["logical_inter_bytes_per_step"] for n in ("ZeRO-3", "FSDP2"))
            out.append({"target": "hf_zeropp ZeRO-3 sends no more logical cross-node bytes per step than stock FSDP2",
                        "value": f"{mine / 1e6:.2f} vs {stock / 1e6:.2f} MB", "met": mine <= stock})
            break
    for rows in (slow, fast):
        if all("measured_wire_per_node_per_step" in rows.get(n, {}) for n in ("ZeRO-3", "FSDP2")):
            mine, stock = (max(rows[n]["measured_wire_per_node_per_step"]) for n in ("ZeRO-3", "FSDP2"))
            # 0.5 %: the counters also see retransmissions and the barriers' few kB
            out.append({"target": "hf_zeropp ZeRO-3 puts no more bytes on the busiest node's link per step than stock "
                                  "FSDP2 (veth counters)", "value": f"{mine / 1e6:.2f} vs {stock / 1e6:.2f} MB",
                        "met": mine <= stock * 1.005})
            break
    if "ZeRO++" in fast and "ZeRO-3" in fast:
        slower = fast["ZeRO++"]["median_step_s"] / fast["ZeRO-3"]["median_step_s"] - 1
        out.append({"target": "ZeRO++ <= 10 % slower than hf_zeropp ZeRO-3 on unshaped links",
                    "value": f"{slower * 100:+.1f} %", "met": slower <= 0.10})
    for name in ("+qwZ", "+hpZ", "+qgZ"):
        if name in slow and "ZeRO-3" in slow:
            ratio = slow["ZeRO-3"]["median_step_s"] / slow[name]["median_step_s"]
            out.append({"target": f"{name} faster than ZeRO-3 at 100 Mbit/s", "value": f"{ratio:.2f}x",
                        "met": ratio > 1.0})
    for link, result in links.items():
        rows = result.get("rows", {})
        fixed = {name: rows[name]["median_step_s"] for name in AUTO_CANDIDATES if name in rows}
        if "auto" not in rows or not fixed:
            continue
        best = min(fixed, key=fixed.get)
        over = rows["auto"]["median_step_s"] / fixed[best] - 1
        out.append({"target": f"auto within 5 % of the best fixed configuration at {link} ({best})",
                    "value": f"{over * 100:+.1f} %", "met": over <= 0.05})
        if "ZeRO-3" in fixed:
            slower = rows["auto"]["median_step_s"] / fixed["ZeRO-3"] - 1
            itself = auto_pick(result) == "zero3"
            value = f"{slower * 100:+.1f} %"
            if itself and slower > 0:
                value += " (auto runs ZeRO-3 itself: the spread between two runs of one configuration)"
            out.append({"target": f"auto never slower than ZeRO-3 at {link}", "value": value,
                        "met": slower <= 0.0 or itself})
    return out


def auto_pick(link_result: dict) -> str | None:
    """The candidate auto trained as on one link, from rank 0's comm_stats line ("auto: NAME (why)")."""
    note = ((link_result.get("implementations") or {}).get("auto") or {}).get("auto")
    return note[0].removeprefix("auto: ").split(" (")[0] if note else None
