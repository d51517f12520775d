"""hf_zeropp.Accelerator: Accelerate's Accelerator with hf_zeropp sharding in place of DDP.

Accelerate's own FSDP path is replaced by DDP on CPU, rejects an integer ``reshard_after_forward`` (hpZ) and has
no hook after wrapping, so this subclass shards models itself in ``prepare`` (before Accelerate sees them) and
keeps the rest of Accelerate's API right under sharding: ``no_sync``/``accumulate`` (stage 1 semantics),
``clip_grad_norm_`` over shards, ``get_state_dict``/``save_model`` (consolidated), ``save_state``/``load_state``
(sharded DCP for sharded models and their optimizers, Accelerate's own files for everything else).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn

from .._compat import (accelerator_models, accelerator_optimizers, accelerator_registry, is_accelerate_prepared,
                       uncompiled)
from ..engine.auto_trial import is_pending
from ..engine.compile import compile_as_accelerate_asks
from ..checkpoint.checkpoint import load_checkpoint, save_checkpoint, save_pretrained
from ..config.config import ZeroPPConfig
from ..interop.deepspeed.checkpoint import is_deepspeed_checkpoint
from ..checkpoint.deepspeed_restore import load_accelerator_state_from_deepspeed
from ..interop.deepspeed.training import DeepSpeedLoop, fill_from_accelerator
from ..engine.full_state import consolidated_state_dict
from ..comm.hpz import reshard_all
from ..engine.optimizer_hooks import rebind_optimizer
from ..engine.runtime import clip_grad_norm_
from ..engine.runtime import no_sync as zeropp_no_sync
from ..engine.sharding import shard_model
from .deepspeed_plugin import fill_plugin, launched_plugin, show_plugin

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def is_sharded(model: Any) -> bool:
    """Sharded by hf_zeropp, or awaiting auto's trial, which shards it at its first forward (asked without that)."""
    return is_pending(model) or getattr(model, "_zeropp", None) is not None


