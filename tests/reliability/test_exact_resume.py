"""Exact resume: 20 steps, checkpoint at 10, killed at 15, resumed from 10: steps 11-20 bit-identical to an
uninterrupted run, for ZeRO-3, ZeRO++ (2 emulated nodes x 2), ZeRO++ with stochastic rounding and ZeRO++ with qgZ
error feedback; until the fault the faulty runs match the uninterrupted one. The faulty runs (``killed_mid_step``,
``killed_mid_save`` in ``conftest.py``) are shared with ``tests/reliability/test_rank_failures.py``. The soak (hundreds
of steps, memory flat) is ``scripts/soak.py``, not a test: it runs for minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults import PG_TIMEOUT, RESUME_CONFIGS, SAVE_AT, STEPS, WORKER, read_losses, run_spec
from rank_launcher import launch, last_error_line


@pytest.fixture(scope="module")
def uninterrupted(resume_dir):
    """20 steps of each configuration without a fault (checkpoint at 10 as in the faulty runs)."""
    work = resume_dir / "uninterrupted"
    spec = {"pg_timeout": PG_TIMEOUT,
            "runs": [run_spec(name, work / name, work / f"{name}.json") for name in RESUME_CONFIGS]}
    ranks = launch(WORKER, spec, work, 4, 2, timeout=500)
    assert all(r.returncode == 0 for r in ranks), [last_error_line(r.log) for r in ranks]
    return {name: read_losses(work / f"{name}.json") for name in RESUME_CONFIGS}


@pytest.mark.timeout(600)
def test_faulty_runs_match_the_uninterrupted_run_until_the_fault(uninterrupted, killed_mid_step, killed_mid_save):
    for name, run in (("stage3", killed_mid_step), ("zeropp", killed_mid_save)):
        for step, loss in run["losses"].items():
            assert loss == uninterrupted[name][step], (name, step)


@pytest.fixture(scope="module")
def resumed(resume_dir, killed_mid_step, killed_mid_save, uninterrupted):
    """One launch resuming all four from their latest checkpoint: the two faulty runs' roots, and the
    uninterrupted runs' roots for stochastic rounding and error feedback."""
    work = resume_dir / "resumed"
    roots = {"stage3": resume_dir / "killed_mid_step" / "stage3", "zeropp": resume_dir / "killed_mid_save" / "zeropp",
             "zeropp_sr": resume_dir / "uninterrupted" / "zeropp_sr",
             "zeropp_ef": resume_dir / "uninterrupted" / "zeropp_ef"}
    spec = {"pg_timeout": PG_TIMEOUT,
            "runs": [run_spec(name, roots[name], work / f"{name}.json", resume=True, save_at=[]) for name in roots]}
    ranks = launch(WORKER, spec, work, 4, 2, timeout=500)
    assert all(r.returncode == 0 for r in ranks), [last_error_line(r.log) for r in ranks]
    return {name: json.loads((work / f"{name}.json").read_text()) for name in roots}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def test_resume_from_step_10_reproduces_steps_11_to_20_exactly(resumed, uninterrupted, name):
    """Bit-identical losses after resuming: weights, AdamW state, LR schedule, (for stochastic rounding) the qgZ
    rounding seeds and (for error feedback) its residuals all continue where the checkpoint left them."""
    record = resumed[name]
    assert Path(record["resumed_from"]).name == f"checkpoint-{SAVE_AT}"
    got = {int(k): v for k, v in record["losses"].items()}
    assert sorted(got) == list(range(SAVE_AT, STEPS))
    expected = {step: uninterrupted[name][step] for step in range(SAVE_AT, STEPS)}
    assert got == expected, {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}
