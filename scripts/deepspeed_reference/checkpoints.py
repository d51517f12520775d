"""Write the DeepSpeed checkpoint fixtures in tests/fixtures/deepspeed/checkpoints, with what DeepSpeed's own resume of
each gives, so that the main CI (no DeepSpeed) can resume them under hf_zeropp and compare.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-deepspeed/bin/python -m scripts.deepspeed_reference.checkpoints

(``--only NAME ...`` for some.) Engine fixtures (:data:`ENGINE_FIXTURES`: ZeRO-1/2/3 in fp32, bf16 and fp16 on 2 or
4 CPU ranks, DeepSpeed's BF16_Optimizer, one with DeepSpeed's own WarmupDecayLR, one through Accelerate's
``save_state``): DeepSpeed's engine trains the recipe of
:mod:`scripts.deepspeed_reference.recipe` for 3 steps and saves (``checkpoint/``: ``latest``, ``global_step3/``); the
same run goes on for 3 more steps (uninterrupted); a fresh engine, built from other initial weights, loads the
checkpoint and trains the same 3 steps (DeepSpeed's own resume). ``expected.json`` records the losses and learning
rates of all three, ``ds_resumed_weights.safetensors`` the resumed run's final fp32 weights, and ``distance`` how far
DeepSpeed's uninterrupted run lands from one process training the same steps unsharded
(``recipe.single_process_run``): the yardstick hf_zeropp's resume is held to. ``universal_from_zero2_fp32_w4`` is
``ds_to_universal``'s conversion of that fixture's checkpoint, resumed by DeepSpeed on 2 ranks.

``trainer_zero3_bf16_w4``: ``tests/launch_scripts/trainer_resumable.py`` (a stock Trainer script) under DeepSpeed
ZeRO-3 on 4 ranks in bf16 with the Transformers-docs config; ``checkpoint-6/`` is its Trainer checkpoint;
``uninterrupted.json`` and ``resumed.json`` the Trainer logs of 12 steps straight and of DeepSpeed's own resume from
step 6, and ``single_process.json`` the same script's log in one process without DeepSpeed (the yardstick).
``trainer_zero3_bf16_w4_ds_optimizer``: the same with the config's optimizer (AdamW) and scheduler (WarmupLR)
sections, its yardstick the script under DeepSpeed in one process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import recipe

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "deepspeed" / "checkpoints"
TRAINER_SCRIPT = ROOT / "tests" / "launch_scripts" / "trainer_resumable.py"
LOGS = Path(tempfile.gettempdir()) / "deepspeed_reference_logs"

ENGINE_FIXTURES = {
    "zero1_fp32_w2": {"stage": 1, "precision": "fp32", "world": 2},
    "zero1_bf16_w4": {"stage": 1, "precision": "bf16", "world": 4},
    "zero2_fp32_w4": {"stage": 2, "precision": "fp32", "world": 4},
    "zero2_bf16_w2": {"stage": 2, "precision": "bf16", "world": 2},
    "zero3_fp32_w2": {"stage": 3, "precision": "fp32", "world": 2},
    "zero3_bf16_w4": {"stage": 3, "precision": "bf16", "world": 4},
    "zero2_fp16_w2": {"stage": 2, "precision": "fp16", "world": 2},
    # bf16 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, a ZeRO-1 layout of its own
    "zero1_bf16_fp32_accumulation_w2": {"stage": 1, "precision": "bf16", "world": 2, "grad_accum_dtype": "fp32"},
    # DeepSpeed's own scheduler (its config's section) on the Trainer's optimizer: a {"last_batch_iteration": k} state
    # Accelerate's save_state under DeepSpeed (its tag folder pytorch_model/, random states beside it)
    "accelerate_zero2_fp32_w2": {"stage": 2, "precision": "fp32", "world": 2, "accelerate": True},
    "zero2_fp32_w2_warmupdecay": {"stage": 2, "precision": "fp32", "world": 2, "scheduler": {
        "type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": recipe.LEARNING_RATE,
                                            "warmup_num_steps": recipe.WARMUP_STEPS, "warmup_type": "linear",
                                            "total_num_steps": recipe.SCHEDULE_STEPS}}},
}
UNIVERSAL_FIXTURE = ("universal_from_zero2_fp32_w4", "zero2_fp32_w4", 2)  # name, source fixture, resuming world size
TRAINER_FIXTURE = "trainer_zero3_bf16_w4"
# The ZeRO-3 config of the Transformers DeepSpeed docs, without offload (and without optimizer/scheduler sections: the
# Trainer's AdamW and linear schedule, which DeepSpeed then steps)
TRAINER_DS_CONFIG = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# what the Trainer says at --log_level info when it resumes checkpoint-6
RESUMED_MESSAGE = "Resuming training from checkpoint with epoch 0 and global step 6"
# The same with the docs' optimizer and scheduler sections: DeepSpeed's AdamW and WarmupLR in place of the Trainer's
TRAINER_DS_OPTIMIZER_CONFIG = {
    **TRAINER_DS_CONFIG,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
}
TRAINER_FIXTURES = {TRAINER_FIXTURE: TRAINER_DS_CONFIG, f"{TRAINER_FIXTURE}_ds_optimizer": TRAINER_DS_OPTIMIZER_CONFIG}
TRAINER_ARGS = ["--max_steps", "12", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3",
                "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "6",
                "--report_to", "none", "--use_cpu", "--bf16", "--seed", "7", "--warmup_steps", "2",
                "--weight_decay", "0.01", "--dataloader_drop_last"]


def engine_config(stage: int, precision: str, world: int, universal: bool = False, scheduler: dict | None = None,
                  grad_accum_dtype: str | None = None, **_: object) -> dict:
    """The DeepSpeed config of an engine fixture (the keys of :data:`ENGINE_FIXTURES`' specs)."""
    config = {"train_micro_batch_size_per_gpu": recipe.GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
              "bf16": {"enabled": precision == "bf16"}}
    if scheduler is not None:
        config["scheduler"] = scheduler
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


class _EngineRun:
    """The recipe's model and AdamW under DeepSpeed's engine (the recipe's schedule unless the config has its own)."""

    def __init__(self, config: dict, seed: int, single_group: bool = False) -> None:
        import deepspeed

        model = recipe.tiny_gpt2(seed)
        optimizer = recipe.make_optimizer(model, single_group)
        scheduler = None if "scheduler" in config else recipe.make_scheduler(optimizer)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                    config=config)

    def train(self, steps: range) -> dict[str, list[float]]:
        losses, lrs = [], []
        for step in steps:
            ids = recipe.local_batch(step)
            loss = self.engine(input_ids=ids, labels=ids).loss
            lrs.append(self.engine.get_lr()[0])
            self.engine.backward(loss)
            self.engine.step()
            losses.append(recipe.mean_over_ranks(loss))
        return {"losses": losses, "lrs": lrs}

    def save(self, folder: Path, tag: str) -> None:
        self.engine.save_checkpoint(str(folder), tag=tag)

    def load(self, folder: Path) -> None:
        self.engine.load_checkpoint(str(folder))

    def fp32_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 master copy (collective under ZeRO-3)."""
        from deepspeed.utils import safe_get_full_fp32_param

        return {name: safe_get_full_fp32_param(param).detach().clone()
                for name, param in self.engine.module.named_parameters()}


class _AccelerateRun(_EngineRun):
    """The same under Accelerate's DeepSpeed integration, as a stock Accelerate script runs it: ``prepare``,
    ``accelerator.backward``, ``save_state`` / ``load_state`` (a fresh Accelerator each time, as separate scripts)."""

    def __init__(self, config: dict, seed: int, single_group: bool = False) -> None:
        from accelerate import Accelerator, DeepSpeedPlugin
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState(cpu=True)  # Accelerate's DeepSpeed path on CPU needs the CPU process group first
        self.accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        model = recipe.tiny_gpt2(seed)
        optimizer = recipe.make_optimizer(model, single_group)
        self.engine, self.optimizer, self.scheduler = self.accelerator.prepare(
            model, optimizer, recipe.make_scheduler(optimizer))

    def train(self, steps: range) -> dict[str, list[float]]:
        losses, lrs = [], []
        for step in steps:
            ids = recipe.local_batch(step)
            loss = self.engine(input_ids=ids, labels=ids).loss
            lrs.append(self.optimizer.param_groups[0]["lr"])  # before backward: DeepSpeed's engine steps inside it
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            losses.append(recipe.mean_over_ranks(loss))
        return {"losses": losses, "lrs": lrs}

    def save(self, folder: Path, tag: str) -> None:
        self.accelerator.save_state(str(folder))

    def load(self, folder: Path) -> None:
        self.accelerator.load_state(str(folder))


def engine_worker(spec: dict, out: Path) -> None:
    """One rank of an engine fixture (under torch.distributed.run)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    before, after = recipe.STEPS_BEFORE_SAVE, recipe.STEPS_BEFORE_SAVE + recipe.STEPS_AFTER_SAVE
    config = engine_config(**spec)
    single_group = spec.get("single_group", False)
    kind = _AccelerateRun if spec.get("accelerate") else _EngineRun
    records = {}
    if not spec.get("universal"):
        run = kind(config, seed=0, single_group=single_group)
        first = run.train(range(before))
        run.save(out / "checkpoint", f"global_step{before}")
        uninterrupted = run.train(range(before, after))
        records["uninterrupted"] = {"losses": first["losses"] + uninterrupted["losses"],
                                    "lrs": first["lrs"] + uninterrupted["lrs"]}
        uninterrupted_weights = run.fp32_weights()
        del run
    run = kind(config, seed=1, single_group=single_group)  # other weights: the checkpoint must fix them
    run.load(out / "checkpoint")
    records["ds_resumed"] = run.train(range(before, after))
    resumed_weights = run.fp32_weights()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in resumed_weights.items()}, str(out / "ds_resumed_weights.safetensors"))
        # the learning rates DeepSpeed applied (its own schedule, or Accelerate's stepping once per process)
        schedule = records["uninterrupted"]["lrs"] if "uninterrupted" in records else None
        losses, lrs, single_weights = recipe.single_process_run(after, spec["precision"], schedule, single_group)
        records["single_process"] = {"losses": losses, "lrs": lrs}
        if "uninterrupted" in records:
            records["distance"] = {
                "loss": max(abs(a - b) for a, b in zip(records["uninterrupted"]["losses"][before:], losses[before:])),
                "weight": max(float((uninterrupted_weights[k] - single_weights[k]).abs().max())
                              for k in single_weights),
                "resume_vs_uninterrupted_loss": max(abs(a - b) for a, b in zip(
                    records["ds_resumed"]["losses"], records["uninterrupted"]["losses"][before:])),
            }
        import deepspeed as ds

        (out / "expected.json").write_text(json.dumps({
            **spec, "deepspeed": ds.__version__, "torch": torch.__version__, "config": config,
            "steps_before_save": before, "steps_after_save": recipe.STEPS_AFTER_SAVE, **records}, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # else gloo sometimes aborts the process as it exits


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _environment() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "TOKENIZERS_PARALLELISM": "false"}


def run_logged(command: list[str], log_name: str) -> str:
    """Run ``command`` with DeepSpeed's CPU environment, its output in a log file; an error quotes the log's end."""
    LOGS.mkdir(exist_ok=True)
    log = LOGS / log_name
    with open(log, "w") as handle:
        result = subprocess.run(command, cwd=ROOT, env=_environment(), stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}); see {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-40:]))
    return log.read_text()


