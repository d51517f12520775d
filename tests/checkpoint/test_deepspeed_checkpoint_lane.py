"""DeepSpeed checkpoints both ways with DeepSpeed 0.19.8 running beside hf_zeropp (the opt-in DeepSpeed lane:
``scripts/test_deepspeed.sh``, in .venv-deepspeed, with ``DS_ACCELERATOR=cpu``).

* DeepSpeed -> hf_zeropp: DeepSpeed writes the fixtures of tests/fixtures/deepspeed/checkpoints again, now, and its
  records equal the committed ones (so the main CI, which reads the committed files, tests today's DeepSpeed); hf_zeropp
  resumes the fresh checkpoint as DeepSpeed resumed it.
* hf_zeropp -> DeepSpeed: hf_zeropp trains 3 steps, saves, exports a universal checkpoint
  (:func:`hf_zeropp.export_deepspeed_universal`), and trains 3 more; DeepSpeed resumes the export (``load_universal``)
  on ZeRO-1, 2 and 3 and must give hf_zeropp's learning rates, and its losses and final weights within twice
  DeepSpeed's own distance from one unsharded process. The same with the Trainer: a stock Trainer script under
  ``hf-zeropp launch`` saves checkpoint-6, ``hf-zeropp to-deepspeed`` exports it, and the same script under DeepSpeed
  resumes it for steps 7-12.

DeepSpeed 0.19.8's ZeRO-3 universal loader gives all parameter groups one shared step tensor (and the first group's
hyperparameters): with a torch optimizer of several groups its steps after loading differ from an uninterrupted run,
for its own ``ds_to_universal`` conversions as for hf_zeropp's exports. The ZeRO-3 case here uses one group; the
Trainer case resumes on ZeRO-2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from paths import ROOT

from hf_zeropp.testing.spawn import run_distributed
from scripts.deepspeed_reference import checkpoints, recipe

pytestmark = pytest.mark.deepspeed

FIXTURES = checkpoints.FIXTURES
FLOOR = 1e-6
LIVE = ("zero3_bf16_w4", "zero1_fp32_w2")


def _within(got: dict, reference: dict, weights: dict[str, torch.Tensor], distance: dict) -> None:
    """hf_zeropp's or DeepSpeed's run against the other: equal learning rates, losses and final fp32 weights within
    twice DeepSpeed's own distance from an unsharded run."""
    assert got["lrs"] == pytest.approx(reference["lrs"], rel=1e-12, abs=0)
    loss_gap = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"]))
    assert loss_gap <= 2 * distance["loss"] + FLOOR, (got["losses"], reference["losses"])
    names = weights.keys() & got["weights"].keys()  # DeepSpeed lists a tied weight once
    assert len(names) == 28, sorted(names)
    weight_gap = max(float((got["weights"][k].float() - weights[k].float()).abs().max()) for k in names)
    assert weight_gap <= 2 * distance["weight"] + FLOOR, weight_gap


# ---------------------------------------------------------------- DeepSpeed -> hf_zeropp


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("live")
    for name in LIVE:
        checkpoints.generate_engine_fixture(name, checkpoints.ENGINE_FIXTURES[name], root)
    return root


@pytest.mark.parametrize("name", LIVE)
def test_the_committed_fixtures_are_what_deepspeed_writes_today(live, name):
    fresh, committed = (json.loads((folder / name / "expected.json").read_text()) for folder in (live, FIXTURES))
    for run in ("uninterrupted", "ds_resumed", "single_process"):
        assert fresh[run] == committed[run], run
    assert fresh["deepspeed"] == committed["deepspeed"] == "0.19.8"


def _resume_live(folder: str, name: str, preset: str) -> dict:
    return recipe.resume_under_hf_zeropp(Path(folder) / "checkpoint", checkpoints.ENGINE_FIXTURES[name], preset)


@pytest.mark.parametrize("name,preset,world", [("zero3_bf16_w4", "zero3", 2), ("zero1_fp32_w2", "zero2", 4)])
def test_hf_zeropp_resumes_deepspeeds_fresh_checkpoint_as_deepspeed_does(live, name, preset, world):
    record = json.loads((live / name / "expected.json").read_text())
    got = run_distributed(_resume_live, world, str(live / name), name, preset, node_size=2, timeout=600)[0]
    _within(got, record["ds_resumed"], load_file(str(live / name / "ds_resumed_weights.safetensors")),
            record["distance"])


# ---------------------------------------------------------------- hf_zeropp -> DeepSpeed


def _hf_zeropp_run(folder: str, single_group: bool) -> dict:
    """hf_zeropp's ZeRO-3 run of the recipe from its initial weights, saving after step 3."""
    import hf_zeropp

    model = recipe.tiny_gpt2(seed=0)
    hf_zeropp.shard_model(model, "zero3")
    optimizer = recipe.make_optimizer(model, single_group)
    scheduler = recipe.make_scheduler(optimizer)
    for step in range(recipe.STEPS_BEFORE_SAVE):
        ids = recipe.local_batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    hf_zeropp.save_checkpoint(Path(folder) / "hf_zeropp", model, optimizer, scheduler, step=recipe.STEPS_BEFORE_SAVE)
    return recipe.train_after_save(model, optimizer, scheduler)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[bool, tuple[Path, dict]]:
    """hf_zeropp's runs (two parameter groups, and one) with their universal exports."""
    import hf_zeropp

    runs = {}
    for single_group in (False, True):
        folder = tmp_path_factory.mktemp("one_group" if single_group else "two_groups")
        result = run_distributed(_hf_zeropp_run, 2, str(folder), single_group, timeout=600)[0]
        hf_zeropp.export_deepspeed_universal(folder / "hf_zeropp", folder / "export")
        runs[single_group] = folder, result
    return runs


