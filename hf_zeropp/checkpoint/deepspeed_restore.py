"""Resume a DeepSpeed checkpoint into a model sharded by hf_zeropp (any world size, any preset) or a plain one: the fp32
master weights from DeepSpeed's fp32 partitions (not its 16-bit copy), the optimizer's per-parameter state (Adam's
``exp_avg``, ``exp_avg_sq``) and step, each parameter group's hyperparameters, the LR scheduler's position and, for
fp16, the loss scale. Or convert it ahead of time into hf_zeropp's own sharded checkpoint
(:func:`convert_deepspeed_checkpoint`).

Everything that can be wrong is checked on every rank from the same files before the first collective, so a bad
checkpoint is one identical error everywhere, never a hang: a model parameter the checkpoint lacks, a checkpoint tensor
the model lacks, a shape that differs, an optimizer whose state does not match the checkpoint's (Lion's state into
AdamW, a missing ``max_exp_avg_sq``), a parameter group mixing DeepSpeed groups, a scheduler that cannot take the
saved state. The tensors then travel through torch DCP (:class:`DeepSpeedStorageReader`), which asks each rank for
exactly the slices of each tensor its shards hold: a rank reads those ranges of the memory-mapped DeepSpeed files
and nothing else, whatever the two world sizes.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .checkpoint import _apply_dcp_state, _dcp_state
from ..interop.deepspeed.checkpoint import read_deepspeed_checkpoint
from ..interop.deepspeed.files import DeepSpeedCheckpoint, DeepSpeedCheckpointError, ParameterState
from ..interop.deepspeed.zero import STEP_KEY
from ..engine.state import replacing_weights

# hyperparameter names DeepSpeed's own optimizers use for what torch's call otherwise
_RENAMED_HYPERPARAMETERS = {"adam_w_mode": "decoupled_weight_decay"}


class DeepSpeedStorageReader(StorageReader):
    """A DCP storage reader over a DeepSpeed checkpoint: every key (``model.<name>``,
    ``optimizer.state.<name>.<state>``) is one whole tensor, read as ranges of the DeepSpeed partitions."""

    def __init__(self, sources: dict[str, tuple[Any, torch.Size]]) -> None:
        super().__init__()
        self.sources = sources  # key -> (FlatPieces | tensor | step value, shape)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return Metadata(state_dict_metadata={
            key: TensorStorageMetadata(TensorProperties(dtype=torch.float32), shape,
                                       [ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)])
            for key, (_, shape) in self.sources.items()})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            source, shape = self.sources[item.storage_index.fqn]
            region = _region(source, shape, list(item.storage_offsets), list(item.lengths))
            target = planner.resolve_tensor(item).detach()
            target.copy_(region.to(target.dtype))
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _region(source: Any, shape: torch.Size, offsets: list[int], lengths: list[int]) -> torch.Tensor:
    """The block ``offsets``/``lengths`` of the tensor ``source`` describes: read as one flat range when the block
    spans whole rows (how FSDP2 shards, along dim 0), else cut from the whole tensor."""
    if not torch.is_tensor(source) and not hasattr(source, "read"):
        return torch.tensor(source, dtype=torch.float32).reshape(shape)
    if torch.is_tensor(source):
        full = source.reshape(shape)
    elif not shape or list(lengths[1:]) == list(shape[1:]):
        row = math.prod(shape[1:])
        start = offsets[0] * row if shape else 0
        return source.read(start, start + (lengths[0] * row if shape else 1)).reshape(lengths)
    else:
        full = source.read(0, math.prod(shape)).reshape(shape)
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def _names_by_object(model: nn.Module) -> dict[str, list[str]]:
    """Every name of the model's parameters and buffers -> all names of the same object (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, value in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(value), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _model_sources(checkpoint: DeepSpeedCheckpoint, model: nn.Module, aliases: dict[str, list[str]]):
    """For each model state key, what the checkpoint holds for it; every mismatch is an error naming both sides. A
    frozen weight the checkpoint left out (DeepSpeed's ``exclude_frozen_parameters``, as the Trainer saves PEFT
    models) keeps the model's value, as DeepSpeed's own resume keeps it."""
    sources, used, kept = {}, set(), []
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    for key, value in model.state_dict().items():  # DTensors: global shapes, no collective
        names = aliases.get(key, [key])
        names = [*names, *(checkpoint.shared[n] for n in names if n in checkpoint.shared)]
        found = next((n for n in names if n in checkpoint.parameters), None)
        if found is not None:
            entry = checkpoint.parameters[found]
            source, shape, where = entry.fp32, entry.shape, entry.source
        elif (found := next((n for n in names if n in checkpoint.frozen or n in checkpoint.buffers), None)):
            source = checkpoint.frozen.get(found, checkpoint.buffers.get(found))
            shape, where = source.shape, str(checkpoint.folder)
        elif key in frozen and not checkpoint.frozen:
            kept.append(key)
            continue
        else:
            raise DeepSpeedCheckpointError(f"the model's {key} is not in the DeepSpeed checkpoint {checkpoint.folder}: "
                                           f"it was saved from another model")
        if tuple(shape) != tuple(value.shape):
            raise DeepSpeedCheckpointError(f"{key}: the DeepSpeed checkpoint ({where}) holds shape {tuple(shape)}, the "
                                           f"model {tuple(value.shape)}: build the model with the checkpoint's config")
        used.add(found)
        sources[f"model.{key}"] = (source, torch.Size(value.shape))
    unknown = [name for name in checkpoint.parameters if name not in used and name not in checkpoint.shared]
    if unknown:
        raise DeepSpeedCheckpointError(f"the DeepSpeed checkpoint {checkpoint.folder} holds parameter {unknown[0]}"
                                       f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}, which is "
                                       f"not in the model: it was saved from another model")
    if kept:
        checkpoint.notes.append(f"{len(kept)} frozen weights ({kept[0]}, ...) are not in the checkpoint (saved "
                                f"without frozen parameters) and keep the model's values")
    return sources


