"""Smoke tests of the emulated multi-node cluster (hf_zeropp/testing/emulated_cluster.py and emulated_network.py).

The cluster tests need root, iproute2's ``ip`` and ``tc``, and a kernel that lets this process create network
namespaces; elsewhere they are skipped with the reason. The argument and requirement checks run everywhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import ROOT

from hf_zeropp.testing import emulated_cluster, emulated_network


_PROBLEM = emulated_network.namespaces_problem()
needs_cluster = pytest.mark.skipif(_PROBLEM is not None, reason=f"emulated cluster unavailable: {_PROBLEM}")


def _namespaces_of(pid: int) -> list[str]:
    out = subprocess.run([emulated_network.find_tool("ip") or "ip", "netns", "list"], capture_output=True,
                         text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"zpp-{pid}-")]


def _emulator(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_zeropp.testing.emulated_cluster", *args]


def _first_failure(output: str) -> str:
    """The output from the first traceback or error on, and its end: a failing rank's own error comes long before
    the launchers' shutdown noise (the exit-barrier errors of the other nodes) that fills the tail."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if "Traceback" in line or "Error" in line), len(lines))
    return "\n".join(lines[first:first + 60] + ["..."] + lines[-20:])


# ---- everywhere ------------------------------------------------------------------------------------------------

