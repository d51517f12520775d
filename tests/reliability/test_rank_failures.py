"""Rank failures: a rank killed (SIGKILL) mid-step or in the middle of a 4-rank checkpoint save, or hung (SIGSTOP) in
backward, makes every other rank exit non-zero within the process-group timeout. Uses plain per-rank processes
(:mod:`rank_launcher` running ``tests/fault_worker.py``) so that every survivor's own exit code and exit time are
observed. The faulty runs (``killed_mid_step``, ``killed_mid_save`` in ``conftest.py``) are shared with
``tests/reliability/test_exact_resume.py``. Pins fixes (their docstrings say what used to go wrong): the timeout of
hf_zeropp's node groups, and ``run_distributed`` noticing a dead rank at once."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch.distributed as dist

import hf_zeropp
from faults import EXIT_MARGIN, FAULT_AT, PG_TIMEOUT, SAVE_AT, WORKER, ZEROPP, die
from hf_zeropp.testing.spawn import run_distributed
from rank_launcher import launch, last_error_line


def _assert_survivors_exit_nonzero_in_time(run: dict, killed_rank: int) -> None:
    assert run["killed"] is not None and run["killed"]["rank"] == killed_rank, "the fault was not injected"
    for rank_exit in run["ranks"]:
        if rank_exit.rank == killed_rank:
            assert rank_exit.returncode == -signal.SIGKILL
            continue
        assert rank_exit.returncode is not None, f"rank {rank_exit.rank} hung after the fault"
        assert rank_exit.returncode != 0, f"rank {rank_exit.rank} exited 0 after a peer died"
        took = rank_exit.exited_at - run["killed"]["time"]
        assert took <= PG_TIMEOUT + EXIT_MARGIN, (rank_exit.rank, took)
        assert "RuntimeError" in last_error_line(rank_exit.log), last_error_line(rank_exit.log)


@pytest.mark.timeout(600)
def test_rank_sigkilled_mid_step_makes_every_other_rank_exit_nonzero(killed_mid_step):
    _assert_survivors_exit_nonzero_in_time(killed_mid_step, killed_rank=2)
    assert sorted(killed_mid_step["losses"]) == list(range(FAULT_AT))  # steps 0-14 ran, step 15 did not finish


@pytest.mark.timeout(600)
def test_rank_sigkilled_mid_save_leaves_the_previous_checkpoint_latest(killed_mid_save, resume_dir):
    _assert_survivors_exit_nonzero_in_time(killed_mid_save, killed_rank=1)
    root = resume_dir / "killed_mid_save" / "zeropp"
    assert hf_zeropp.latest_checkpoint(root) == root / f"checkpoint-{SAVE_AT}"
    assert not (root / f"checkpoint-{FAULT_AT}").exists()
    partial = root / f".checkpoint-{FAULT_AT}.partial"
    written = sorted(p.name for p in partial.iterdir())
    assert any(name.endswith(".distcp") for name in written) and "zeropp_meta.json" not in written, written


def _sigkill_rank_1():
    if dist.get_rank() == 1:
        die()
    dist.barrier()
    return dist.get_rank()


@pytest.mark.timeout(180)
def test_run_distributed_reports_a_rank_that_died_without_reporting_at_once():
    """hf_zeropp.testing.spawn.run_distributed used to wait its whole ``timeout`` (300 s) for a rank that was SIGKILLed;
    it now notices the dead process at once and says how it died."""
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run_distributed(_sigkill_rank_1, 3, timeout=300, pg_timeout=PG_TIMEOUT)
    message = str(raised.value)
    assert "rank 1:\ndied without reporting (killed by signal 9)" in message, message
    assert time.monotonic() - started < 120


def _report_process_state():
    print(f"stdout of rank {dist.get_rank()}", flush=True)
    print(f"stderr of rank {dist.get_rank()}", file=sys.stderr, flush=True)
    return os.environ.get("HF_ZEROPP_TEST_MARK"), os.getcwd()


@pytest.mark.timeout(180)
def test_run_distributed_ranks_see_the_callers_environment_directory_and_output(monkeypatch, capfd, tmp_path):
    """Ranks are forked from a fork server that started with an earlier test's environment, directory and output
    files; each run must still hand its ranks the caller's, as spawning them did (a test's variables, pytest's
    capture of this test's output)."""
    for mark in ("first", "second"):  # the server is running by the second run whatever ran before
        monkeypatch.setenv("HF_ZEROPP_TEST_MARK", mark)
        directory = tmp_path / mark
        directory.mkdir()
        monkeypatch.chdir(directory)
        assert run_distributed(_report_process_state, 2) == [(mark, str(directory))] * 2
        out, err = capfd.readouterr()
        for stream, text in (("stdout", out), ("stderr", err)):  # the ranks' writes may interleave
            assert f"{stream} of rank 0" in text and f"{stream} of rank 1" in text, text


@pytest.mark.timeout(300)
def test_rank_hung_in_backward_with_zeropp_makes_the_others_exit_within_the_timeout(tmp_path):
    """ZeRO++: rank 2 freezes (SIGSTOP) in backward, where hpZ gathers and qgZ all-to-alls run on the node and
    inter-node groups. A frozen rank keeps its sockets open, so only the process-group timeout can end the wait —
    on *every* group: DeviceMesh groups built without a timeout get torch's 30-minute default, whatever the world
    group's timeout is (survivors were still waiting 60 s after the freeze with a 15 s world timeout)."""
    timeout = 10
    run = {"name": "zeropp", "config": ZEROPP, "root": str(tmp_path / "root"), "losses": str(tmp_path / "l.json"),
           "end": 4, "save_at": [], "kill": {"rank": 2, "step": 1, "where": "backward_hang"}}
    marker = tmp_path / "l.killed"
    allowed = timeout + 20  # with the world group's timeout on every group, survivors exit after ~timeout + 5 s
    ranks = launch(WORKER, {"pg_timeout": timeout, "runs": [run]}, tmp_path, 4, 2, timeout=200, fault_marker=marker,
                   after_fault=allowed)
    frozen_at = json.loads(marker.read_text())["time"]
    for rank_exit in ranks:
        if rank_exit.rank != 2:
            assert rank_exit.returncode not in (0, None), \
                f"rank {rank_exit.rank} still waiting {allowed} s after rank 2 froze (process-group timeout {timeout} s)"
            assert rank_exit.exited_at - frozen_at <= allowed
