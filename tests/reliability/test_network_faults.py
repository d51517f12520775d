"""Network faults on the emulated cluster (2 nodes x 2 ranks, 100 Mbit/s links), during ZeRO++ training of the tiny
GPT-2 (``tests/fault_worker.py`` under torchrun in every node's network namespace): packet loss on the links between
nodes (netem, or an eBPF dropper where the kernel has no netem), a link flap, and the loss of a whole node. TCP
retransmits what the link drops, so every run must end with exactly the losses of the run without faults; only its
time may grow. A flap shorter than the process group's timeout must be ridden out the same way. Minutes of runs:
marked slow (``bash scripts/test.sh -m slow -k network``); their results are in docs/reliability.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import ROOT

from hf_zeropp.testing.emulated_network import loss_problem, namespaces_problem

ZEROPP = {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True}
STEPS = 150
PG_TIMEOUT = 60  # seconds; longer than the flap
FAULTS = {"none": [], "loss 1 %": ["--loss", "1"], "loss 5 %": ["--loss", "5"], "flap 5 s": ["--flap", "15,5"]}

_PROBLEM = namespaces_problem()
_LOSS = loss_problem() if _PROBLEM is None else _PROBLEM
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_PROBLEM is not None, reason=f"emulated cluster unavailable: {_PROBLEM}")]


def _train(work: Path, name: str, fault: list[str]) -> dict:
    spec = work / f"{name}.json"
    losses = work / f"{name}-losses.json"
    spec.write_text(json.dumps({"pg_timeout": PG_TIMEOUT, "runs": [
        {"name": name, "config": ZEROPP, "root": str(work / name), "end": STEPS, "losses": str(losses)}]}))
    command = [sys.executable, "-m", "hf_zeropp.testing.emulated_cluster", "--nodes", "2", "--nproc-per-node", "2",
               "--link", "100mbit", "--counters-json", str(work / f"{name}-counters.json"), *fault, "--",
               str(ROOT / "tests" / "fault_worker.py"), str(spec)]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.monotonic() - start
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    counters = json.loads((work / f"{name}-counters.json").read_text())
    return {"losses": json.loads(losses.read_text())["losses"], "wall_s": wall, "flap": counters["flap"],
            "sent": [node["delta"]["tx_packets"] for node in counters["per_node"]], "drops": counters["drops"],
            "loss_by": counters["loss_by"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("network_faults")
    results = {name: _train(work, name.replace(" ", "_").replace("%", "pct"), fault) for name, fault in FAULTS.items()
               if _LOSS is None or not name.startswith("loss")}
    for name, result in results.items():  # the figures docs/reliability.md reports
        print(f"{name}: {result['wall_s']:.1f} s, packets sent per node {result['sent']}, dropped {result['drops']}, "
              f"loss by {result['loss_by']}, "
              f"flap {result['flap']}")
    return results


@pytest.mark.parametrize("fault", [name for name in FAULTS if name != "none"])
def test_training_through_a_network_fault_ends_with_the_same_losses(runs, fault):
    if fault.startswith("loss") and _LOSS is not None:
        pytest.skip(f"packet loss cannot be emulated here: {_LOSS}")
    clean, faulty = runs["none"], runs[fault]
    assert len(faulty["losses"]) == STEPS
    assert faulty["losses"] == clean["losses"], "a fault the transport recovers from must not change any number"


@pytest.mark.parametrize("fault, percent", [("loss 1 %", 1.0), ("loss 5 %", 5.0)])
def test_the_links_dropped_the_asked_share_of_packets(runs, fault, percent):
    """The loss really happened: every node's uplink dropped about ``percent`` % of the packets it sent (netem's or
    the eBPF dropper's count), and the run without faults dropped none."""
    if _LOSS is not None:
        pytest.skip(f"packet loss cannot be emulated here: {_LOSS}")
    assert all(node["uplink"] == 0 for node in runs["none"]["drops"])
    for sent, drops in zip(runs[fault]["sent"], runs[fault]["drops"]):
        assert 0.6 * percent <= 100 * drops["uplink"] / (sent + drops["uplink"]) <= 1.4 * percent, (sent, drops)


def test_the_flap_happened_while_training_ran(runs):
    flap = runs["flap 5 s"]["flap"]
    assert [event["links"] for event in flap] == ["down", "up"]
    assert runs["flap 5 s"]["wall_s"] > flap[1]["t_s"], "the run was still going when the links came back"
    assert runs["flap 5 s"]["wall_s"] >= runs["none"]["wall_s"] + 3, "the outage must show in the wall time"


# ------------------------------------------------------------------------------------------------ node loss

NODE_LOSS_STEPS, NODE_LOSS_AT, SAVE_EVERY = 10, 7, 2