def test_rates_and_delays_parse():
    assert emulated_network.parse_rate("100mbit") == 100_000_000
    assert emulated_network.parse_rate("1gbit") == 1_000_000_000
    assert emulated_network.parse_rate("none") is None
    assert emulated_network.parse_delay("1ms") == pytest.approx(1e-3)
    assert emulated_network.parse_delay("none") is None
    with pytest.raises(Exception, match="link rate"):
        emulated_network.parse_rate("fast")


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert emulated_cluster.main(["--", "train.py"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_refuses_without_iproute2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(emulated_network, "find_tool", lambda name: None)
    assert emulated_cluster.main(["--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "ip and tc" in err and "iproute2" in err


def test_wire_rule_matches_gloo_ring_algebra():
    from scripts.benchmarks import cluster as bench_cluster

    f = bench_cluster.wire_factors(4, 2)
    assert f["fwd_allgather"] == pytest.approx(0.75)
    assert f["torch_reduce_scatter"] == pytest.approx(1.5)  # torch's gloo reduce-scatter: a whole all-reduce
    assert f["grad_reduce_scatter"] == 1.0  # hf_zeropp's on gloo: all-to-all, wire bytes = logical
    assert f["qgz_inter"] == 1.0
    assert bench_cluster.wire_factors(2, 2)["fwd_allgather"] == 0.0  # one node: nothing crosses
    # 2 x 4: the ring's one edge per node (2 x 7/8 of the buffer) beats the all-to-all's 4 x 4/8, so hf_zeropp keeps
    # gloo's own reduce-scatter there and sends exactly what stock FSDP2 sends
    f = bench_cluster.wire_factors(8, 4)
    assert f["torch_reduce_scatter"] == pytest.approx(0.875)
    assert f["grad_reduce_scatter"] == f["qgz_1d_full_precision"] == pytest.approx(0.875)
    assert bench_cluster.wire_factors(8, 2)["grad_reduce_scatter"] == 1.0  # 4 x 2: the ring would send 1.17x


def test_reduce_scatter_algorithm_choice_never_sends_more_than_gloos_ring_or_the_all_to_all():
    """Brute force over node counts and sizes: the chosen algorithm's cross-node bytes per node (ring edge
    2 (g-1)/g, all-to-all d (g-d)/g of the buffer) are the smaller of the two."""
    from hf_zeropp.comm.comm_meter import gloo_reduce_scatter_as_all_to_all

    for nodes in range(1, 9):
        for ranks_per_node in range(1, 9):
            g, d = nodes * ranks_per_node, ranks_per_node
            ring = 2 * (g - 1) / g if nodes > 1 else 0.0
            all_to_all = d * (g - d) / g
            chosen = all_to_all if gloo_reduce_scatter_as_all_to_all(g, d) else ring
            assert chosen == min(ring, all_to_all), (nodes, ranks_per_node)


def test_zero3_wire_target_reads_the_busiest_nodes_counters():
    """The bytes-parity target on the wire: met at 2 x 4 with the ring (equal bytes), missed with the all-to-all
    hf_zeropp used there before (7.6 % more per node, as measured)."""
    from scripts.benchmarks.analysis import targets

    def rows(zero3_wire: list[float]) -> dict:
        return {"FSDP2": {"median_step_s": 13.3, "measured_wire_per_node_per_step": [131.59e6, 131.58e6]},
                "ZeRO-3": {"median_step_s": 13.2, "measured_wire_per_node_per_step": zero3_wire}}

    def wire_target(zero3_wire: list[float]) -> dict:
        found = [t for t in targets({"100mbit": {"rows": rows(zero3_wire)}}) if "veth counters" in t["target"]]
        assert len(found) == 1
        return found[0]

    assert wire_target([131.59e6, 131.60e6]) == {
        "target": "hf_zeropp ZeRO-3 puts no more bytes on the busiest node's link per step than stock FSDP2 "
                  "(veth counters)", "value": "131.60 vs 131.59 MB", "met": True}
    assert not wire_target([131.5e6, 141.64e6])["met"]


def test_the_bench_states_its_regime_and_judges_speedups_only_where_the_peer_is_communication_bound():
    """The issue's fp32 2 x 4 launch: hybrid-q 1.55 s at 100 Mbit/s against 1.42 s unshaped and 0.43 s of wire sits
    at 1.09x its compute floor; ZeRO++ 1.99 s against 1.48 s and 1.49 s of wire at 1.34x its wire floor. The
    speedups are judged at 100 Mbit/s, where FSDP2 and ZeRO++ are communication-bound; with no link where they
    are, not at all."""
    from scripts.benchmarks.analysis import add_regime, machine, targets

    def row(step: float, wire: float | None = None) -> dict:
        return {"median_step_s": step, **({"wire_bound_s": wire} if wire is not None else {})}

    links = {"100mbit": {"rows": {"FSDP2": row(12.98, 10.5), "ZeRO++": row(1.99, 1.49), "hybrid-q": row(1.55, 0.43)}},
             "none": {"rows": {"FSDP2": row(1.59), "ZeRO++": row(1.48), "hybrid-q": row(1.42)}}}
    add_regime(links)
    hybrid_q, zeropp = links["100mbit"]["rows"]["hybrid-q"], links["100mbit"]["rows"]["ZeRO++"]
    assert (round(hybrid_q["bound_ratio"], 2), hybrid_q["bound"]) == (1.09, "compute")
    assert (round(zeropp["bound_ratio"], 2), zeropp["bound"]) == (1.34, "wire")
    assert links["none"]["rows"]["FSDP2"]["bound_ratio"] == 1.0
    found = {t["target"]: t for t in targets(links)}
    versus_zeropp = found["hybrid-q >= 1.5x faster per step than ZeRO++ where ZeRO++ is communication-bound"]
    assert versus_zeropp["met"] is False and versus_zeropp["value"].startswith("1.28x at 100mbit; hybrid-q there at "
                                                                               "1.09x its floor (compute-bound)")
    assert found["hybrid-q >= 5x faster per step than FSDP2 where FSDP2 is communication-bound"]["met"] is True
    floor = found["hybrid-q step <= 1.25x max(its unshaped step, its wire time) at 100 Mbit/s"]
    assert floor["met"] is True and floor["value"].startswith("1.09x (compute-bound")
    # a compute-bound launch (bf16 without native bf16): the same ratios say nothing about the bytes
    slow_cpu = {"100mbit": {"rows": {"FSDP2": row(13.6, 5.3), "ZeRO++": row(9.2, 0.8), "hybrid-q": row(8.7, 0.2)}},
                "none": {"rows": {"FSDP2": row(8.1), "ZeRO++": row(8.3), "hybrid-q": row(8.2)}}}
    add_regime(slow_cpu)
    skipped = [t for t in targets(slow_cpu) if t["met"] is None]
    assert len(skipped) == 3 and all("compute-bound at every link" in t["value"] for t in skipped)
    assert machine("model name\t: AMD EPYC\nflags\t: fpu avx2 fma\n") == {
        "cpu": "AMD EPYC", "native_bf16": False, "bf16_flags": []}
    assert machine("model name\t: Xeon\nflags\t: avx2 avx512f avx512_bf16 amx_bf16\n")["native_bf16"] is True
    assert machine("Features\t: fp asimd bf16 i8mm\n")["bf16_flags"] == ["bf16"]


def test_auto_against_zero3_is_missed_when_slower_unless_auto_trained_as_zero3_itself():
    """auto slower than ZeRO-3 after picking another candidate misses the target; after picking ZeRO-3 the gap is
    two runs of one configuration, which the value says."""
    from scripts.benchmarks.analysis import targets

    def link(auto_step: float, pick: str) -> dict:
        return {"rows": {"ZeRO-3": {"median_step_s": 1.182}, "ZeRO++": {"median_step_s": 1.198},
                         "auto": {"median_step_s": auto_step}},
                "implementations": {"auto": {"auto": [f"auto: {pick} (timed on the first batch, ...)"]}}}

    links = {"none": link(1.213, "zeropp int8 gradients"), "1gbit": link(1.190, "zero3"), "100mbit": link(1.170, "zeropp")}
    found = {t["target"]: t for t in targets(links)}
    assert found["auto never slower than ZeRO-3 at none"] == {
        "target": "auto never slower than ZeRO-3 at none", "value": "+2.6 %", "met": False}
    assert found["auto never slower than ZeRO-3 at 1gbit"] == {
        "target": "auto never slower than ZeRO-3 at 1gbit", "met": True,
        "value": "+0.7 % (auto runs ZeRO-3 itself: the spread between two runs of one configuration)"}
    assert found["auto never slower than ZeRO-3 at 100mbit"]["met"] is True
    assert found["auto within 5 % of the best fixed configuration at none (ZeRO-3)"]["met"] is True


def _bench_results(tmp_path: Path) -> Path:
    """A bench_cluster results.json at 2 x 2 with hand-picked step times and logical bytes (sums over ranks)."""
    rows_none = {
        "FSDP2": {"median_step_s": 0.5, "logical_inter_by_kind_per_step": {"fwd_allgather": 8e6, "bwd_allgather": 0,
                                                                            "torch_reduce_scatter": 8e6}},
        "ZeRO-3": {"median_step_s": 0.5, "logical_inter_by_kind_per_step": {"fwd_allgather": 8e6, "bwd_allgather": 0,
                                                                             "grad_reduce_scatter": 8e6}},
        "ZeRO++": {"median_step_s": 0.5, "logical_inter_by_kind_per_step": {"fwd_allgather": 4e6, "qgz_inter": 1e6,
                                                                             "qgz_1d_full_precision": 0.1e6}},
    }
    measured = {"FSDP2": 1.22, "ZeRO-3": 1.00, "ZeRO++": 0.6}
    results = {"settings": {"nodes": 2, "nproc_per_node": 2, "precision": "bf16"},
               "links": {"none": {"rows": rows_none},
                         "100mbit": {"rows": {n: {"median_step_s": t} for n, t in measured.items()}}}}
    folder = tmp_path / "bench_2x2"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def test_cost_model_against_hand_computed_steps(tmp_path):
    """T(B) = T0 + blocking/B + max(0, forward/B - T0/3) + max(0, backward/B - 2 T0/3) with gloo's wire factors at
    2 x 2, B = 12.5 MB/s: FSDP2 (all blocking) 0.5 + (8e6 x 0.75 + 8e6 x 1.5) / 2 / B = 1.22 s; ZeRO-3 0.5 + the
    reduce-scatter 8e6 x 1 / 2 / B + what the forward compute (0.5 / 3) does not hide of the gather's
    8e6 x 0.75 / 2 / B = 0.24 s, i.e. 0.5 + 0.32 + 0.0733 = 0.8933 s; ZeRO++ (its 0.12 s gather hidden)
    0.5 + (1e6 + 0.1e6) / 2 / B = 0.544 s."""
    from scripts.benchmarks import cost_model as predict_cluster

    folder = _bench_results(tmp_path)
    results = json.loads((folder / "results.json").read_text())
    got = {v["config"]: v for v in predict_cluster.validate(results)}
    assert got["FSDP2"]["predicted_s"] == pytest.approx(1.22)
    assert got["ZeRO-3"]["predicted_s"] == pytest.approx(0.5 + 0.32 + (0.24 - 0.5 / 3))
    assert got["ZeRO-3"]["error"] == pytest.approx(0.5 + 0.32 + (0.24 - 0.5 / 3) - 1)
    assert got["ZeRO++"]["predicted_s"] == pytest.approx(0.544)
    fractions = predict_cluster.measured_fractions(results)
    assert fractions["forward"] == pytest.approx(0.5)
    # M = 8e6 / 4 ranks / (2/4) = 4 MB; a node sends 1e6 / 2 of it across per (n-1)/n = 1/2: 0.25 M
    assert fractions["gradients_hop"] == pytest.approx(0.25)
    # the paper's cluster: ZeRO++ gains more on the slower link, and never loses
    paper = predict_cluster.paper_table(fractions, tflops=40.0, latency_s=0.005)
    by_key = {(p["model"], p["tokens_per_gpu"], p["link_gbit"]): p["speedup"] for p in paper}
    assert by_key[("18B", 1024, 100)] > by_key[("18B", 1024, 400)] >= 1.0
    completed = subprocess.run([sys.executable, "-m", "scripts.benchmarks.cost_model", str(folder), "--out",
                                str(tmp_path / "predict")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert (tmp_path / "predict" / "speedup_vs_link.png").stat().st_size > 0
    assert "| 2x2 bf16 | 100mbit | FSDP2 | 1.220 | 1.220 | +0.0 % |" in completed.stdout


def test_profiler_breakdown_attributes_kernels_to_the_enclosing_call():
    import torch
    from scripts.benchmarks import breakdown
    from torch.profiler import record_function

    from hf_zeropp.comm import qgz, qwz

    def work():
        with record_function(qwz.PROFILER_RANGE):
            with record_function("hf_zeropp::quantize"), record_function("hf_zeropp::quantize"):  # counted once
                torch.ones(1000).sum()
        with record_function(qgz.PROFILER_RANGE):
            with record_function("hf_zeropp::dequant_reduce"):
                torch.ones(1000).sum()
            torch.ones(1000).sum()
        with record_function("hf_zeropp::dequantize"):  # outside both calls
            torch.ones(10).sum()
        # FSDP2's ranges carry the unit's name; a phase nested in the same phase counts once
        with record_function("FSDP::pre_forward (transformer.h.0)"):
            with record_function("FSDP::pre_forward (transformer.h.0)"):
                torch.ones(1000).sum()

    events = breakdown.profile_steps(work)
    waits = breakdown.phases(events)
    outer = max(e.time_range.end - e.time_range.start for e in events if e.name.startswith("FSDP::pre_forward"))
    assert waits["forward gather waits"] == pytest.approx(outer / 1e6)
    assert waits["backward gather waits"] == waits["gradient reduce"] == waits["optimizer step"] == 0
    result = breakdown.attribute(events)
    seconds, kernels = result["seconds"], result["kernels"]
    assert 0 < seconds["gather kernels"] <= seconds["gather call"]
    assert 0 < seconds["reduce kernels"] < seconds["reduce call"]
    assert seconds["other kernels"] > 0
    assert set(kernels) == {"hf_zeropp::quantize", "hf_zeropp::dequant_reduce", "hf_zeropp::dequantize"}
    assert kernels["hf_zeropp::quantize"] == pytest.approx(seconds["gather kernels"])
    assert result["events"][qwz.PROFILER_RANGE] == result["events"][qgz.PROFILER_RANGE] == 1


# ---- as root, with namespaces ----------------------------------------------------------------------------------

@needs_cluster
@pytest.mark.timeout(180)
def test_two_node_training_smoke(tmp_path):
    """2 namespaces x 2 gloo ranks over a 100 Mbit/s link, a few steps of a tiny GPT-2 under ZeRO-3 and ZeRO++:
    it trains, the veth counters see the inter-node traffic the meter predicts, and nothing is left behind."""
    from scripts.benchmarks import cluster as bench_cluster

    result, counters = tmp_path / "result.json", tmp_path / "counters.json"
    cmd = _emulator("--nodes", "2", "--nproc-per-node", "2", "--link", "100mbit", "--counters-json", str(counters),
                    "--", "-m", "scripts.benchmarks.cluster", "--worker", "--result", str(result),
                    "--configs", "ZeRO-3,ZeRO++", "--warmup", "1", "--rounds", "1", "--steps", "2", "--probe-mb", "0",
                    "--n-embd", "128", "--n-layer", "2", "--n-head", "2", "--vocab", "512", "--seq-len", "32")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    output, _ = proc.communicate(timeout=170)
    assert proc.returncode == 0, _first_failure(output)
    assert not _namespaces_of(proc.pid), "the emulator left namespaces behind"

    report = json.loads(counters.read_text())
    assert report["returncode"] == 0 and len(report["per_node"]) == 2
    assert "tbf" in report["qdiscs"]["n0:veth0"] and "tbf" in report["qdiscs"]["sw:p0"]
    for node in report["per_node"]:
        assert node["delta"]["tx_bytes"] > 100_000 and node["delta"]["rx_bytes"] > 100_000

    data = json.loads(result.read_text())
    world, node_size = data["world"], data["node_size"]
    assert (world, node_size) == (4, 2)
    for name in ("ZeRO-3", "ZeRO++"):
        stats = [rank[name]["stats"] for rank in data["per_rank"]]
        expected = bench_cluster.expected_node_wire(stats, world, node_size)
        for node in range(2):
            windows = data["per_rank"][node * node_size][name]["windows"]
            measured = sum(w["counters"]["tx_payload_bytes"] for w in windows)
            assert measured == pytest.approx(expected[node], rel=0.05), (name, node, measured, expected)
    z3 = sum(r["ZeRO-3"]["stats"][k]["inter_node"] for r in data["per_rank"] for k in ("fwd_allgather",))
    zpp = sum(r["ZeRO++"]["stats"][k]["inter_node"] for r in data["per_rank"] for k in ("fwd_allgather",))
    assert zpp < 0.6 * z3  # qwZ's INT8 gather of bf16 weights


@needs_cluster
@pytest.mark.timeout(60)
def test_failure_of_one_node_is_reported_and_cleaned_up():
    code = "import os, sys; sys.exit(3 if os.environ['ZPP_NODE_RANK'] == '1' else 0)"
    proc = subprocess.run(_emulator("--raw", "--link", "none", "--grace", "5", "--", sys.executable, "-c", code),
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 3, proc.stderr
    pid = int(re.search(r"namespaces zpp-(\d+)-", proc.stderr).group(1))
    assert not _namespaces_of(pid)


@needs_cluster
@pytest.mark.timeout(60)
def test_ctrl_c_removes_the_namespaces():
    proc = subprocess.Popen(_emulator("--raw", "--link", "1gbit", "--", sys.executable, "-c",
                                      "import time; time.sleep(120)"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while len(_namespaces_of(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_namespaces_of(proc.pid)) == 3  # 2 nodes + the switch
    time.sleep(0.5)  # let the nodes start
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not _namespaces_of(proc.pid)