def _entry(checkpoint: DeepSpeedCheckpoint, name: str, aliases: dict[str, list[str]]) -> ParameterState:
    names = aliases.get(name, [name])
    found = next((n for n in [*names, *(checkpoint.shared.get(n, n) for n in names)] if n in checkpoint.parameters),
                 None)
    if found is None:
        raise DeepSpeedCheckpointError(f"the optimizer holds {name}, which has no optimizer state in the DeepSpeed "
                                       f"checkpoint {checkpoint.folder} (frozen there?)")
    return checkpoint.parameters[found]


def _optimizer_sources(checkpoint: DeepSpeedCheckpoint, optim_state: dict[str, Any], optimizer: Any,
                       aliases: dict[str, list[str]]) -> dict[str, tuple[Any, torch.Size]]:
    sources = {}
    kind = type(optimizer).__name__
    for name, state in optim_state["state"].items():
        entry = _entry(checkpoint, name, aliases)
        # per-element state has the parameter's shape: 0-d for a 0-d parameter, whose step is 0-d as well
        wanted = {k for k, v in state.items()
                  if torch.is_tensor(v) and (v.dim() > 0 or (not entry.shape and k != STEP_KEY))}
        if wanted != set(entry.state):
            raise DeepSpeedCheckpointError(
                f"{name}: the DeepSpeed checkpoint ({entry.source}) holds optimizer state {sorted(entry.state)} per "
                f"parameter, but {kind} here holds {sorted(wanted)}: its state cannot be mapped; build the optimizer "
                f"DeepSpeed trained with (its config's optimizer section)")
        for key in wanted:
            sources[f"optimizer.state.{name}.{key}"] = (entry.state[key], torch.Size(state[key].shape))
        if "step" in state:
            if entry.step is None:
                raise DeepSpeedCheckpointError(f"{name}: the DeepSpeed checkpoint ({entry.source}) records no "
                                               f"optimizer step, which {kind} needs")
            sources[f"optimizer.state.{name}.step"] = (entry.step, torch.Size(state["step"].shape))
    return sources


def _group_hyperparameters(checkpoint: DeepSpeedCheckpoint, param_groups: list[dict[str, Any]],
                           aliases: dict[str, list[str]]) -> None:
    """Give each optimizer group the hyperparameters of the DeepSpeed group its parameters came from."""
    if not checkpoint.param_groups:
        checkpoint.notes.append("the checkpoint records no parameter-group hyperparameters (DeepSpeed's elastic "
                                "format): the optimizer keeps its own")
        return
    for index, group in enumerate(param_groups):
        origins = {_entry(checkpoint, name, aliases).group for name in group["params"]}
        if len(origins) > 1:
            raise DeepSpeedCheckpointError(
                f"optimizer parameter group {index} holds parameters of DeepSpeed's groups {sorted(origins)}, which "
                f"have their own hyperparameters: group the parameters as DeepSpeed did (the Trainer's grouping: "
                f"weight decay on matrices only)")
        if origins:
            saved = checkpoint.param_groups[origins.pop()]
            for key, value in saved.items():
                key = _RENAMED_HYPERPARAMETERS.get(key, key)
                if key in group and key != "params":
                    group[key] = value


def _check_scheduler(scheduler: Any, state: dict[str, Any] | None, where: str) -> None:
    """The saved scheduler state must fit ``scheduler``: a torch scheduler's state into one of the same kind, or
    DeepSpeed's own (``{"last_batch_iteration": k}``) into one that keeps DeepSpeed's (the schedulers
    :mod:`hf_zeropp.interop.deepspeed.optim` builds from a DeepSpeed config's scheduler section). Anything else would
    leave the schedule at its start, or crash half-loaded, so it is an error before anything is loaded."""
    kind = type(scheduler).__name__
    if state is None:
        raise DeepSpeedCheckpointError(f"{where} holds no LR scheduler state, but a {kind} was given: resuming it "
                                       f"would restart the schedule")
    own, saved = set(scheduler.state_dict()) - {"lr_lambdas"}, set(state) - {"lr_lambdas"}
    if own == saved:
        return
    if "last_batch_iteration" in saved:
        raise DeepSpeedCheckpointError(
            f"{where} holds DeepSpeed's scheduler state {state}, which {kind} cannot take; build the scheduler from "
            f"the DeepSpeed config's scheduler section (hf_zeropp does, for --deepspeed configs)")
    raise DeepSpeedCheckpointError(f"{where} holds a scheduler state with keys {sorted(saved)}, which {kind} cannot "
                                   f"take (it keeps {sorted(own)}): build the scheduler the run used")


def load_deepspeed_checkpoint(path: str | Path, model: nn.Module, optimizer: Any = None, scheduler: Any = None, *,
                              tag: str | None = None, scheduler_state: dict[str, Any] | None = None,
                              grad_scaler: Any = None, schedule_elsewhere: bool = False) -> DeepSpeedCheckpoint:
    """Restore the DeepSpeed checkpoint at ``path`` (a ``save_checkpoint`` folder, a Trainer ``checkpoint-N`` folder,
    a tag folder or a universal checkpoint) into ``model`` and, if given, ``optimizer``, ``scheduler`` and the fp16
    ``grad_scaler``. Collective when ``model`` is sharded: call it on every rank. ``scheduler_state`` overrides the
    scheduler state DeepSpeed saved (the Trainer's own ``scheduler.pt``); ``schedule_elsewhere`` says the caller
    restores the scheduler from a file of its own (else a saved schedule without a ``scheduler`` is reported as not
    restored). Returns the checkpoint read (its ``global_steps``, ``model_states``, ``notes``)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrappers hold the torch objects
    scheduler = getattr(scheduler, "scheduler", scheduler)
    checkpoint = read_deepspeed_checkpoint(path, tag)
    aliases = _names_by_object(model)
    sources = _model_sources(checkpoint, model, aliases)
    saved_schedule = scheduler_state if scheduler_state is not None else checkpoint.lr_scheduler
    if scheduler is not None:
        _check_scheduler(scheduler, saved_schedule, str(checkpoint.folder))
    replacing_weights(model)
    state = _dcp_state(model, optimizer, include_model=True)
    if optimizer is not None:
        sources.update(_optimizer_sources(checkpoint, state["optimizer"], optimizer, aliases))
        _group_hyperparameters(checkpoint, state["optimizer"]["param_groups"], aliases)
    tensors = {"model": {k: v for k, v in state["model"].items() if f"model.{k}" in sources}}
    if optimizer is not None:
        tensors["optimizer"] = {"state": state["optimizer"]["state"]}
    with warnings.catch_warnings():  # one process without a process group is what DCP is told here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=DeepSpeedStorageReader(sources), no_dist=not dist.is_initialized())
    _apply_dcp_state(model, optimizer, state)
    if scheduler is not None:
        scheduler.load_state_dict(saved_schedule)
    elif saved_schedule is not None and not schedule_elsewhere:
        checkpoint.notes.append("its LR scheduler state was not restored: no scheduler was given")
    _restore_loss_scale(checkpoint, grad_scaler)
    _report(checkpoint, model)
    return checkpoint


def _restore_loss_scale(checkpoint: DeepSpeedCheckpoint, grad_scaler: Any) -> None:
    """DeepSpeed's dynamic fp16 loss scale into the run's grad scaler: all of it into the scaler that follows
    DeepSpeed's rule (:class:`hf_zeropp.interop.deepspeed.training.DeepSpeedLossScaler`: scale, iteration, last
    overflow, hysteresis); into torch's scaler the scale and the clean steps since the last overflow, its growth
    counter."""
    saved = checkpoint.loss_scaler or {}
    if not saved.get("dynamic"):
        return  # a static scale (or none, in fp32/bf16) comes from the run's config, not from the checkpoint
    own = grad_scaler.state_dict() if grad_scaler is not None and grad_scaler.is_enabled() else {}
    if not own:
        checkpoint.notes.append(f"DeepSpeed's dynamic fp16 loss scale ({saved.get('cur_scale')}) was not restored: "
                                f"this run has no fp16 grad scaler")
        return
    state = {**own, "scale": float(saved["cur_scale"])}
    if "deepspeed" in own:
        state["deepspeed"] = {key: saved[key] for key in own["deepspeed"] if key in saved}
    else:
        clean = int(saved.get("cur_iter", 0)) - int(saved.get("last_overflow_iter", -1)) - 1
        state["_growth_tracker"] = max(clean, 0) % int(own.get("growth_interval") or 1)
        if int(saved.get("delayed_shift", 1)) > 1:
            checkpoint.notes.append("DeepSpeed's loss-scale hysteresis has no counterpart in torch's grad scaler: "
                                    "the scale and its growth counter resume, the hysteresis does not")
    grad_scaler.load_state_dict(state)


def _report(checkpoint: DeepSpeedCheckpoint, model: nn.Module) -> None:
    """Say once (rank 0) what was not carried over, and record it in ``comm_stats()["implementations"]``."""
    if not checkpoint.notes:
        return
    message = f"hf_zeropp: resuming DeepSpeed checkpoint {checkpoint.folder}: " + "; ".join(checkpoint.notes)
    zeropp = getattr(model, "_zeropp", None)
    if zeropp is not None:
        zeropp.meter.conditions["deepspeed_checkpoint"] = message
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, stacklevel=3)


def torch_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed parameter group's hyperparameters under torch's names (its step goes to the optimizer state)."""
    return {_RENAMED_HYPERPARAMETERS.get(k, k): v for k, v in group.items() if k != "step"}


