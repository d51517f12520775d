"""The pieces every DeepSpeed checkpoint reader shares: the restricted unpickler, and the per-parameter view a
checkpoint is read into (:class:`DeepSpeedCheckpoint`).

DeepSpeed pickles a few of its own classes into its files (its ZeRO stage enum, loss scalers, the fragment addresses of
the partition map). They are read with torch's weights-only unpickler, which builds tensors and plain containers only,
plus stand-ins that turn exactly those classes into plain values; any other class in a file is refused, naming it, so
a checkpoint cannot run code. Tensors stay memory-mapped: a rank reads only the ranges it uses.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class DeepSpeedRecord(dict):
    """A DeepSpeed object from a checkpoint file (a loss scaler, a fragment address) as a plain dict of its fields;
    ``ds_class`` names the class it was."""

    ds_class = ""

    def __setstate__(self, state: dict) -> None:
        self.update(state)


def _record_class(path: str) -> type:
    return type(path.rpartition(".")[2], (DeepSpeedRecord,), {"ds_class": path})


def _enum_value(value: Any) -> Any:
    """A DeepSpeed enum member (pickled as its class called with its value) read as that value."""
    return value


# Every DeepSpeed class that 0.19.8 pickles into checkpoints, and what it becomes here.
DEEPSPEED_CLASSES = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _enum_value,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _record_class("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler":
        _record_class("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    "deepspeed.utils.tensor_fragment.fragment_address":
        _record_class("deepspeed.utils.tensor_fragment.fragment_address"),
}


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that cannot be read or restored; the message names the file or tensor and the fix."""


def load_file(path: Path, mmap: bool = True) -> Any:
    """One DeepSpeed-written file, memory-mapped (tensors are read when used), through the restricted unpickler."""
    if not path.is_file():
        raise DeepSpeedCheckpointError(f"{path} is missing: the DeepSpeed checkpoint is incomplete (a rank did not "
                                       f"finish saving, or the folder was copied in part); use a complete one")
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in DEEPSPEED_CLASSES.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = f"the class {found.group(1)}" if found else "an object"
        raise DeepSpeedCheckpointError(
            f"{path} holds {what}, which hf_zeropp does not read: only tensors, plain containers and DeepSpeed's "
            f"{sorted(DEEPSPEED_CLASSES)} are mapped to data, so that loading a checkpoint cannot run code") from None
    except (RuntimeError, EOFError, OSError) as error:
        raise DeepSpeedCheckpointError(f"{path} cannot be read ({str(error).splitlines()[0]}): the file is truncated "
                                       f"or corrupt; use a complete copy of the checkpoint") from None


@dataclass
class FlatPieces:
    """A parameter's flattened values as consecutive slices of flat tensors (one per DeepSpeed rank that holds part of
    it, or the whole tensor); :meth:`read` copies out a range without touching the other pieces."""

    pieces: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)  # (flat tensor, start, numel)

    @property
    def numel(self) -> int:
        return sum(numel for _, _, numel in self.pieces)

    def read(self, start: int, stop: int) -> torch.Tensor:
        out, offset = [], 0
        for tensor, first, numel in self.pieces:
            lo, hi = max(start, offset), min(stop, offset + numel)
            if lo < hi:
                out.append(tensor[first + lo - offset:first + hi - offset].float())
            offset += numel
        return torch.cat(out) if out else torch.empty(0)


@dataclass
class ParameterState:
    """A trainable parameter's fp32 master values and optimizer state in a DeepSpeed checkpoint."""

    name: str
    shape: torch.Size
    group: int  # index into DeepSpeedCheckpoint.param_groups
    fp32: FlatPieces
    state: dict[str, FlatPieces]  # per-element optimizer state (exp_avg, exp_avg_sq, ...)
    step: float | None
    source: str  # the file(s) it came from, for messages


@dataclass
class DeepSpeedCheckpoint:
    folder: Path  # the tag folder holding the files
    layout: str  # "zero" or "universal"
    stage: int
    world_size: int  # data-parallel ranks that wrote it
    ds_version: str
    parameters: dict[str, ParameterState]
    param_groups: list[dict[str, Any]]  # hyperparameters (no "params"); empty when the checkpoint has none
    shared: dict[str, str]  # tied name -> the name it shares storage with
    buffers: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]  # non-trainable parameters (their 16-bit copies: all DeepSpeed keeps)
    model_states: dict[str, Any]  # the rest of the model-states file: lr_scheduler, global_steps, ds_config, ...
    loss_scaler: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # what could not be carried over, for a warning

    @property
    def lr_scheduler(self) -> dict[str, Any] | None:
        return self.model_states.get("lr_scheduler")

    @property
    def global_steps(self) -> int | None:
        return self.model_states.get("global_steps")


def common_fields(model_states: dict[str, Any], folder: Path) -> dict[str, Any]:
    """What every layout takes from the model-states file: buffers, frozen weights, tied names, the rest."""
    module = model_states.get("module") or {}
    buffers = {name: value for name, value in module.items() if name in set(model_states.get("buffer_names") or [])}
    frozen = dict(model_states.get("frozen_param_fragments") or {}) if model_states.get("frozen_param_shapes") else {}
    rest = {k: v for k, v in model_states.items() if k not in ("module", "optimizer", "frozen_param_fragments")}
    return {"buffers": buffers, "frozen": frozen, "shared": dict(model_states.get("shared_params") or {}),
            "model_states": rest, "ds_version": str(model_states.get("ds_version", "unknown"))}


def group_names(model_states: dict[str, Any], folder: Path) -> list[dict[str, torch.Size]]:
    shapes = model_states.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(group, dict) for group in shapes):
        raise DeepSpeedCheckpointError(f"the model-states file in {folder} has no param_shapes list: it was not "
                                       f"written by a ZeRO engine, so its partitions cannot be mapped to parameters")
    return shapes


def hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def rank_order(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.name))