def _torchrun(world: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", _port()]


def _engine_worker(spec: dict, out: Path) -> list[str]:
    return [*_torchrun(spec["world"]), "-m", "scripts.deepspeed_reference.checkpoints", "--worker", json.dumps(spec),
            "--out", str(out)]


def generate_engine_fixture(name: str, spec: dict, root: Path = FIXTURES) -> dict:
    """DeepSpeed trains, saves and resumes ``spec``'s run into ``root/name``; returns its ``expected.json``."""
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run_logged(_engine_worker(spec, out), f"{name}.log")
    _drop_copied_reader(out / "checkpoint")
    return json.loads((out / "expected.json").read_text())


def deepspeed_resume(folder: Path, spec: dict) -> dict:
    """DeepSpeed resumes the checkpoint in ``folder/checkpoint`` (a universal one when ``spec["universal"]``) and
    trains the recipe's remaining steps; returns what it recorded (``ds_resumed``: losses and learning rates; final
    fp32 weights in ``folder/ds_resumed_weights.safetensors``)."""
    run_logged(_engine_worker(spec, folder), f"resume_{folder.name}.log")
    return json.loads((folder / "expected.json").read_text())


def _drop_copied_reader(folder: Path) -> None:
    """DeepSpeed copies a reader script (zero_to_torch.py) into every checkpoint folder; the fixtures keep the data."""
    for script in ("zero_to_torch.py", "zero_to_fp32.py"):
        (folder / script).unlink(missing_ok=True)


def generate_universal_fixture(root: Path = FIXTURES) -> None:
    name, source, world = UNIVERSAL_FIXTURE
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    (out / "checkpoint").mkdir(parents=True)
    tag = f"global_step{recipe.STEPS_BEFORE_SAVE}"
    run_logged([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
          str(root / source / "checkpoint" / tag), "--output_folder", str(out / "checkpoint" / tag),
          "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
         f"{name}.convert.log")
    deepspeed_resume(out, {**ENGINE_FIXTURES[source], "world": world, "universal": True, "source": source})


def trainer_command(config: Path, output: Path, *extra: str) -> list[str]:
    """The stock Trainer script under DeepSpeed on 4 CPU ranks (its config at ``config``)."""
    return [*_torchrun(4), str(TRAINER_SCRIPT), "--deepspeed", str(config), *TRAINER_ARGS, "--output_dir",
            str(output), *extra]


def generate_trainer_fixture(name: str = TRAINER_FIXTURE, root: Path = FIXTURES) -> None:
    """DeepSpeed's Trainer run of :data:`TRAINER_FIXTURES` ``[name]``: 12 steps straight (saving checkpoint-6), its
    own resume from checkpoint-6, and the yardstick, one process on the same 8 sequences per step: stock (bf16
    autocast) for the Trainer's optimizer and schedule, DeepSpeed on one rank for DeepSpeed's own."""
    config_values = TRAINER_FIXTURES[name]
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    work = out.parent / f".{name}.work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    config = work / "ds_config.json"
    config.write_text(json.dumps(config_values, indent=1))
    run_logged(trainer_command(config, work / "uninterrupted"), f"{name}_uninterrupted.log")
    shutil.copytree(work / "uninterrupted" / "checkpoint-6", out / "checkpoint-6")
    _drop_copied_reader(out / "checkpoint-6")
    log = run_logged(trainer_command(config, work / "resumed", "--resume_from_checkpoint", str(out / "checkpoint-6"),
                                     "--log_level", "info"), f"{name}_resumed.log")
    if RESUMED_MESSAGE not in log:
        raise RuntimeError(f"the resumed Trainer run did not resume from checkpoint-6; see {LOGS}/{name}_resumed.log")
    single = [a if a != "2" or TRAINER_ARGS[i - 1] != "--per_device_train_batch_size" else "8"
              for i, a in enumerate(TRAINER_ARGS)]
    if "optimizer" in config_values:
        launcher = [*_torchrun(1), str(TRAINER_SCRIPT), "--deepspeed", str(config)]
    else:
        launcher = [sys.executable, str(TRAINER_SCRIPT)]
    run_logged([*launcher, *single, "--output_dir", str(work / "single_process")], f"{name}_single_process.log")
    (out / "ds_config.json").write_text(config.read_text())
    for run in ("uninterrupted", "resumed", "single_process"):
        history = json.loads((work / run / "trainer_state.json").read_text())["log_history"]
        (out / f"{run}.json").write_text(json.dumps(history, indent=1))
    (out / "arguments.json").write_text(json.dumps(TRAINER_ARGS))
    shutil.rmtree(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="fixture names (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        engine_worker(json.loads(args.worker), args.out)
        return 0
    wanted = set(args.only or [*ENGINE_FIXTURES, UNIVERSAL_FIXTURE[0], *TRAINER_FIXTURES])
    for name, spec in ENGINE_FIXTURES.items():
        if name in wanted:
            generate_engine_fixture(name, spec)
            print("wrote", FIXTURES / name, flush=True)
    if UNIVERSAL_FIXTURE[0] in wanted:
        generate_universal_fixture()
        print("wrote", FIXTURES / UNIVERSAL_FIXTURE[0], flush=True)
    for name in TRAINER_FIXTURES:
        if name in wanted:
            generate_trainer_fixture(name)
            print("wrote", FIXTURES / name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