@pytest.mark.parametrize("stage,world,single_group", [(1, 4, False), (2, 4, False), (2, 2, False), (3, 4, True)])
def test_deepspeed_resumes_hf_zeropps_universal_export(exported, tmp_path, stage, world, single_group):
    folder, hf_run = exported[single_group]
    shutil.copytree(folder / "export", tmp_path / "checkpoint")
    record = checkpoints.deepspeed_resume(tmp_path, {"stage": stage, "precision": "fp32", "world": world,
                                                     "universal": True, "single_group": single_group})
    reference = json.loads((FIXTURES / "zero2_fp32_w4" / "expected.json").read_text())["distance"]
    deepspeed = {**record["ds_resumed"], "weights": load_file(str(tmp_path / "ds_resumed_weights.safetensors"))}
    _within(deepspeed, hf_run, hf_run["weights"], reference)


def _launch(command: list[str], env: dict[str, str] | None = None) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ZEROPP_")}
    # .venv-deepspeed reaches hf_zeropp's checkout through PYTHONPATH (its layered site-packages skip .venv's .pth)
    result = subprocess.run(command, cwd=ROOT, env={**full, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                                    **(env or {})}, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


def test_deepspeed_trainer_resumes_an_hf_zeropp_trainer_checkpoint(tmp_path):
    """The stock Trainer script under ``hf-zeropp launch`` (ZeRO-3, bf16, 4 ranks) saves checkpoint-6 and trains
    to step 12; ``hf-zeropp to-deepspeed`` exports checkpoint-6; the same script under DeepSpeed ZeRO-2 with
    ``load_universal`` resumes it: its steps 7-12 have hf_zeropp's learning rates and losses within twice DeepSpeed's
    own distance from the script in one process (the committed Trainer fixture's)."""
    config = json.loads((FIXTURES / checkpoints.TRAINER_FIXTURE / "ds_config.json").read_text())
    (tmp_path / "hf_zeropp.json").write_text(json.dumps(config))
    arguments = json.loads((FIXTURES / checkpoints.TRAINER_FIXTURE / "arguments.json").read_text())
    _launch([sys.executable, "-m", "hf_zeropp", "launch", "--config_file",
             str(ROOT / "recipes" / "accelerate" / "cpu_4proc.yaml"), "--main_process_port", checkpoints._port(),
             str(checkpoints.TRAINER_SCRIPT), "--deepspeed", str(tmp_path / "hf_zeropp.json"), *arguments,
             "--output_dir", str(tmp_path / "hf_zeropp")])
    _launch([sys.executable, "-m", "hf_zeropp", "to-deepspeed", str(tmp_path / "hf_zeropp" / "checkpoint-6"),
             str(tmp_path / "export" / "checkpoint-6")])
    resuming = {**config, "zero_optimization": {**config["zero_optimization"], "stage": 2},
                "checkpoint": {"load_universal": True}}
    for key in [k for k in resuming["zero_optimization"] if k.startswith("stage3_") or k == "sub_group_size"]:
        del resuming["zero_optimization"][key]
    (tmp_path / "deepspeed.json").write_text(json.dumps(resuming))
    log = checkpoints.run_logged(checkpoints.trainer_command(
        tmp_path / "deepspeed.json", tmp_path / "deepspeed", "--resume_from_checkpoint",
        str(tmp_path / "export" / "checkpoint-6"), "--log_level", "info"), "trainer_from_hf_zeropp.log")
    assert checkpoints.RESUMED_MESSAGE in log
    steps = {}
    for run in ("hf_zeropp", "deepspeed"):
        history = json.loads((tmp_path / run / "trainer_state.json").read_text())["log_history"]
        steps[run] = {entry["step"]: entry for entry in history if "loss" in entry}
    fixture = FIXTURES / checkpoints.TRAINER_FIXTURE
    single, uninterrupted = ({e["step"]: e for e in json.loads((fixture / f"{run}.json").read_text()) if "loss" in e}
                             for run in ("single_process", "uninterrupted"))
    distance = max(abs(uninterrupted[s]["loss"] - single[s]["loss"]) for s in single)
    for step in range(7, 13):
        ours, theirs = steps["hf_zeropp"][step], steps["deepspeed"][step]
        assert theirs["learning_rate"] == pytest.approx(ours["learning_rate"], rel=1e-12), step
        assert abs(theirs["loss"] - ours["loss"]) <= 2 * distance + FLOOR, (step, ours, theirs)
    assert steps["deepspeed"][7]["loss"] == pytest.approx(steps["hf_zeropp"][7]["loss"], rel=1e-3)
