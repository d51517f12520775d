"""One rank's training run: the baseline (or the driving candidate) trained by ZeroPPTrainer, the measured windows
recorded by the probes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hf_zeropp
from scripts.train_gpt import build_datasets, build_model, load_recipe

from .candidates import GRADIENT_CANDIDATES
from .probes import Probe, install


def measured_steps(starts: list[int], window: int) -> dict[int, tuple[int, int]]:
    """step -> (the index of its window in ``starts``, how many steps of the window it completes); 0-based global
    steps."""
    steps: dict[int, tuple[int, int]] = {}
    for w, start in enumerate(starts):
        for step in range(start, start + window):
            steps[step] = (w, step - start + 1)
    return steps


def horizons(window: int) -> list[int]:
    """The numbers of steps into a window after which the summed error is recorded: powers of two, and the window."""
    return sorted({2 ** k for k in range(window.bit_length()) if 2 ** k <= window} | {window})


def build_trainer(recipe_path: str, global_batch: int, workdir: str, callbacks: list,
                  zeropp: dict[str, Any] | None = None) -> Any:
    """The recipe's ZeroPPTrainer as fidelity runs it: ``global_batch`` sequences per step over this world, no
    evaluation, checkpoint or log during training; ``zeropp`` replaces the recipe's engine config (the tests train
    the engine's own qgZ this way, to compare with a driven run)."""
    recipe = load_recipe(Path(recipe_path))
    world = dist.get_world_size()
    if global_batch % world:
        raise SystemExit(f"--global-batch {global_batch} does not split over {world} ranks")
    train, validation, vocab = build_datasets(recipe["data"])
    training = {**recipe["training"], "output_dir": workdir, "per_device_train_batch_size": global_batch // world,
                "eval_strategy": "no", "save_strategy": "no", "logging_steps": 10_000, "report_to": "none",
                "dataloader_num_workers": 0}
    if zeropp is not None:
        training["zeropp"] = zeropp
    torch.manual_seed(training["seed"])
    model = build_model(recipe["model"], vocab, int(recipe["data"]["seq_len"]))
    return hf_zeropp.ZeroPPTrainer(model=model, args=hf_zeropp.ZeroPPTrainingArguments(**training),
                                   train_dataset=train, eval_dataset=validation, callbacks=callbacks)


def run_rank(recipe_path: str, starts: list[int], window: int, global_batch: int, workdir: str,
             candidate_names: list[str], drive: str | None = None) -> dict:
    from transformers import TrainerCallback

    steps = measured_steps(starts, window)
    recorded = set(horizons(window))
    last = max(steps)
    candidates = {name: GRADIENT_CANDIDATES[name] for name in candidate_names}
    per_step: dict[int, dict[str, list]] = {}
    windows: list[dict] = []  # per window and horizon: the summed error so far

    class Measure(TrainerCallback):
        probe: Probe | None = None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if self.probe is None:
                self.probe = install(model, candidates)
                self.probe.drive = None if drive is None else candidate_names.index(drive)
            self.probe.optimizer = kwargs["optimizer"]
            step = state.global_step
            if steps.get(step, (0, 0))[1] == 1:
                self.probe.start_window()
            self.probe.active = step in steps

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step - 1
            if not self.probe.active:
                return
            self.probe.active = False
            self.probe.weigh_by_adam()  # on_step_end runs after the optimizer step
            scaled = self.probe.scaled_gradient_sums.reduce_and_reset().tolist()
            surprise, delivery = self.probe.reduce_error_location()
            self.probe.window_scaled &= self.probe.scaled
            per_step[step] = {"gradients": self.probe.gradient_sums.reduce_and_reset().tolist(),
                              "weights": self.probe.weight_sums.reduce_and_reset().tolist(),
                              "adam_scaled_gradients": scaled if self.probe.scaled else None,
                              "surprise": surprise if self.probe.scaled else None,
                              "delivery": delivery if self.probe.scaled and drive is not None else None,
                              "width_rules": self.probe.rules.sums.reduce_and_reset().tolist(),
                              "adam_scaled_width_rules": (self.probe.rules.scaled_sums.reduce_and_reset().tolist()
                                                          if self.probe.scaled else None)}
            index, into = steps[step]
            if into in recorded:
                windows.append({"window": index, "horizon": into, "errors": self.probe.window_error().tolist(),
                                "scaled": self.probe.window_scaled})
            if step >= last:
                control.should_training_stop = True

    measure = Measure()
    trainer = build_trainer(recipe_path, global_batch, workdir, [measure])
    parameters = list(trainer.model.parameters())
    model = (f"{type(trainer.model).__name__}, {sum(p.numel() for p in parameters):,} parameters "
             f"({sum(p.numel() for p in parameters if p.dim() == 1):,} in 1-D ones)")
    trainer.train()
    probe = measure.probe
    measured = len(per_step)
    ran = [trainer.state.global_step if c == probe.drive else measured for c in range(len(candidates))]
    return {
        "model": model,
        "gradient_candidates": candidate_names,
        "drive": drive,
        "validation_loss": trainer.evaluate()["eval_loss"],
        "last_step": trainer.state.global_step,
        "steps": per_step,
        "windows": windows,
        "gradient_inter_node_mb": [m.stats()["total"]["inter_node"] / n / 1e6
                                   for m, n in zip(probe.gradient_meters, ran)],
        "weight_inter_node_mb": [m.stats()["total"]["inter_node"] / measured / 1e6 for m in probe.weight_meters],
    }