def _trainer_on_the_cluster(work: Path, name: str, output_dir: str, zeropp: dict, kill_node_at: int | None,
                            max_restarts: int = 0) -> dict:
    """``tests/trainer_worker.py`` (ZeroPPTrainer, checkpoints every ``SAVE_EVERY`` steps into ``output_dir``,
    resuming from the newest complete one there if any) on 2 emulated nodes x 2 ranks; torchrun restarts a node's
    workers up to ``max_restarts`` times (the node loss then happens in the first attempt only)."""
    spec = {"output_dir": output_dir, "max_steps": NODE_LOSS_STEPS, "save_steps": SAVE_EVERY, "pg_timeout": 30,
            "resume": "latest", "zeropp": {**zeropp, "node_size": 2}, "result": str(work / f"{name}.json")}
    if kill_node_at is not None:
        spec["kill_node_at_step"] = kill_node_at
    (work / f"{name}-spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "hf_zeropp.testing.emulated_cluster", "--nodes", "2", "--nproc-per-node", "2",
               "--link", "1gbit", "--grace", "60", "--max-restarts", str(max_restarts), "--",
               str(ROOT / "tests" / "trainer_worker.py"),
               str(work / f"{name}-spec.json")]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {"returncode": done.returncode, "log": (done.stdout + done.stderr)[-4000:],
            "wall_s": time.monotonic() - start, "result": json.loads((work / f"{name}.json").read_text())}


@pytest.mark.parametrize("preset", ["zero3", "zeropp"])
def test_a_lost_node_ends_the_job_and_the_rerun_resumes_from_the_last_checkpoint_with_the_same_losses(tmp_path,
                                                                                                   preset):
    """Every rank of node 1 is SIGKILLed at the end of step 7, before that step is logged or saved. Node 0's ranks
    fail on the dead connections and the whole job ends with an error (no hang). The job started again, as a
    scheduler requeues it, resumes from checkpoint-6, the newest complete one, and logs exactly the losses of a run
    without the fault for steps 7-10 (bit-exact): one step is lost."""
    zeropp = {"stage": 3} if preset == "zero3" else ZEROPP
    clean = _trainer_on_the_cluster(tmp_path, "clean", str(tmp_path / "clean"), zeropp, None)
    lost = _trainer_on_the_cluster(tmp_path, "lost", str(tmp_path / "job"), zeropp, NODE_LOSS_AT)
    rerun = _trainer_on_the_cluster(tmp_path, "rerun", str(tmp_path / "job"), zeropp, None)
    print(f"{preset}: clean {clean['wall_s']:.1f} s; with node 1 lost at step {NODE_LOSS_AT} the job ended after "
          f"{lost['wall_s']:.1f} s; the rerun took {rerun['wall_s']:.1f} s")
    assert clean["returncode"] == 0 and rerun["returncode"] == 0, rerun["log"]
    assert lost["returncode"] != 0, lost["log"]
    last_saved = NODE_LOSS_AT - NODE_LOSS_AT % SAVE_EVERY
    assert sorted(map(int, lost["result"]["losses"])) == list(range(1, NODE_LOSS_AT)), lost["result"]
    assert rerun["result"]["started_at_step"] == last_saved, rerun["result"]
    expected = clean["result"]["losses"]
    assert sorted(map(int, rerun["result"]["losses"])) == list(range(last_saved + 1, NODE_LOSS_STEPS + 1))
    assert rerun["result"]["losses"] == {step: expected[step] for step in rerun["result"]["losses"]}, (rerun, clean)


@pytest.mark.parametrize("preset", ["zero3", "zeropp"])
def test_a_lost_node_restarted_by_torchrun_finishes_the_job_with_the_same_losses(tmp_path, preset):
    """``torchrun --max-restarts 1`` on every node, with the c10d rendezvous and a fresh store per round: node 1's
    agent restarts its killed workers, node 0's agent sees them waiting and restarts its own, and the new workers
    resume from checkpoint-6 inside the same job, which ends with status 0 and the uninterrupted run's losses for
    steps 7-10 (bit-exact)."""
    zeropp = {"stage": 3} if preset == "zero3" else ZEROPP
    clean = _trainer_on_the_cluster(tmp_path, "clean", str(tmp_path / "clean"), zeropp, None)
    restarted = _trainer_on_the_cluster(tmp_path, "restarted", str(tmp_path / "job"), zeropp, NODE_LOSS_AT,
                                        max_restarts=1)
    print(f"{preset}: clean {clean['wall_s']:.1f} s; with node 1 lost at step {NODE_LOSS_AT} and restarted by "
          f"torchrun, the job took {restarted['wall_s']:.1f} s")
    assert clean["returncode"] == 0 and restarted["returncode"] == 0, restarted["log"]
    last_saved = NODE_LOSS_AT - NODE_LOSS_AT % SAVE_EVERY
    assert restarted["result"]["started_at_step"] == last_saved, restarted["result"]
    expected = clean["result"]["losses"]
    assert sorted(map(int, restarted["result"]["losses"])) == list(range(last_saved + 1, NODE_LOSS_STEPS + 1))
    assert restarted["result"]["losses"] == {step: expected[step] for step in restarted["result"]["losses"]}
