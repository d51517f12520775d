"""DeepSpeed's universal checkpoint, both ways: read one (``ds_to_universal``'s output) as per-parameter state, and
write one from an hf_zeropp checkpoint so that DeepSpeed resumes it (``"checkpoint": {"load_universal": true}``),
with the fp32 weights, Adam's moments and step, the LR scheduler's position and the step counters.

The layout, as DeepSpeed 0.19.8 writes and reads it: a tag folder holding ``zero/<parameter name>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt`` (each ``{"param": full tensor}``, or the bare tensor for ZeRO-3) and ``step.pt``;
``zero/optimizer_state.pt`` with the parameter groups' hyperparameters (``param_groups`` for ZeRO-1/2, inside
``optimizer_state_dict`` for ZeRO-3); the model-states file(s) with the scheduler state and step counters; and
``latest_universal`` beside the tag naming it.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .files import (
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    FlatPieces,
    ParameterState,
    common_fields,
    group_names,
    hyperparameters,
    load_file,
)

STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq", "step")
# keys DeepSpeed adds to a universal tensor file for tensor-parallel merges; only their neutral values are readable
_NEUTRAL_KEYS = {"param": None, "cat_dim": None, "vocab_tensor": False, "param_n_sub_params": None,
                 "is_expert_param": False}


def read_universal(folder: Path, model_states: dict[str, Any]) -> DeepSpeedCheckpoint:
    """The universal checkpoint in the tag folder ``folder`` (its model-states file already read)."""
    zero = folder / "zero"
    optimizer_state = load_file(zero / "optimizer_state.pt")
    stage = int(optimizer_state.get("zero_stage", 3 if "optimizer_state_dict" in optimizer_state else 2))
    shapes = group_names(model_states, folder)
    common = common_fields(model_states, folder)
    if stage == 3:
        base = optimizer_state["optimizer_state_dict"]
        group_of = {index: g for g, group in enumerate(base["param_groups"]) for index in group["params"]}
        states = base.get("state") or {}
        default_step = states[min(states)].get("step") if states else None
        groups = hyperparameters(base["param_groups"])
    else:
        group_of = {g: g for g in range(len(shapes))}
        default_step = None
        groups = hyperparameters(optimizer_state.get("param_groups") or [])
    parameters = {}
    for index, names in enumerate(shapes):
        for name, shape in names.items():
            parameters[name] = _parameter(zero / name, name, torch.Size(shape), group_of.get(index, 0), default_step)
    frozen = dict(common.pop("frozen"))
    for extra in sorted(p for p in zero.iterdir() if p.is_dir() and p.name not in parameters):
        if extra.name not in common["shared"] and extra.name not in frozen:
            frozen[extra.name] = _tensor(extra / "fp32.pt")  # a weight that got no optimizer state
    checkpoint = DeepSpeedCheckpoint(folder=folder, layout="universal", stage=stage,
                                     world_size=int(model_states.get("dp_world_size") or 1), parameters=parameters,
                                     param_groups=groups, frozen=frozen, **common)
    scaler = optimizer_state.get("loss_scaler")
    checkpoint.loss_scaler = dict(scaler) if isinstance(scaler, dict) else None
    return checkpoint


def _tensor(path: Path) -> torch.Tensor:
    value = load_file(path)
    if isinstance(value, dict):
        odd = {k: v for k, v in value.items() if k not in _NEUTRAL_KEYS or (_NEUTRAL_KEYS[k] is not None
                                                                             and v != _NEUTRAL_KEYS[k])}
        if odd or "param" not in value:
            raise DeepSpeedCheckpointError(f"{path} carries {sorted(odd) or 'no param'}: a tensor-parallel or expert "
                                           f"layout, which hf_zeropp cannot read")
        value = value["param"]
    if not torch.is_tensor(value):
        raise DeepSpeedCheckpointError(f"{path} holds a {type(value).__name__}, not a tensor")
    return value


def _parameter(path: Path, name: str, shape: torch.Size, group: int, default_step) -> ParameterState:
    if not (path / "fp32.pt").is_file():
        raise DeepSpeedCheckpointError(f"{path / 'fp32.pt'} is missing: the universal checkpoint lacks parameter "
                                       f"{name}; convert it again")
    state = {}
    for file in sorted(path.glob("*.pt")):
        key = file.stem
        if key == "step":
            continue
        tensor = _tensor(file).reshape(-1)
        if tensor.numel() != math.prod(shape):
            raise DeepSpeedCheckpointError(f"{file} holds {tensor.numel()} values for parameter {name} of shape "
                                           f"{tuple(shape)}: padded for another layout, which cannot be read")
        state[key] = FlatPieces([(tensor, 0, tensor.numel())])
    step = load_file(path / "step.pt") if (path / "step.pt").is_file() else default_step
    return ParameterState(name, shape, group, state.pop("fp32"), state, None if step is None else float(step),
                          str(path))


# ---------------------------------------------------------------- writing


def write_universal(output: str | os.PathLike, *, weights: dict[str, torch.Tensor],
                    optimizer_state: dict[str, dict[str, torch.Tensor]], param_groups: list[dict[str, Any]],
                    scheduler_state: dict[str, Any] | None, step: int, world_size: int,
                    buffers: dict[str, torch.Tensor] | None = None, shared: dict[str, str] | None = None) -> Path:
    """Write a DeepSpeed universal checkpoint: ``output/global_step<step>/`` and ``output/latest_universal``.

    ``weights``: the fp32 master weights of the trainable parameters by name, in the model's order;
    ``optimizer_state``: per name, its optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``);
    ``param_groups``: the optimizer's groups, each with ``params`` as a list of names and its hyperparameters;
    ``shared``: tied names (``lm_head.weight`` -> ``transformer.wte.weight``) left out of ``weights``.
    Written into ``.global_step<step>.partial`` and renamed into place: a crash leaves no half checkpoint.
    """
    output = Path(output)
    tag = f"global_step{step}"
    partial = output / f".{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    zero = partial / "zero"
    zero.mkdir(parents=True)
    group_of = {name: g for g, group in enumerate(param_groups) for name in group["params"]}
    missing = [name for name in weights if name not in group_of]
    if missing:
        raise DeepSpeedCheckpointError(f"parameters {missing} are in no optimizer parameter group; a universal "
                                       f"checkpoint needs every trainable parameter's group")
    steps = {}
    for name, value in weights.items():
        folder = zero / name
        folder.mkdir()
        state = optimizer_state.get(name)
        if state is None or "exp_avg" not in state:
            raise DeepSpeedCheckpointError(f"parameter {name} has no Adam state (exp_avg, exp_avg_sq) in the "
                                           f"checkpoint: DeepSpeed's universal loader needs it for every parameter")
        torch.save({"param": value.detach().float().contiguous()}, folder / "fp32.pt")
        for key, tensor in state.items():
            if key == "step":
                steps[name] = torch.as_tensor(tensor, dtype=torch.float32).reshape(())
                torch.save(steps[name], folder / "step.pt")
            else:
                torch.save({"param": tensor.detach().float().reshape(value.shape).contiguous()}, folder / f"{key}.pt")
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [g]}
              for g, group in enumerate(param_groups)]
    # DeepSpeed's ZeRO-3 universal loader gives every group the hyperparameters of the first entry: only those all
    # groups share go there, so each group keeps the values its run built it with (weight decay 0 on biases)
    shared_values = {k: v for k, v in groups[0].items() if k != "params" and all(g.get(k) == v for g in groups)}
    first_step = next(iter(steps.values()), torch.tensor(float(step)))
    version = "0.19.8"  # the DeepSpeed version whose universal loader this layout was checked against
    torch.save({"zero_stage": 2, "param_groups": groups, "ds_version": version, "clip_grad": 0.0,
                "optimizer_state_dict": {"state": {0: {"step": first_step}}, "param_groups": [shared_values]}},
               zero / "optimizer_state.pt")
    shapes = [{name: weights[name].shape for name in group["params"] if name in weights} for group in param_groups]
    model_states = {"module": {**{n: w.detach() for n, w in weights.items()}, **(buffers or {})},
                    "buffer_names": sorted(buffers or {}), "param_shapes": shapes, "shared_params": shared or {},
                    "frozen_param_shapes": {}, "frozen_param_fragments": {}, "lr_scheduler": scheduler_state,
                    "global_steps": step, "global_samples": 0, "skipped_steps": 0, "dp_world_size": world_size,
                    "mp_world_size": 1, "ds_version": version, "optimizer": None, "data_sampler": None,
                    "random_ltd": None, "ds_config": {}}
    torch.save(model_states, partial / "mp_rank_00_model_states.pt")  # read by DeepSpeed's ZeRO-1/2 engine
    torch.save(model_states, partial / "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ... and its ZeRO-3 engine
    final = output / tag
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    (output / "latest_universal").write_text(tag)
    return final
