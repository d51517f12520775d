"""Transformers Trainer (and TRL) integration: ``--zeropp`` on the command line, a Trainer mixin, a callback.

The Trainer builds its Accelerator in ``create_accelerator_and_postprocess``; the mixin has it build
:class:`hf_zeropp.Accelerator` instead, which shards the model in ``accelerator.prepare``. TRL's SFT/DPO/GRPO
trainers subclass Trainer without overriding that method, so ``class X(ZeroPPTrainerMixin, GRPOTrainer)`` works
the same way. Saving is made collective where the Trainer assumes a model only rank 0 needs to read:
``save_model`` consolidates the shards into a ``from_pretrained``-loadable folder, and checkpoints store the
optimizer's shards with torch DCP (``zeropp_optimizer/``) beside the consolidated weights the Trainer resumes from.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME

from .._compat import TrainerHooks, extend_valid_dict_fields, trainer_accelerator_class, trainer_save
from .accelerate_integration import Accelerator, is_sharded
from ..engine.auto_trial import current_meter
from ..checkpoint.checkpoint import TRAINER_OPTIMIZER_DIR, latest_trainer_checkpoint, load_checkpoint, save_checkpoint
from ..config.config import SCHEDULED_TECHNIQUES, ZeroPPConfig
from ..interop.deepspeed.checkpoint import is_deepspeed_checkpoint
from ..checkpoint.deepspeed_restore import resume_trainer_from_deepspeed
from ..config.fsdp_settings import (CONFIG_GIVEN_VARIABLE, SETTINGS_VARIABLE, from_training_arguments, remember,
                                    zeropp_given)
from ..interop.deepspeed.training import DeepSpeedLoop, fill_from_training_arguments
from ..engine.full_state import load_pretrained_in_slices
from ..interop.hf_checkpoint import write_pretrained, writes_per_rank
from ..engine.materialize import attach_checkpoint
from ..engine.runtime import active_techniques, comm_stats, set_techniques



def take_deepspeed_config(args: TrainingArguments) -> None:
    """Make ``args.deepspeed`` (``--deepspeed ds.json``, a path or a dict) the hf_zeropp config (``args.zeropp``)
    and clear it, so that the Trainer neither imports DeepSpeed nor sets up its engine: whoever trains with
    hf_zeropp's Trainer has chosen hf_zeropp. The DeepSpeed config is checked now (an unsupported key, such as an
    offload, is an error naming the key), before any process group exists."""
    if not args.deepspeed:
        return
    if getattr(args, "zeropp", None) is not None:
        raise ValueError(f"both zeropp={args.zeropp!r} and deepspeed={args.deepspeed!r} are set; hf_zeropp takes one "
                         f"config: drop --deepspeed, or pass the DeepSpeed file as --zeropp")
    ZeroPPConfig.coerce(args.deepspeed, argument="--deepspeed")
    args.zeropp, args.deepspeed = args.deepspeed, None


def take_fsdp_config(args: TrainingArguments) -> None:
    """Make ``args.fsdp`` / ``args.fsdp_config`` (``--fsdp full_shard --fsdp_config fsdp.json``) hf_zeropp options
    and clear them, so that the Trainer sets up no FSDP plugin and sets no ``FSDP_*`` variable: hf_zeropp is FSDP2
    underneath, and the units, stage, offload, activation checkpointing and loading keep their meaning
    (:mod:`hf_zeropp.config.fsdp_settings`) on top of ``args.zeropp``, or of the environment's config (zero3 when
    nothing names one). The result is ``args.zeropp``. Unsupported keys are errors now, before any process group exists;
    keys hf_zeropp ignores are said once, on rank 0."""
    if not args.fsdp:
        return
    if args.deepspeed:
        raise ValueError(f"fsdp={args.fsdp!r} and deepspeed={args.deepspeed!r} are both set; keep one of them (stock "
                         f"Transformers refuses them together too)")
    if SETTINGS_VARIABLE in os.environ:
        raise ValueError(f"fsdp={args.fsdp!r} is set, and the launch's Accelerate config has FSDP settings too; keep "
                         f"one of them (under stock Accelerate the Trainer's would replace the config's)")
    settings = from_training_arguments(args.fsdp, args.fsdp_config,
                                       "bf16" if args.bf16 else "fp16" if args.fp16 else None)
    zeropp = getattr(args, "zeropp", None)
    given = f"zeropp={zeropp!r}" if zeropp is not None else zeropp_given(dict(os.environ))
    args.zeropp = settings.apply(ZeroPPConfig.coerce(zeropp, argument="zeropp"), given).to_dict()
    args.fsdp, args.fsdp_config = None, None
    remember(settings)
    if os.environ.get("RANK", "0") != "0":
        return
    notes = dict(settings.warnings)
    if settings.load_in_slices and CONFIG_GIVEN_VARIABLE not in os.environ:  # hf-zeropp launch loads in slices
        notes["cpu_ram_efficient_loading=True"] = (
            "load the model with hf_zeropp.from_pretrained (each rank reads its slices) or launch with hf-zeropp "
            "launch, which does so for every from_pretrained; a stock from_pretrained loads it whole on every rank")
    for setting, why in notes.items():
        warnings.warn(f"hf_zeropp: {setting} in {settings.where}: {why}", stacklevel=3)


@functools.cache
def with_zeropp_field(args_class: type[TrainingArguments]) -> type[TrainingArguments]:
    """``args_class`` (TrainingArguments or a TRL config such as ``SFTConfig``) plus a ``zeropp`` field, usable from
    the command line (``--zeropp zeropp``) through HfArgumentParser and from YAML configs. The new class is
    registered in this module as ``ZeroPP<Name>`` so that the Trainer can pickle it into checkpoints."""

    @dataclass
    class WithZeroPP(args_class):
        zeropp: dict | str | None = field(
            default=None,
            metadata={"help": "hf_zeropp config: a preset (zero1, zero2, zero3, zeropp), a YAML/JSON file, or a "
                              "JSON dict of options. Default: the ZEROPP_CONFIG / ZEROPP_* environment."},
        )

        def __post_init__(self) -> None:
            take_fsdp_config(self)
            take_deepspeed_config(self)
            super().__post_init__()
            ZeroPPConfig.coerce(self.zeropp, argument="zeropp")  # a bad value fails here, before any process group

    extend_valid_dict_fields(WithZeroPP, args_class, "zeropp")
    WithZeroPP.__name__ = WithZeroPP.__qualname__ = f"ZeroPP{args_class.__name__}"
    WithZeroPP.__module__ = __name__
    globals()[WithZeroPP.__name__] = WithZeroPP
    return WithZeroPP


ZeroPPTrainingArguments = with_zeropp_field(TrainingArguments)


class ZeroPPCallback(TrainerCallback):
    """Puts communication bytes (per collective, intra/inter node, per optimizer step) and quantization error
    into the Trainer's logs, and switches techniques off at a fraction of ``max_steps``.

    ``schedule`` maps ``quantized_weights_until`` / ``hpz_until`` / ``quantized_gradients_until`` to a fraction
    (the ZeRO++ paper's "qgZ for the first 50 %" is ``{"quantized_gradients_until": 0.5}``); the keys can also
    live in the ZeroPPConfig. ``quantization_error_every`` measures the round-trip error on every n-th step.
    """

    def __init__(self, schedule: dict[str, float] | None = None, quantization_error_every: int = 10) -> None:
        unknown = set(schedule or {}) - set(SCHEDULED_TECHNIQUES)
        if unknown:
            raise ValueError(f"unknown schedule keys {sorted(unknown)}; use {sorted(SCHEDULED_TECHNIQUES)}")
        self.schedule = dict(schedule or {})
        self.quantization_error_every = quantization_error_every
        self._sums: dict[str, float] = {}
        self._steps = 0

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is None or not is_sharded(model):
            return
        if self.schedule and state.max_steps:
            progress = state.global_step / state.max_steps
            wanted = {SCHEDULED_TECHNIQUES[key]: progress < until for key, until in self.schedule.items()}
            current = active_techniques(model)
            changes = {name: on for name, on in wanted.items() if current[name] and not on}
            if changes:
                set_techniques(model, **changes)
        every = self.quantization_error_every
        current_meter(model).track_errors = bool(every) and state.global_step % every == 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or not is_sharded(model):
            return
        stats = comm_stats(model, reset=True)
        for kind, value in stats.items():
            if kind in ("total", "implementations", "quantization_error"):
                continue
            for where in ("intra_node", "inter_node"):
                key = f"zeropp/{kind}_{where}_bytes"
                self._sums[key] = self._sums.get(key, 0.0) + value[where]
        for where in ("intra_node", "inter_node"):
            key = f"zeropp/{where}_bytes"
            self._sums[key] = self._sums.get(key, 0.0) + stats["total"][where]
        for kind, error in stats.get("quantization_error", {}).items():
            self._sums[f"zeropp/{kind}_relative_error"] = error  # latest measurement, not a sum
        for name, on in active_techniques(model).items():
            self._sums[f"zeropp/{name}_on"] = float(on)
        self._steps += 1

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if model is not None and is_sharded(model):
            comm_stats(model, reset=True)  # evaluation traffic is not a training step's

    def pop_metrics(self) -> dict[str, float]:
        """Per-step averages since the last call (bytes this rank sent), latest error and technique switches."""
        if not self._steps:
            return {}
        metrics = {key: (value / self._steps if key.endswith("_bytes") else value)
                   for key, value in self._sums.items()}
        self._sums, self._steps = {}, 0
        return metrics


class ZeroPPTrainerMixin(TrainerHooks):
    """Put in front of ``Trainer`` or any Trainer subclass (TRL's SFT/DPO/GRPO trainers):
    ``class MyTrainer(ZeroPPTrainerMixin, SFTTrainer)``. The config comes from ``args.zeropp`` (with
    :class:`ZeroPPTrainingArguments`) or from ``ZEROPP_CONFIG`` / ``ZEROPP_*``."""

    def create_accelerator_and_postprocess(self) -> None:
        config = ZeroPPConfig.coerce(getattr(self.args, "zeropp", None), argument="zeropp")
        if getattr(self.args, "ds3_gather_for_generation", True) is False and config.generation_gather != "per_token":
            # TRL's switch for DeepSpeed ZeRO-3 asks for per-forward gathering in generation: the same request
            warnings.warn("ds3_gather_for_generation=False: hf_zeropp's generate() gathers the weights per forward "
                          "(generation_gather='per_token') instead of once per call", stacklevel=2)
            config = dataclasses.replace(config, generation_gather="per_token")
        self.zeropp_config: ZeroPPConfig = config
        # the callback below applies the config's *_until schedule: tell the Accelerator (and shard_model)
        with trainer_accelerator_class(functools.partial(Accelerator, zeropp=config, zeropp_runs_schedule=True)):
            super().create_accelerator_and_postprocess()
        # TRL prepares reference and reward models with evaluation_mode=True: frozen, they can be stored INT8
        self.accelerator.freezes_for_evaluation = self._is_auxiliary_model
        self.zeropp_callback = ZeroPPCallback(config.schedule())
        if config.deepspeed_training is not None:
            self.accelerator.use_deepspeed_loop(None)  # filled from TrainingArguments when training starts

    # ------------------------------------------------------------------ a DeepSpeed config's training loop

    def _zeropp_deepspeed_loop(self) -> DeepSpeedLoop | None:
        """The DeepSpeed config's training loop with "auto" filled from TrainingArguments as Transformers fills it,
        once per ``train()`` (the number of steps is known by then); None without a DeepSpeed training section."""
        sections = self.zeropp_config.deepspeed_training
        if sections is None:
            return None
        if getattr(self, "_zeropp_loop", None) is None:
            self._zeropp_loop = fill_from_training_arguments(sections, self.args, self.state.max_steps)
            self.accelerator.use_deepspeed_loop(self._zeropp_loop)
            clipping = self._zeropp_loop.gradient_clipping
            if clipping != self.args.max_grad_norm and self.args.process_index == 0:
                warnings.warn(f"the DeepSpeed config sets no gradient_clipping: as under DeepSpeed, gradients are "
                              f"clipped to {clipping} (DeepSpeed's default), not to max_grad_norm="
                              f"{self.args.max_grad_norm}; set \"gradient_clipping\": \"auto\" to clip to "
                              f"max_grad_norm", stacklevel=3)
        return self._zeropp_loop

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The DeepSpeed config's optimizer where it has one (on every trainable parameter, in one group, as
        DeepSpeed's engine builds it); otherwise the Trainer's."""
        loop = self._zeropp_deepspeed_loop()
        if loop is None or loop.optimizer is None or self.optimizer is not None:
            # transformers < 5 has no ``model`` parameter
            return super().create_optimizer() if model is None else super().create_optimizer(model)
        self.optimizer = loop.build_optimizer((model if model is not None else self.model).parameters())
        self._zeropp_built_optimizer = True
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The DeepSpeed config's scheduler where it has one; otherwise the Trainer's (``lr_scheduler_type``), which
        DeepSpeed also uses then."""
        loop = self._zeropp_deepspeed_loop()
        if loop is None or loop.scheduler is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = loop.build_scheduler(optimizer if optimizer is not None else self.optimizer)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _is_auxiliary_model(self, model: Any) -> bool:
        """A model this trainer evaluates but does not train (TRL's reference and reward models)."""
        return model is not getattr(self, "model", None) and model is not getattr(self, "model_wrapped", None)

    def _zeropp_move_model_to_device(self, model: Any, device: Any, upstream: Any) -> None:
        """The Trainer's ``_move_model_to_device`` (``upstream``; see :class:`TrainerHooks`). A model on the meta
        device (built empty, or :func:`hf_zeropp.from_pretrained` on ranks other than 0) is placed by sharding, which
        allocates only this rank's shards; moving it now would fail."""
        if any(param.is_meta for param in model.parameters()):
            return
        upstream(model, device)

    def _zeropp_load_from_checkpoint(self, checkpoint: str, model: Any, upstream: Any) -> None:
        """The Trainer's ``_load_from_checkpoint`` (``upstream``), which loads the weights when training resumes,
        before the model is prepared. A model that :func:`hf_zeropp.from_pretrained` built on the meta device holds
        no weights to load them into: it reads the checkpoint's files instead, each rank its slices, when it is
        sharded (loading them into meta tensors would silently keep the pretrained weights)."""
        if is_deepspeed_checkpoint(checkpoint):
            return  # the weights come with the optimizer state, from DeepSpeed's fp32 partitions (not its 16-bit copy)
        model = model if model is not None else self.model
        if vars(model).get("_zeropp_checkpoint") is not None and not is_sharded(model):
            attach_checkpoint(model, checkpoint)
            return
        if is_sharded(model) and load_pretrained_in_slices(model, checkpoint, model._zeropp.topology.control_group):
            return
        upstream(checkpoint, model)

    def _zeropp_load_best_model(self, upstream: Any) -> None:
        """The Trainer's ``_load_best_model`` (``upstream``): each rank reads its slices of the best checkpoint."""
        if self._zeropp_sharded() and load_pretrained_in_slices(self.model, self.state.best_model_checkpoint,
                                                                self.model._zeropp.topology.control_group):
            return
        upstream()

    def _zeropp_sharded(self) -> bool:
        return is_sharded(self.model)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if self.zeropp_callback not in self.callback_handler.callbacks:
            self.callback_handler.add_callback(self.zeropp_callback)
        if resume_from_checkpoint is True:  # the newest *complete* checkpoint; a crash may have left a partial one
            latest = latest_trainer_checkpoint(self.args.output_dir)
            if latest is None:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no complete "
                                 "checkpoint; pass a checkpoint path or start without resuming")
            resume_from_checkpoint = str(latest)
        if is_sharded(self.model):  # train() called again (a resume in a notebook): it prepares the model again
            self.accelerator.allow_preparing_again(self.model)
        if self.zeropp_config.deepspeed_training is not None:
            self._refuse_optimizers_passed_with_deepspeed()
            self._zeropp_loop = None  # filled again for this run's number of steps
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _zeropp_engine_steps_scheduler(self) -> bool:
        """Whether DeepSpeed's engine, not the Trainer, would step the scheduler: Transformers hands it the
        scheduler (a ``DummyScheduler``) when the config has an optimizer or a scheduler section."""
        sections = self.zeropp_config.deepspeed_training or {}
        return "optimizer" in sections or "scheduler" in sections

    def _refuse_optimizers_passed_with_deepspeed(self) -> None:
        """Transformers refuses a Trainer given ``optimizers=`` under DeepSpeed (the config's sections, or
        DeepSpeed's engine, build them); so does hf_zeropp with a DeepSpeed config, instead of silently preferring
        one of the two."""
        passed_optimizer = self.optimizer is not None and not getattr(self, "_zeropp_built_optimizer", False)
        if passed_optimizer or (self.lr_scheduler is not None and not self._created_lr_scheduler):
            raise RuntimeError("Passing `optimizers` is not allowed if Deepspeed or PyTorch FSDP is enabled. You "
                               "should subclass `Trainer` and override the `create_optimizer_and_scheduler` method.")

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # training logs only, not evaluation results
            logs.update(self.zeropp_callback.pop_metrics())
            if "learning_rate" in logs and self._zeropp_engine_steps_scheduler():
                # DeepSpeed's engine steps its scheduler inside backward, so under DeepSpeed the Trainer logs the
                # learning rate after this step's scheduler step; log the same
                logs["learning_rate"] = self._get_learning_rate()
        super().log(logs, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated ``from_pretrained``-loadable weights (a collective: every rank must call it)."""
        if not self._zeropp_sharded():
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if writes_per_rank(self.model, {"safe_serialization": getattr(self.args, "save_safetensors", True)}):
            # every rank writes its slices; tokenizer and arguments as the Trainer's _save writes them
            write_pretrained(self.model, output_dir, control_group=self.model._zeropp.topology.control_group)
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
            self.accelerator.wait_for_everyone()
            return
        state_dict = self.accelerator.get_state_dict(self.model)
        trainer_save(self, output_dir, state_dict)  # writes on rank 0 only (the model's save_pretrained)
        # every rank returns once the folder is complete: the Trainer checks for it right after (transformers
        # 4.56 records the best checkpoint only if its folder exists on this rank)
        self.accelerator.wait_for_everyone()

    def _zeropp_save_optimizer_and_scheduler(self, output_dir: str, upstream: Any) -> None:
        """The Trainer's ``_save_optimizer_and_scheduler`` (``upstream``; see :class:`TrainerHooks`)."""
        if not self._zeropp_sharded():
            return upstream(output_dir)
        save_checkpoint(Path(output_dir) / TRAINER_OPTIMIZER_DIR, self.model, self.optimizer, self.lr_scheduler,
                        step=self.state.global_step, include_model=False)

    def _zeropp_load_optimizer_and_scheduler(self, checkpoint: str | None, upstream: Any) -> None:
        """The Trainer's ``_load_optimizer_and_scheduler`` (``upstream``; see :class:`TrainerHooks`). A checkpoint
        written by DeepSpeed resumes with its fp32 weights, optimizer and scheduler state (which the stock method
        would skip without a word, finding no ``optimizer.pt``)."""
        if checkpoint is not None and is_deepspeed_checkpoint(checkpoint):
            resume_trainer_from_deepspeed(self, checkpoint)
            return
        if checkpoint is None or not (Path(checkpoint) / TRAINER_OPTIMIZER_DIR).is_dir():
            return upstream(checkpoint)
        if not self._zeropp_sharded():
            raise ValueError(f"{checkpoint} holds hf_zeropp optimizer shards; resume it with a ZeroPP trainer")
        # the Trainer restores RNG itself from its own per-rank files
        load_checkpoint(Path(checkpoint) / TRAINER_OPTIMIZER_DIR, self.model, self.optimizer, self.lr_scheduler,
                        restore_rng=False)


class ZeroPPTrainer(ZeroPPTrainerMixin, Trainer):
    """``transformers.Trainer`` with hf_zeropp sharding."""


__all__ = ["ZeroPPCallback", "ZeroPPTrainer", "ZeroPPTrainerMixin", "ZeroPPTrainingArguments", "take_deepspeed_config",
           "take_fsdp_config", "with_zeropp_field"]