class Accelerator(accelerate.Accelerator):
    """Drop-in ``accelerate.Accelerator`` that shards prepared models with hf_zeropp (ZeRO 0-3 + ZeRO++).

    ``zeropp`` is a :class:`ZeroPPConfig`, a preset name (``"zeropp"``), a YAML/JSON file (hf_zeropp or DeepSpeed
    format), a dict, or None, which reads ``ZEROPP_CONFIG`` / ``ZEROPP_*`` environment variables
    (:meth:`ZeroPPConfig.coerce`). A config with a schedule (``*_until``) is refused: nothing here knows the
    training progress (use the Trainer integration, which passes ``zeropp_runs_schedule=True``, or call
    :func:`hf_zeropp.set_techniques` yourself). The Accelerator's
    ``mixed_precision`` carries over to the sharding (FSDP2's mixed-precision policy: compute copies in bf16/fp16,
    fp32 master weights and optimizer state). A single-process run is left unsharded.
    """

    def __init__(self, *args: Any, zeropp: ZeroPPConfig | str | os.PathLike | dict | None = None,
                 zeropp_runs_schedule: bool = False, **kwargs: Any) -> None:
        if kwargs.get("fsdp_plugin") is not None:
            raise ValueError("hf_zeropp.Accelerator shards with FSDP2 itself and does not read a "
                             "FullyShardedDataParallelPlugin made in the script; put its settings in the Accelerate "
                             "config's fsdp_config (hf-zeropp launch maps them) or pass zeropp= (wrap_modules, stage, "
                             "cpu_offload, activation_checkpointing), and drop fsdp_plugin=")
        zeropp, plugin = _deepspeed_plugin_config(zeropp, kwargs)
        if plugin is None and zeropp is None:
            plugin = launched_plugin()  # the config from the environment is the launch's DeepSpeed settings'
        config = ZeroPPConfig.coerce(zeropp, argument="zeropp")  # fail on a bad config before any process group work
        if not zeropp_runs_schedule:
            config.refuse_schedule("hf_zeropp.Accelerator")
        self.zeropp_runs_schedule = zeropp_runs_schedule
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and not torch.cuda.is_available():
            # accelerate's torchrun path on a machine without GPUs: without this every process trains alone
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        super().__init__(*args, **kwargs)
        if self.num_processes != launched:
            raise RuntimeError(
                f"the launcher started {launched} processes but Accelerate sees {self.num_processes}; on CPU use "
                f"recipes/accelerate/cpu_4proc.yaml (distributed_type MULTI_GPU, use_cpu false) with "
                f"ACCELERATE_USE_CPU=true"
            )
        if self.distributed_type not in _SUPPORTED:
            raise ValueError(
                f"hf_zeropp.Accelerator does the sharding itself and cannot run under Accelerate's "
                f"{self.distributed_type.value} mode; remove the FSDP/DeepSpeed settings from the accelerate config"
            )
        if self.mixed_precision != "no":
            if config.mixed_precision == "no":
                config = dataclasses.replace(config, mixed_precision=self.mixed_precision)
            elif config.mixed_precision != self.mixed_precision:
                raise ValueError(
                    f"Accelerator(mixed_precision={self.mixed_precision!r}) disagrees with the hf_zeropp config's "
                    f"mixed_precision={config.mixed_precision!r}; set one of them"
                )
        # scripts written for DeepSpeed configs read them here (hf_zeropp.integrations.deepspeed_plugin says what is reported)
        self._shown_deepspeed_plugin = plugin
        if plugin is not None:
            show_plugin(self, plugin)
        # a DeepSpeed config's training loop is applied here (optimizer, scheduler, clipping, accumulation, loss
        # scale); sharding gets the rest of the config
        self.deepspeed_sections = config.deepspeed_training
        self.zeropp_config = dataclasses.replace(config, deepspeed_training=None)
        self.deepspeed_loop: DeepSpeedLoop | None = None
        self._deepspeed_loop_from_trainer = False
        self._clipped_this_step = False
        self._evaluation_models: set[int] = set()  # ids of models sharded by prepare_model(evaluation_mode=True)
        self._preparable_again = weakref.WeakSet()  # this accelerator's models that a Trainer prepares again
        if config.mixed_precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # found-inf must agree across ranks (each holds only its shards); accelerate makes no scaler on CPU.
            # A DeepSpeed config's fp16 section brings DeepSpeed's scaling rule (hysteresis, floor, window)
            self.scaler = (DeepSpeedLoop(self.deepspeed_sections).loss_scaler(self.device.type)
                           if self.deepspeed_sections is not None else ShardedGradScaler(device=self.device.type))
            self.native_amp = True  # Accelerate only unscales (before clipping) when native_amp is set

    @property
    def shards_models(self) -> bool:
        return self.num_processes > 1 and dist.is_initialized()

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``, with every model sharded by hf_zeropp instead of wrapped in DDP.

        Optimizers built on a model's parameters before the model was prepared — in the same call or in an earlier
        or later one — are pointed at the shards that replaced them (frozen weights stored INT8 are dropped).

        With a DeepSpeed config, the script's ``DummyOptim`` / ``DummyScheduler`` become the config's optimizer and
        scheduler (:meth:`_apply_deepspeed_loop`), as DeepSpeed's engine builds them."""
        args, deepspeed_schedulers = self._apply_deepspeed_loop(args)
        for model in (a for a in args if isinstance(a, nn.Module)):
            if model in self._preparable_again:
                continue  # already sharded by this accelerator: returned as it is, as stock Accelerate does
            if is_accelerate_prepared(model) or (
                    is_sharded(model) and id(model) not in self._evaluation_models):
                raise ValueError(
                    f"{type(model).__name__} was already prepared by this or another Accelerator; prepare each "
                    f"model once (pass the returned objects on)"
                )
            if self.shards_models and not is_sharded(model):
                shard_model(model, self.zeropp_config, device=self.device, runs_schedule=self.zeropp_runs_schedule)
            self._evaluation_models.discard(id(model))
        for optimizer in (a for a in args if isinstance(a, torch.optim.Optimizer)):
            rebind_optimizer(optimizer)
            clips = self.deepspeed_loop is not None and self.deepspeed_loop.gradient_clipping
            if clips and not getattr(optimizer, "_zeropp_clips_as_deepspeed", False):
                optimizer.register_step_pre_hook(self._clip_as_deepspeed)
                optimizer._zeropp_clips_as_deepspeed = True
        prepared = super().prepare(*args, device_placement=device_placement)
        for wrapped in prepared if isinstance(prepared, tuple) else (prepared,):
            if getattr(wrapped, "scheduler", None) in deepspeed_schedulers:
                wrapped.split_batches = True  # DeepSpeed's engine steps its scheduler once per optimizer step
        return prepared

    # ------------------------------------------------------------------ DeepSpeed's training loop

    def use_deepspeed_loop(self, loop: DeepSpeedLoop | None) -> None:
        """The DeepSpeed training loop as the Trainer fills it (from TrainingArguments, as Transformers does; None
        until ``train()`` knows the number of steps): ``prepare`` then fills nothing itself, also for the models a
        Trainer prepares before training (TRL's reference models)."""
        self.deepspeed_loop, self._deepspeed_loop_from_trainer = loop, True

    def _apply_deepspeed_loop(self, args: tuple) -> tuple[tuple, set]:
        """Fill the DeepSpeed config's "auto" values as Accelerate does, adopt its accumulation steps, and put the
        config's optimizer and scheduler in place of the script's ``DummyOptim`` / ``DummyScheduler`` (or the
        scheduler its ``lr_scheduler_callable`` builds). Returns the arguments and the schedulers to step once per
        optimizer step."""
        from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

        if self.deepspeed_sections is None or self._deepspeed_loop_from_trainer:
            return args, set()
        optimizer = next((a for a in args if isinstance(a, (torch.optim.Optimizer, DummyOptim))), None)
        scheduler = next((a for a in args if isinstance(a, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler))),
                         None)
        if not any(isinstance(a, nn.Module) for a in args) and optimizer is None and scheduler is None:
            return args, set()
        sizes = [a.batch_size for a in args if isinstance(a, torch.utils.data.DataLoader) and a.batch_size]
        loop = fill_from_accelerator(
            self.deepspeed_sections, gradient_accumulation_steps=self.gradient_accumulation_steps,
            mixed_precision=self.mixed_precision, num_processes=self.num_processes, split_batches=self.split_batches,
            micro_batch_size=(max(sizes) // (self.num_processes if self.split_batches else 1)) if sizes else None,
            optimizer=optimizer, scheduler=scheduler)
        self.deepspeed_loop = loop
        if self._shown_deepspeed_plugin is not None:
            fill_plugin(self._shown_deepspeed_plugin, loop.sections)
        if loop.gradient_accumulation_steps != self.gradient_accumulation_steps:
            warnings.warn(f"Gradient accumulation steps mismatch: the Accelerator has "
                          f"{self.gradient_accumulation_steps}, the DeepSpeed config has "
                          f"{loop.gradient_accumulation_steps}. Using DeepSpeed's value, as Accelerate does under "
                          f"DeepSpeed", stacklevel=3)
            self.gradient_accumulation_steps = loop.gradient_accumulation_steps
        replaced, schedulers = {}, set()
        if isinstance(optimizer, DummyOptim):
            replaced[id(optimizer)] = real = loop.build_optimizer(list(optimizer.params))
            if isinstance(scheduler, DummyScheduler):
                built = (scheduler.lr_scheduler_callable(real) if scheduler.lr_scheduler_callable is not None
                         else loop.build_scheduler(real))
                replaced[id(scheduler)] = built
                schedulers.add(built)
        return tuple(replaced.get(id(a), a) for a in args), schedulers

    def _clip_as_deepspeed(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Before every optimizer step: clip by the DeepSpeed config's ``gradient_clipping``, as its engine does,
        unless the script's ``clip_grad_norm_`` already did this step (an fp16 step's gradients are unscaled by now:
        the scaler calls ``step`` after unscaling)."""
        if not self._clipped_this_step:
            clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]],
                            self.deepspeed_loop.gradient_clipping)
        self._clipped_this_step = False

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._clipped_this_step = False
        super().backward(loss, **kwargs)

    def allow_preparing_again(self, model: nn.Module) -> None:
        """Let a later ``prepare`` of ``model``, which this accelerator sharded, return it as it is instead of
        refusing it: a Trainer's second ``train()`` (a resume in the same process) prepares its model again."""
        if model in accelerator_models(self):
            self._preparable_again.add(model)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Sharded models skip DDP and autocast (FSDP's mixed-precision policy casts). A model prepared for
        evaluation only (TRL's reference and reward models) is sharded too — each rank holds 1/N of it, not a full
        copy — and, if :attr:`freezes_for_evaluation` says so, frozen first so that ``quantized_nontrainable_weights``
        stores it INT8. It can still be prepared for training later. Accelerate's dynamo settings compile a sharded
        model per FSDP unit (:mod:`hf_zeropp.engine.compile`); a model the script compiled itself is left as it is,
        as stock Accelerate leaves it."""
        if evaluation_mode and self.shards_models and not is_sharded(model) and self.zeropp_config.stage > 0:
            shard_model(model, self.zeropp_config, device=self.device, runs_schedule=self.zeropp_runs_schedule,
                        frozen=self.freezes_for_evaluation(model))
            self._evaluation_models.add(id(model))
        if not is_sharded(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        models = accelerator_models(self)
        if model not in models:
            models.append(model)
        if self.state.dynamo_plugin.backend != DynamoBackend.NO and uncompiled(model) is model:
            compile_as_accelerate_asks(model, self.state.dynamo_plugin, self.process_index)
        return model

    def freezes_for_evaluation(self, model: nn.Module) -> bool:
        """Whether a model prepared with ``evaluation_mode=True`` is frozen before it is sharded. False: a model the
        script evaluates may still be trained later. The Trainer mixin answers True for every model but the one
        being trained (reference and reward models)."""
        return False

    # ------------------------------------------------------------------ training step

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not is_sharded(model):
            with super().no_sync(model):
                yield
            return
        with zeropp_no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Under a DeepSpeed config the config's ``gradient_clipping`` decides, not ``max_norm``: DeepSpeed's engine
        clips by it (0 or absent: never) and returns the norm whatever the script asked for."""
        parameters = list(parameters)
        if self.deepspeed_loop is not None:
            max_norm = self.deepspeed_loop.gradient_clipping or float("inf")
            self._clipped_this_step = True
        if not any(is_sharded(m) for m in accelerator_models(self)):
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(parameters, max_norm, norm_type)

    # ------------------------------------------------------------------ state

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """Consolidated (full, CPU) state dict on the main process, empty elsewhere — collective for sharded models."""
        if not is_sharded(model):
            return super().get_state_dict(model, unwrap=unwrap)
        return consolidated_state_dict(uncompiled(model), model._zeropp.topology.control_group)

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: str = "10GB",
                   safe_serialization: bool = True) -> None:
        if not is_sharded(model):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        save_pretrained(model, save_directory, max_shard_size=max_shard_size)

    @contextlib.contextmanager
    def _without_sharded(self) -> Iterator[list[tuple[int, nn.Module, list[torch.optim.Optimizer]]]]:
        """Hide sharded models and their optimizers from Accelerate's own (rank-0, unsharded) save/load.

        A model's optimizers are looked up now, not at prepare time, so that every prepare order finds them. The
        model is resharded first: after a forward without backward (an evaluation) FSDP2 has swapped gathered
        tensors in for the parameters of the units it keeps gathered (the root, stage 2's units, hpZ's secondary
        shards), so ``model.parameters()`` would not be the shards the optimizers hold."""
        models, all_optimizers = accelerator_models(self), accelerator_optimizers(self)
        optimizers = [(wrapped, _unwrap_optimizer(wrapped)) for wrapped in all_optimizers]
        sharded = []
        hidden: set[int] = set()
        for index, model in enumerate(models):
            if not is_sharded(model):
                continue
            reshard_all(model)
            params = {id(p) for p in model.parameters()}
            own = [(w, o) for w, o in optimizers
                   if any(id(p) in params for group in o.param_groups for p in group["params"])]
            for _, optimizer in own:
                if not all(id(p) in params for group in optimizer.param_groups for p in group["params"]):
                    raise ValueError(
                        f"{type(optimizer).__name__} holds parameters of {type(model).__name__} and of other models; "
                        f"save_state/load_state need one optimizer per sharded model (pass each model's parameters "
                        f"to its own optimizer)")
            sharded.append((index, model, [o for _, o in own]))
            hidden.update(id(w) for w, _ in own)
        with accelerator_registry(self, [m for m in models if not is_sharded(m)],
                                  [o for o in all_optimizers if id(o) not in hidden]):
            yield sharded

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        with self._without_sharded() as sharded:
            def save_shards(models, weights, directory):
                for index, model, optimizers in sharded:
                    save_checkpoint(Path(directory) / f"zeropp_model_{index}", model, optimizers or None,
                                    step=self.step)

            handle = self.register_save_state_pre_hook(save_shards)
            try:
                return super().save_state(output_dir, safe_serialization, **kwargs)
            finally:
                handle.remove()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Also a folder DeepSpeed wrote (``save_checkpoint``, or ``save_state`` under DeepSpeed): its fp32 weights,
        optimizer, scheduler and loss scale go into the prepared model
        (:mod:`hf_zeropp.checkpoint.deepspeed_restore`)."""
        if input_dir is not None and is_deepspeed_checkpoint(input_dir):
            load_accelerator_state_from_deepspeed(self, input_dir, load_kwargs, **kwargs)
            return
        with self._without_sharded() as sharded:
            def load_shards(models, directory):
                for index, model, optimizers in sharded:
                    load_checkpoint(Path(directory) / f"zeropp_model_{index}", model, optimizers or None)

            handle = self.register_load_state_pre_hook(load_shards)
            try:
                super().load_state(input_dir, load_kwargs, **kwargs)
            finally:
                handle.remove()


def _deepspeed_plugin_config(zeropp: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A script's ``deepspeed_plugin=DeepSpeedPlugin(...)`` (or a ``deepspeed_plugins`` dict of one) is taken out of
    ``kwargs``, and its DeepSpeed config becomes the hf_zeropp config, as it replaces the Accelerate config's under
    DeepSpeed; with ``zeropp`` also given there would be two configs. Returns the config and the plugin (None
    without one)."""
    plugins = kwargs.pop("deepspeed_plugins", None)
    plugin = kwargs.pop("deepspeed_plugin", None)
    if isinstance(plugins, dict):
        if len(plugins) != 1 or plugin is not None:
            raise ValueError(f"hf_zeropp trains one model configuration per Accelerator; got DeepSpeed plugins "
                             f"{sorted(plugins)}: pass one deepspeed_plugin")
        plugin = next(iter(plugins.values()))
    elif plugins is not None:
        plugin = plugins
    if plugin is None:
        return zeropp, None
    if zeropp is not None:
        raise ValueError("both zeropp= and deepspeed_plugin= are given; hf_zeropp takes one config: drop one of them")
    config = dict(plugin.deepspeed_config)
    config.pop("steps_per_print", None)  # Accelerate's own addition, to silence DeepSpeed's logging
    launched = os.environ.get("ZEROPP_CONFIG")
    if launched and int(os.environ.get("RANK", "0")) == 0:
        sharding = {k: v for k, v in ZeroPPConfig.coerce(None).to_dict().items() if k != "deepspeed_training"}
        mine = {k: v for k, v in ZeroPPConfig.coerce(config).to_dict().items() if k != "deepspeed_training"}
        if sharding != mine:
            changed = sorted(k for k in sharding if sharding[k] != mine[k])
            warnings.warn(f"the script's DeepSpeedPlugin replaces the launch's hf_zeropp config ({', '.join(changed)} "
                          f"differ), as a script's plugin replaces the Accelerate config's under DeepSpeed",
                          stacklevel=3)
    return config, plugin


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    while isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer

