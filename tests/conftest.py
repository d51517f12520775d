"""Fixtures shared by several test modules: the faulty 4-rank runs (a rank SIGKILLed mid-step, another mid-save)
that both ``tests/test_rank_failures.py`` and ``tests/test_exact_resume.py`` examine. Session-scoped, so each run
happens once however many of those modules are collected."""

from __future__ import annotations

import pytest

from faults import FAULT_AT, SAVE_AT, faulty_run, run_spec


@pytest.fixture(scope="session")
def resume_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="session")
def killed_mid_step(resume_dir):
    """ZeRO-3: rank 2 SIGKILLs itself inside the forward of step 16 (index 15)."""
    work = resume_dir / "killed_mid_step"
    return faulty_run(work, run_spec("stage3", work / "stage3", work / "stage3.json",
                                     kill={"rank": 2, "step": FAULT_AT, "where": "forward"}))


@pytest.fixture(scope="session")
def killed_mid_save(resume_dir):
    """ZeRO++: rank 1 SIGKILLs itself while checkpoint-15 is saved, right after its DCP shard file was written."""
    work = resume_dir / "killed_mid_save"
    return faulty_run(work, run_spec("zeropp", work / "zeropp", work / "zeropp.json", save_at=[SAVE_AT, FAULT_AT],
                                     kill={"rank": 1, "step": FAULT_AT, "where": "dcp_write"}))
