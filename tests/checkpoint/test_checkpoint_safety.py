"""Crash-safe checkpoints: a SIGKILL at each point of ``save_checkpoint`` (a forked single process, cheap) leaves the
previous checkpoint as ``latest_checkpoint()`` and loadable, and the next save of the same name cleans up what the
crash left. A rank killed in the middle of a 4-rank save is in ``tests/reliability/test_rank_failures.py``; the
Trainer's partial ``checkpoint-<step>`` folders are in ``tests/reliability/test_trainer_checkpoints.py``."""

from __future__ import annotations

import multiprocessing
import signal
from pathlib import Path

import pytest
import torch

import hf_zeropp
from faults import die
from hf_zeropp.testing.tiny_models import full_parameters, make_optimizer, tiny_gpt2, train


def _save_and_die(root: str, name: str, where: str, model, optimizer, scheduler) -> None:
    """In a forked child: train one more step, then save ``root/name`` and SIGKILL ourselves at ``where``."""
    import pathlib

    from torch.distributed.checkpoint import filesystem

    from hf_zeropp.checkpoint import checkpoint

    torch.set_num_threads(1)  # a forked child must not touch the parent's OpenMP pool
    train(model, optimizer, range(5, 6))
    if where == "dcp_write":  # this rank's shard file is written, DCP's .metadata is not
        original_write = filesystem._FileSystemWriter.write_data

        def write_data(self, plan, planner):
            original_write(self, plan, planner).wait()
            die()

        filesystem._FileSystemWriter.write_data = write_data
    elif where == "after_dcp":  # all model/optimizer shards and .metadata written; no RNG, no zeropp_meta.json
        original_save = checkpoint.dcp.save
        checkpoint.dcp.save = lambda *args, **kwargs: (original_save(*args, **kwargs), die())
    elif where == "before_commit":  # the partial folder is complete, but not yet renamed into place
        checkpoint._commit = lambda partial, directory: die()
    elif where == "between_renames":  # overwriting: the old folder was moved aside, the new one not yet in place
        original_rename = pathlib.Path.rename

        def rename(self, target):
            result = original_rename(self, target)
            if str(target).endswith(".replaced"):
                die()
            return result

        pathlib.Path.rename = rename
    hf_zeropp.save_checkpoint(Path(root) / name, model, optimizer, scheduler, step=6)
    raise SystemExit(0)  # not reached


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["dcp_write", "after_dcp", "before_commit", "between_renames"])
def test_sigkill_during_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, where):
    """One process (no process group: DCP's single-process path) SIGKILLed at each point of save_checkpoint.
    ``between_renames`` overwrites the same folder — the case where a crash could leave no folder of that name."""
    model = tiny_gpt2()
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    train(model, optimizer, range(5))
    scheduler.step()
    hf_zeropp.save_checkpoint(tmp_path / "checkpoint-5", model, optimizer, scheduler, step=5)
    saved = full_parameters(model)
    name = "checkpoint-5" if where == "between_renames" else "checkpoint-6"
    child = multiprocessing.get_context("fork").Process(
        target=_save_and_die, args=(str(tmp_path), name, where, model, optimizer, scheduler))
    child.start()
    child.join(timeout=90)
    assert child.exitcode == -signal.SIGKILL, child.exitcode

    latest = hf_zeropp.latest_checkpoint(tmp_path)
    expected = ".checkpoint-5.replaced" if where == "between_renames" else "checkpoint-5"
    assert latest is not None and latest.name == expected, (latest, sorted(p.name for p in tmp_path.iterdir()))
    assert not (tmp_path / "checkpoint-6").exists()
    fresh = tiny_gpt2(seed=1)
    fresh_optimizer = make_optimizer(fresh)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=2, gamma=0.5)
    meta = hf_zeropp.load_checkpoint(latest, fresh, fresh_optimizer, fresh_scheduler)
    assert meta["step"] == 5
    restored = full_parameters(fresh)
    assert all(torch.equal(restored[n], saved[n]) for n in saved)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()

    # the next save of the same name succeeds and cleans up what the crash left
    hf_zeropp.save_checkpoint(tmp_path / name, model, optimizer, scheduler, step=6 if name == "checkpoint-6" else 5)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"checkpoint-5", name})
    assert hf_zeropp.latest_checkpoint(tmp_path).name == name
