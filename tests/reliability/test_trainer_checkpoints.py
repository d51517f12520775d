"""Trainer checkpoints: a ZeroPPTrainer rank SIGKILLed while ``checkpoint-<step>`` is written leaves a partial folder
of that name; ``latest_trainer_checkpoint`` and ``train(resume_from_checkpoint=True)`` skip it, and the resumed run
logs the same losses as the crashed one. Runs ``tests/trainer_worker.py`` as plain per-rank processes
(:mod:`rank_launcher`). Pins a fix: Trainer resume with ``True`` used to pick the partial folder."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from faults import PG_TIMEOUT
from rank_launcher import launch, last_error_line
from paths import TESTS

TRAINER_WORKER = TESTS / "trainer_worker.py"


@pytest.fixture(scope="module")
def trainer_crash(tmp_path_factory):
    """ZeroPPTrainer on 2 ranks saving every 2 steps; rank 1 is SIGKILLed while checkpoint-4 is written (weights
    on disk, optimizer shards not). Then two resumes: ``resume_from_checkpoint=True``, and the path
    ``hf_zeropp.checkpoint.checkpoint.latest_trainer_checkpoint`` picks."""
    from hf_zeropp.checkpoint.checkpoint import latest_trainer_checkpoint
    from transformers.trainer_utils import get_last_checkpoint

    work = tmp_path_factory.mktemp("trainer")
    out = work / "out"
    base = {"output_dir": str(out), "max_steps": 6, "save_steps": 2, "pg_timeout": PG_TIMEOUT}
    crash = launch(TRAINER_WORKER, {**base, "kill_at_save": 4, "result": str(work / "crash.json")}, work / "crash",
                   2, 2, timeout=400)
    contents = {d.name: sorted(p.name for p in d.iterdir()) for d in out.iterdir() if d.is_dir()}
    picked = {"transformers": get_last_checkpoint(str(out)), "hf_zeropp": latest_trainer_checkpoint(out)}
    resume_true = launch(TRAINER_WORKER, {**base, "resume": True, "result": str(work / "resume_true.json")},
                         work / "resume_true", 2, 2, timeout=400)
    resume_path = launch(TRAINER_WORKER, {**base, "resume": str(picked["hf_zeropp"]),
                                          "result": str(work / "resume_path.json")}, work / "resume_path", 2, 2,
                         timeout=400)

    def result(name):
        path = work / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    return {"crash": (crash, result("crash")), "contents": contents, "picked": picked,
            "resume_true": (resume_true, result("resume_true")), "resume_path": (resume_path, result("resume_path"))}


@pytest.mark.timeout(600)
def test_trainer_crash_mid_save_leaves_a_partial_checkpoint_folder(trainer_crash):
    """What a crash mid-save leaves: the Trainer writes straight into ``checkpoint-4``, so that name exists with
    the weights but without optimizer shards, RNG states or trainer_state.json; transformers' get_last_checkpoint
    (what resume_from_checkpoint=True uses) returns it; latest_trainer_checkpoint skips it."""
    crash, record = trainer_crash["crash"]
    assert crash[1].returncode == -signal.SIGKILL and crash[0].returncode not in (0, None), crash
    assert sorted(record["losses"]) == ["1", "2", "3", "4"], record  # step 4 was logged, then its save crashed
    contents = trainer_crash["contents"]
    assert {"trainer_state.json", "model.safetensors", "zeropp_optimizer"} <= set(contents["checkpoint-2"])
    assert "model.safetensors" in contents["checkpoint-4"]
    assert "trainer_state.json" not in contents["checkpoint-4"] and "zeropp_optimizer" not in contents["checkpoint-4"]
    assert Path(trainer_crash["picked"]["transformers"]).name == "checkpoint-4"
    assert trainer_crash["picked"]["hf_zeropp"].name == "checkpoint-2"


@pytest.mark.timeout(600)
def test_trainer_resumes_exactly_from_the_checkpoint_latest_trainer_checkpoint_picks(trainer_crash):
    """The workaround until the mixin does it for ``True``: ``resume_from_checkpoint=latest_trainer_checkpoint(out)``
    resumes from checkpoint-2 and logs the same losses for steps 3 and 4 as the run that crashed."""
    ranks, result = trainer_crash["resume_path"]
    assert all(r.returncode == 0 for r in ranks), [last_error_line(r.log) for r in ranks]
    assert result["started_at_step"] == 2 and result["final_step"] == 6, result
    assert sorted(result["losses"]) == ["3", "4", "5", "6"], result["losses"]
    crashed = trainer_crash["crash"][1]["losses"]
    assert [result["losses"][s] for s in ("3", "4")] == [crashed[s] for s in ("3", "4")], (result, crashed)


@pytest.mark.timeout(600)
def test_trainer_resume_from_checkpoint_true_never_picks_a_partial_checkpoint(trainer_crash):
    """Trainer.train(resume_from_checkpoint=True) alone takes get_last_checkpoint's partial checkpoint-4 and fails
    on every rank with FileNotFoundError: .../checkpoint-4/trainer_state.json (a crash loop under any restarting
    launcher); the mixin resolves True with latest_trainer_checkpoint."""
    ranks, result = trainer_crash["resume_true"]
    assert result is not None and "error" not in result, result and result.get("error")
    assert all(r.returncode == 0 for r in ranks)
    assert result["started_at_step"] == 2 and result["final_step"] == 6, result
