"""One rank of a ZeroPPTrainer run that can crash in the middle of writing a Trainer checkpoint (the Trainer
checkpoint tests, ``tests/reliability/test_trainer_checkpoints.py``).

Usage: ``python tests/trainer_worker.py SPEC.json`` under :mod:`rank_launcher` (RANK, WORLD_SIZE, MASTER_ADDR, ...
in the environment; Accelerate creates the process group). The spec::

    {"output_dir": "...", "max_steps": 6, "save_steps": 2, "pg_timeout": 20,
     "kill_at_save": 4,            # optional: rank 1 dies (SIGKILL) when the Trainer saves checkpoint-4, after the
                                   # consolidated weights were written and before the optimizer shards
     "kill_node_at_step": 5,       # optional: under torchrun on several nodes, every rank of node 1 dies
                                   # (SIGKILL) at the end of this step: a node lost
     "resume": true,               # optional: train(resume_from_checkpoint=<this>): true, or a checkpoint path;
                                   # "latest": the newest complete checkpoint if there is one (a restarted run)
     "zeropp": {"stage": 3},       # optional: the config (default stage 3)
     "result": ".../result.json"}  # rank 0 writes what happened: the global step training started from, the
                                   # loss logged at each step of this run (as it happens), the error if any

The Trainer writes its checkpoint straight into ``checkpoint-<step>`` (model, then optimizer, RNG, trainer state),
so a crash in between leaves a partial folder with that name.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from hf_zeropp.testing.tiny_models import global_batch, tiny_gpt2


def main() -> None:
    from transformers import TrainerCallback

    import hf_zeropp
    from hf_zeropp.checkpoint.checkpoint import latest_trainer_checkpoint

    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result: dict = {"rank": rank}

    def write_result() -> None:
        if rank == 0:
            Path(spec["result"]).write_text(json.dumps(result))

    class Record(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            result["started_at_step"] = state.global_step
            result["losses"] = {}

        def on_step_end(self, args, state, control, **kwargs):
            node = int(os.environ.get("GROUP_RANK", "0"))
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # a restarted node survives
            if node == 1 and first_attempt and state.global_step == spec.get("kill_node_at_step"):
                os.kill(os.getpid(), signal.SIGKILL)

        def on_log(self, args, state, control, logs=None, **kwargs):  # written as it happens: a crash may follow
            if logs and "loss" in logs:
                result["losses"][state.global_step] = logs["loss"]
                write_result()

    class CrashingTrainer(hf_zeropp.ZeroPPTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            if rank == 1 and self.state.global_step == spec.get("kill_at_save"):
                os.kill(os.getpid(), signal.SIGKILL)  # the weights of this checkpoint are on disk, nothing else
            super()._save_optimizer_and_scheduler(output_dir)

    batches = torch.cat([global_batch(step, size=8) for step in range(4)])
    dataset = [{"input_ids": ids, "labels": ids} for ids in batches]
    args = hf_zeropp.ZeroPPTrainingArguments(
        output_dir=spec["output_dir"], max_steps=spec["max_steps"], per_device_train_batch_size=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=spec["save_steps"], report_to="none",
        use_cpu=True, seed=0, ddp_timeout=spec["pg_timeout"], zeropp=spec.get("zeropp", {"stage": 3}),
        dataloader_num_workers=0)
    trainer = CrashingTrainer(model=tiny_gpt2(), args=args, train_dataset=dataset, callbacks=[Record()])
    try:
        resume = spec.get("resume")
        if resume == "latest":
            latest = latest_trainer_checkpoint(spec["output_dir"])
            resume = str(latest) if latest is not None else None
        trainer.train(resume_from_checkpoint=resume)
        result["log"] = [entry for entry in trainer.state.log_history if "loss" in entry]
        result["final_step"] = trainer.state.global_step
        # as in scripts/train_gpt.py: tear the process group down on every rank together, not at interpreter exit
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.end_training()
    except Exception as error:  # record what the resume did, then fail this rank as the Trainer would
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()
        raise
    finally:
        write_result()


if __name__ == "__main__":
    main()
    # The work is done and the process group destroyed. Under heavy load, interpreter teardown once aborted one rank
    # ("terminate called without an active exception": a C++ thread still joinable when its owner was destroyed at
    # exit); skip the teardown so that the exit status says how the run went.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