def resume_trainer_from_deepspeed(trainer: Any, checkpoint: str | Path) -> DeepSpeedCheckpoint:
    """A Trainer's resume from a ``checkpoint-N`` folder DeepSpeed wrote: model, optimizer and scheduler from the
    DeepSpeed files (the scheduler from the Trainer's own ``scheduler.pt`` when the Trainer made it, as under
    DeepSpeed); the Trainer restores its state and the RNG itself."""
    saved_schedule = Path(checkpoint) / "scheduler.pt"
    schedule = torch.load(saved_schedule, weights_only=True) if saved_schedule.is_file() else None
    return load_deepspeed_checkpoint(checkpoint, trainer.model, trainer.optimizer, trainer.lr_scheduler,
                                     scheduler_state=schedule, grad_scaler=getattr(trainer.accelerator, "scaler", None))


def load_accelerator_state_from_deepspeed(accelerator: Any, input_dir: str | Path, load_kwargs: dict | None = None,
                                          **kwargs: Any) -> DeepSpeedCheckpoint:
    """``Accelerator.load_state`` on a folder DeepSpeed wrote (``engine.save_checkpoint``, or Accelerate's
    ``save_state`` under DeepSpeed): the one prepared model with its optimizer, scheduler and fp16 loss scale from
    the DeepSpeed files; then Accelerate's own loading, with those hidden, restores what it saved beside them (RNG
    states, samplers, a scheduler or scaler it saved itself, custom objects)."""
    import accelerate

    from .._compat import accelerator_models, accelerator_optimizers, accelerator_registry

    folder = Path(input_dir)
    models = accelerator_models(accelerator)
    if len(models) != 1:
        raise DeepSpeedCheckpointError(f"{folder} holds one DeepSpeed model, but this Accelerator prepared "
                                       f"{len(models)}: load_state of a DeepSpeed checkpoint needs exactly one")
    model = models[0]
    names = {id(p) for p in model.parameters()}
    optimizers = [o for o in accelerator_optimizers(accelerator)
                  if any(id(p) in names for group in o.param_groups for p in group["params"])]
    if len(optimizers) > 1:
        raise DeepSpeedCheckpointError(f"{folder} holds one optimizer's state, but {len(optimizers)} optimizers hold "
                                       f"the model's parameters")
    own_schedule = (folder / "scheduler.bin").is_file() or (folder / "scheduler.safetensors").is_file()
    schedulers = [] if own_schedule else list(accelerator._schedulers)
    if len(schedulers) > 1:
        raise DeepSpeedCheckpointError(f"{folder} holds one scheduler's state (DeepSpeed's), but this Accelerator "
                                       f"prepared {len(schedulers)} schedulers")
    own_scaler = (folder / "scaler.pt").is_file()
    checkpoint = load_deepspeed_checkpoint(folder, model, optimizers[0] if optimizers else None,
                                           schedulers[0] if schedulers else None,
                                           grad_scaler=None if own_scaler else accelerator.scaler,
                                           schedule_elsewhere=own_schedule)
    kept = accelerator._schedulers, accelerator.scaler
    accelerator._schedulers = [s for s in accelerator._schedulers if s not in schedulers]
    accelerator.scaler = accelerator.scaler if own_scaler else None
    try:
        with accelerator_registry(accelerator, [], [o for o in accelerator_optimizers(accelerator)
                                                    if o not in optimizers]):
            accelerate.Accelerator.load_state(accelerator, str(folder), load_kwargs, **kwargs)
    finally:
        accelerator._schedulers, accelerator.scaler = kept
    return checkpoint
