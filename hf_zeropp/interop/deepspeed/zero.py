"""DeepSpeed's ZeRO partition files (``engine.save_checkpoint``: ``*_optim_states.pt`` per rank) read as
per-parameter state. The layouts, as DeepSpeed 0.19.8 writes them (its ``zero_to_fp32.py`` is the reference reader):

* ZeRO-1/2: each optimizer parameter group is one flat vector of the group's parameters in order (with DeepSpeed's
  alignment padding between them) cut into equal contiguous partitions, rank r holding the r-th;
  ``param_slice_mappings`` says which slice of its partition holds which parameter. DeepSpeed's bf16 optimizer (ZeRO-1
  with fp32 gradient accumulation) writes the same layout.
* ZeRO-3: every parameter is flattened, padded to a multiple of the world size and cut into equal pieces; rank r's
  flat vector per sub-group is the concatenation of its piece of each parameter of the sub-group.

The optimizer state of a flat group (Adam's ``exp_avg``, ``exp_avg_sq``) has the flat group's layout; any state
tensor without one value per element cannot be mapped to parameters and is refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .files import (
    MODEL_STATES,
    OPTIM_STATES,
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    FlatPieces,
    ParameterState,
    common_fields,
    group_names,
    hyperparameters,
    load_file,
    rank_order,
)

STEP_KEY = "step"


def read_zero(folder: Path, model_states: dict[str, Any]) -> DeepSpeedCheckpoint:
    files = {}
    for path in folder.iterdir():
        if match := OPTIM_STATES.match(path.name):
            files[int(match.group(2))] = path
    world = model_states.get("dp_world_size") or len(files)
    missing = [r for r in range(world) if r not in files]
    if not files or missing:
        prefix = next(iter(files.values())).name.split("zero_pp_rank_")[0] if files else ""
        raise DeepSpeedCheckpointError(
            f"{folder / f'{prefix}zero_pp_rank_{missing[0] if missing else 0}_mp_rank_00_optim_states.pt'} is "
            f"missing: the checkpoint was written by {world} ranks and holds {len(files)} optimizer partition files; "
            f"use a complete copy")
    if len(files) != world:
        raise DeepSpeedCheckpointError(f"{folder} holds {len(files)} optimizer partition files, but its model states "
                                       f"record {world} ranks: files of several saves are mixed; use one save's")
    ranks = []
    for rank in range(world):
        content = load_file(files[rank])
        state = content.get("optimizer_state_dict") if isinstance(content, dict) else None
        if not isinstance(state, dict):
            raise DeepSpeedCheckpointError(f"{files[rank]} holds no ZeRO optimizer partition (no "
                                           f"optimizer_state_dict): not a file DeepSpeed's ZeRO engine wrote")
        counts = state.get("partition_count")
        if set(counts if isinstance(counts, list) else [counts]) != {world}:
            raise DeepSpeedCheckpointError(
                f"{files[rank]} records a partition count of {counts}, but the checkpoint was written by {world} "
                f"ranks: it comes from another save (another world size), or from expert parallelism's differently "
                f"sized groups, which cannot be read")
        ranks.append(state)
    first = ranks[0]
    stage = int(first.get("zero_stage", 1))  # DeepSpeed's bf16 optimizer (a ZeRO-1 layout) records no stage
    common = common_fields(model_states, folder)
    shapes = group_names(model_states, folder)
    if stage == 3:
        parameters, groups = _zero3_parameters(folder, files, ranks, shapes)
    elif stage in (1, 2):
        parameters, groups = _zero12_parameters(folder, files, ranks, shapes)
    else:
        raise DeepSpeedCheckpointError(f"{files[0]} records ZeRO stage {stage}; hf_zeropp reads stages 1, 2 and 3")
    checkpoint = DeepSpeedCheckpoint(folder=folder, layout="zero", stage=stage, world_size=world,
                                     parameters=parameters, param_groups=groups, **common)
    checkpoint.loss_scaler = dict(first["loss_scaler"]) if isinstance(first.get("loss_scaler"), dict) else None
    if stage == 3 and checkpoint.frozen:
        checkpoint.frozen = _zero3_frozen(folder, model_states, world)
    return checkpoint


def _state_of(optimizer_state: dict[str, Any], index: int, file: Path) -> dict[str, Any]:
    state = optimizer_state.get("state", {})
    if index not in state:
        raise DeepSpeedCheckpointError(f"{file} holds no optimizer state for its flat group {index}: the optimizer "
                                       f"never stepped before the save, or its state was dropped; nothing to resume")
    return state[index]


def _step(state: dict[str, Any], group: dict[str, Any]) -> float | None:
    step = state.get(STEP_KEY, group.get(STEP_KEY))
    return None if step is None else float(step)


def _elementwise(state: dict[str, Any], numel: int, file: Path, index: int) -> dict[str, torch.Tensor]:
    """The optimizer state tensors that hold one value per element of the flat group; any other tensor (a factored
    second moment, a per-row statistic) has no per-parameter meaning and is refused."""
    out = {}
    for key, value in state.items():
        if key == STEP_KEY or not torch.is_tensor(value) or value.dim() == 0:
            continue
        if value.dim() != 1 or value.numel() < numel:
            raise DeepSpeedCheckpointError(
                f"{file}: optimizer state {key!r} of flat group {index} has shape {tuple(value.shape)}, not one value "
                f"per element of the group ({numel}): this optimizer's state cannot be mapped to parameters")
        out[key] = value
    return out


def _zero12_parameters(folder: Path, files: dict[int, Path], ranks: list[dict], shapes: list[dict]):
    first = ranks[0]
    rigid = isinstance(first["base_optimizer_state"], dict)  # else DeepSpeed's elastic form: states without groups
    groups = hyperparameters(first["base_optimizer_state"]["param_groups"]) if rigid else []
    if len(shapes) != len(first["single_partition_of_fp32_groups"]):
        raise DeepSpeedCheckpointError(f"{files[0]} holds {len(first['single_partition_of_fp32_groups'])} flat groups "
                                       f"but the model-states file names {len(shapes)}: the files do not belong "
                                       f"together")
    parameters: dict[str, ParameterState] = {}
    for g, names in enumerate(shapes):
        pieces: dict[str, dict[str, FlatPieces]] = {name: {"fp32": FlatPieces()} for name in names}
        steps = set()
        for r, sd in enumerate(ranks):
            fp32, base = sd["single_partition_of_fp32_groups"][g], sd["base_optimizer_state"]
            if rigid:
                state = _state_of(base, g, files[r])
                step = _step(state, base["param_groups"][g])
            else:
                state, step = base[g], sd.get("base_optimizer_state_step")
            steps.add(None if step is None else float(step))
            tensors = {"fp32": fp32, **_elementwise(state, fp32.numel(), files[r], g)}
            for name, (start, numel) in _slices(sd, g, names, r, len(ranks)).items():
                if name not in pieces:
                    raise DeepSpeedCheckpointError(f"{files[r]} maps a slice to {name}, which the model-states file "
                                                   f"does not list in group {g}: the files do not belong together")
                for key, value in tensors.items():
                    pieces[name].setdefault(key, FlatPieces()).pieces.append((value, start, numel))
        if len(steps) > 1:
            raise DeepSpeedCheckpointError(f"the ranks of {folder} record different optimizer steps {sorted(steps)} "
                                           f"for group {g}: the files come from different saves")
        step = steps.pop()
        for name, shape in names.items():
            state = pieces[name]
            fp32 = state.pop("fp32")
            _check_numel(name, shape, fp32, folder)
            parameters[name] = ParameterState(name, torch.Size(shape), g, fp32, state, step, str(folder))
    return parameters, groups


def _slices(sd: dict, g: int, names: dict, rank: int, world: int) -> dict[str, tuple[int, int]]:
    """Which (start, numel) of this rank's flat partition of group ``g`` holds which parameter: DeepSpeed's own
    ``param_slice_mappings`` where recorded, else the arithmetic of its layout (parameters in order, each followed by
    its alignment padding, the whole cut into equal partitions)."""
    mappings = sd.get("param_slice_mappings")
    if mappings:
        return {name: (int(address["start"]), int(address["numel"])) for name, address in mappings[g].items()}
    paddings = (sd.get("param_alignment_paddings") or [[0] * len(names)] * (g + 1))[g]
    sizes = [s.numel() if hasattr(s, "numel") else math.prod(s) for s in names.values()]
    total = sum(sizes) + sum(paddings)
    partition = math.ceil(total / world / 2) * 2  # DeepSpeed aligns each partition to 2 elements per rank
    lo, hi = rank * partition, (rank + 1) * partition
    out, offset = {}, 0
    for name, size, padding in zip(names, sizes, paddings):
        start, stop = max(lo, offset), min(hi, offset + size)
        if start < stop:
            out[name] = (start - lo, stop - start)
        offset += size + padding
    return out


def _check_numel(name: str, shape, pieces: FlatPieces, folder: Path) -> None:
    expected = math.prod(shape)
    if pieces.numel != expected:
        raise DeepSpeedCheckpointError(
            f"parameter {name} of shape {tuple(shape)} has {expected} elements but the partitions in {folder} hold "
            f"{pieces.numel} of it: the layout cannot be read (files from different saves, or an unsupported "
            f"partitioning)")


def _zero3_parameters(folder: Path, files: dict[int, Path], ranks: list[dict], shapes: list[dict]):
    first = ranks[0]
    world = len(ranks)
    base = first["optimizer_state_dict"]
    groups = hyperparameters(base["param_groups"])
    group_of = {index: g for g, group in enumerate(base["param_groups"]) for index in group["params"]}
    if len(shapes) != len(first["fp32_flat_groups"]):
        raise DeepSpeedCheckpointError(f"{files[0]} holds {len(first['fp32_flat_groups'])} flat sub-groups but the "
                                       f"model-states file names {len(shapes)}: the files do not belong together")
    parameters: dict[str, ParameterState] = {}
    for i, names in enumerate(shapes):
        per_rank = []
        for r, sd in enumerate(ranks):
            flat = sd["fp32_flat_groups"][i]
            state = _state_of(sd["optimizer_state_dict"], i, files[r])
            per_rank.append((flat, _elementwise(state, flat.numel(), files[r], i),
                             _step(state, sd["optimizer_state_dict"]["param_groups"][group_of.get(i, 0)])))
        offset = 0
        for name, shape in names.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world)
            fp32, state = FlatPieces(), {}
            for r, (flat, tensors, _) in enumerate(per_rank):
                take = max(0, min(piece, numel - r * piece))
                fp32.pieces.append((flat, offset, take))
                for key, value in tensors.items():
                    state.setdefault(key, FlatPieces()).pieces.append((value, offset, take))
            offset += piece
            parameters[name] = ParameterState(name, torch.Size(shape), group_of.get(i, 0), fp32, state,
                                              per_rank[0][2], str(folder))
        if offset != per_rank[0][0].numel():
            raise DeepSpeedCheckpointError(
                f"{files[0]}: flat sub-group {i} holds {per_rank[0][0].numel()} elements but its parameters' pieces "
                f"come to {offset}: the layout cannot be read (files from different saves?)")
    return parameters, groups


def _zero3_frozen(folder: Path, model_states: dict, world: int) -> dict[str, torch.Tensor]:
    """ZeRO-3 keeps each rank's piece of a frozen parameter in that rank's model-states file."""
    files = sorted((p for p in folder.iterdir() if MODEL_STATES.match(p.name)), key=rank_order)
    if len(files) != world:
        raise DeepSpeedCheckpointError(f"{folder} holds {len(files)} model-states files for {world} ranks; the "
                                       f"frozen parameters' pieces are incomplete")
    fragments = [load_file(p)["frozen_param_fragments"] for p in files]
    return {name: torch.cat([f[name].reshape(-1) for f in fragments])[:math.prod(shape)].reshape(shape)
            for name, shape in model_states["frozen_param_shapes"].items()}
