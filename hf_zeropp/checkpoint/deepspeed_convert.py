"""Checkpoints between DeepSpeed and hf_zeropp ahead of time, in one process, without DeepSpeed installed.

* :func:`convert_deepspeed_checkpoint`: a DeepSpeed checkpoint (ZeRO-1/2/3 partitions or universal) becomes hf_zeropp's
  sharded checkpoint: torch DCP shards of the fp32 weights and the optimizer state, the scheduler state, the step. A
  Trainer ``checkpoint-N`` folder becomes one the hf_zeropp Trainer resumes (fp32 ``model.safetensors`` in place of
  DeepSpeed's 16-bit copy, the optimizer in ``zeropp_optimizer/``, the Trainer's own files kept); any other folder
  becomes one :func:`hf_zeropp.load_checkpoint` and ``Accelerator.load_state`` read.
* :func:`export_deepspeed_universal`: the reverse. An hf_zeropp checkpoint (sharded, or a Trainer ``checkpoint-N``)
  becomes a DeepSpeed universal checkpoint, which DeepSpeed resumes with ``"checkpoint": {"load_universal": true}``
  in its config, on any world size and ZeRO stage, with Adam's moments, the step and the scheduler's position.

``hf-zeropp from-deepspeed`` and ``hf-zeropp to-deepspeed`` run them from the command line.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .checkpoint import META_FILE, TRAINER_OPTIMIZER_DIR, TRAINER_STATE_FILE
from ..interop.deepspeed.checkpoint import read_deepspeed_checkpoint
from ..interop.deepspeed.files import DeepSpeedCheckpoint, DeepSpeedCheckpointError
from .deepspeed_restore import torch_hyperparameters
from ..interop.deepspeed.universal import write_universal

# DeepSpeed's files in a Trainer checkpoint folder, replaced by hf_zeropp's on conversion (and the reverse)
_DEEPSPEED_ONLY = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _on_rank_zero(work) -> Any:
    """Conversion is one process's job; inside a distributed job rank 0 does it and the others wait for it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = work() if rank == 0 else None
    if dist.is_initialized():
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    return result


def _fresh_partial(output: Path) -> Path:
    partial = output.parent / f".{output.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a conversion that crashed
    partial.mkdir(parents=True)
    return partial


def _into_place(partial: Path, output: Path) -> None:
    """Rename the finished ``partial`` to ``output``; an existing ``output`` is replaced only once the new one is
    complete (it waits as ``.<name>.replaced`` between the two renames)."""
    replaced = output.parent / f".{output.name}.replaced"
    if output.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        output.rename(replaced)
    partial.rename(output)
    shutil.rmtree(replaced, ignore_errors=True)


def deepspeed_full_state(checkpoint: DeepSpeedCheckpoint) -> tuple[dict, dict, list[dict]]:
    """A DeepSpeed checkpoint as full tensors, laid out as torch's ``get_state_dict`` lays out a model's and its
    optimizer's: weights by name (tied names included), optimizer state by parameter name, groups naming their
    parameters."""
    weights = {name: entry.fp32.read(0, entry.fp32.numel).reshape(entry.shape)
               for name, entry in checkpoint.parameters.items()}
    weights.update({name: value.float() for name, value in {**checkpoint.frozen, **checkpoint.buffers}.items()})
    weights.update({alias: weights[name] for alias, name in checkpoint.shared.items() if name in weights})
    optimizer_state = {}
    for name, entry in checkpoint.parameters.items():
        state = {key: pieces.read(0, pieces.numel).reshape(entry.shape) for key, pieces in entry.state.items()}
        if entry.step is not None:
            state["step"] = torch.tensor(entry.step)
        optimizer_state[name] = state
    defaults = _optimizer_defaults(checkpoint)
    groups = []
    for index, group in enumerate(checkpoint.param_groups):
        values = {**defaults, **torch_hyperparameters(group)}
        groups.append({**values, "params": [n for n, e in checkpoint.parameters.items() if e.group == index]})
    if not groups:
        raise DeepSpeedCheckpointError(f"{checkpoint.folder} records no optimizer parameter groups (DeepSpeed's "
                                       f"elastic format): resume it with hf_zeropp.load_deepspeed_checkpoint, which "
                                       f"keeps the optimizer's own hyperparameters, instead of converting it")
    return weights, optimizer_state, groups


def _optimizer_defaults(checkpoint: DeepSpeedCheckpoint) -> dict[str, Any]:
    """The hyperparameters hf_zeropp's optimizer keeps for the DeepSpeed config's ``optimizer`` section (the torch
    optimizer :func:`hf_zeropp.interop.deepspeed.optim.build_optimizer` makes of it): DeepSpeed's own optimizers keep
    fewer (FusedAdam holds AdamW's decoupled decay as an attribute), and a converted checkpoint must hold every key the
    resuming optimizer loads. None needed for a torch optimizer the script built: its groups hold them all."""
    section = (checkpoint.model_states.get("ds_config") or {}).get("optimizer")
    if not section:
        return {}
    from ..interop.deepspeed.optim import build_optimizer

    probe = build_optimizer([torch.zeros(1, requires_grad=True)], section)
    return {key: value for key, value in probe.param_groups[0].items() if key not in ("params", "lr")}


def convert_deepspeed_checkpoint(source: str | Path, output: str | Path, *, tag: str | None = None) -> Path:
    """Write the DeepSpeed checkpoint at ``source`` as an hf_zeropp checkpoint at ``output`` (see the module's
    docstring); written into a hidden folder and renamed into place. Returns ``output``."""
    source, output = Path(source), Path(output)

    def work() -> str:
        checkpoint = read_deepspeed_checkpoint(source, tag)
        weights, optimizer_state, groups = deepspeed_full_state(checkpoint)
        trainer = (source / TRAINER_STATE_FILE).is_file()
        partial = _fresh_partial(output)
        target = partial / TRAINER_OPTIMIZER_DIR if trainer else partial
        target.mkdir(exist_ok=True)
        optimizer = {"state": optimizer_state, "param_groups": groups}
        state = {"optimizer": optimizer} if trainer else {"model": weights, "optimizer": optimizer}
        with warnings.catch_warnings():  # one process without a process group is what DCP is told here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(target), no_dist=True)
        schedule = _trainer_schedule(source) if trainer else None
        schedule = schedule if schedule is not None else checkpoint.lr_scheduler
        if schedule is not None:
            torch.save(schedule, target / "scheduler.pt")
        (target / META_FILE).write_text(json.dumps({
            "step": checkpoint.global_steps or 0, "world_size": checkpoint.world_size, "includes_model": not trainer,
            "extra": {"converted_from_deepspeed": str(checkpoint.folder), "ds_version": checkpoint.ds_version}},
            indent=2))
        if trainer:
            _copy_trainer_files(source, partial, skip={checkpoint.folder.name, *_DEEPSPEED_ONLY, *_WEIGHT_FILES})
            from safetensors.torch import save_file

            unique = {n: w.contiguous() for n, w in weights.items() if n not in checkpoint.shared}
            save_file(unique, str(partial / "model.safetensors"), metadata={"format": "pt"})
        _into_place(partial, output)
        return str(output)

    return Path(_on_rank_zero(work))


def _trainer_schedule(folder: Path) -> dict[str, Any] | None:
    """The Trainer's own ``scheduler.pt`` (written beside DeepSpeed's files when the Trainer made the scheduler)."""
    path = folder / "scheduler.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def _copy_trainer_files(source: Path, target: Path, skip: set[str]) -> None:
    for path in source.iterdir():
        if path.name in skip or path.name.startswith("."):
            continue
        if path.is_dir():
            shutil.copytree(path, target / path.name)
        else:
            shutil.copy2(path, target / path.name)


def _read_dcp(folder: Path) -> dict[str, Any]:
    """A whole DCP checkpoint in one process, as the nested dicts it was saved from."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(str(folder), f"{scratch}/state.pt")
        return torch.load(f"{scratch}/state.pt", weights_only=False)


def _safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    weights = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: the checkpoint's weights are incomplete")
        weights.update(load_file(str(folder / name)))
    return weights


def export_deepspeed_universal(source: str | Path, output: str | Path) -> Path:
    """Write the hf_zeropp checkpoint at ``source`` as a DeepSpeed universal checkpoint in ``output``
    (``global_step<N>/`` and ``latest_universal``). A Trainer ``checkpoint-N`` folder keeps its Trainer files
    (``trainer_state.json``, RNG states, ``scheduler.pt``, the weights) beside them, so that a DeepSpeed Trainer resumes
    it with ``resume_from_checkpoint``. Returns the tag folder."""
    source, output = Path(source), Path(output)

    def work() -> str:
        trainer = (source / TRAINER_OPTIMIZER_DIR / META_FILE).is_file()
        folder = source / TRAINER_OPTIMIZER_DIR if trainer else source
        if not (folder / META_FILE).is_file():
            raise FileNotFoundError(f"{source} is not an hf_zeropp checkpoint (no {META_FILE}, no "
                                    f"{TRAINER_OPTIMIZER_DIR}/{META_FILE}); pass a folder hf_zeropp saved")
        meta = json.loads((folder / META_FILE).read_text())
        state = _read_dcp(folder)
        if "optimizer" not in state:
            raise DeepSpeedCheckpointError(f"{folder} holds no optimizer state: a universal checkpoint without it "
                                           f"would resume DeepSpeed with a fresh optimizer; save one with it")
        weights_by_name = _safetensors_weights(source) if trainer else state["model"]
        optimizer = state["optimizer"]
        trainable = [name for group in optimizer["param_groups"] for name in group["params"]]
        missing = [name for name in trainable if name not in weights_by_name]
        if missing:
            raise DeepSpeedCheckpointError(f"{source} holds optimizer state for {missing[0]} but no weights for it")
        weights = {name: weights_by_name[name].float() for name in trainable}
        schedule = torch.load(folder / "scheduler.pt", weights_only=True) if (folder / "scheduler.pt").is_file() \
            else None
        output.mkdir(parents=True, exist_ok=True)
        tag_folder = write_universal(output, weights=weights, optimizer_state=optimizer["state"],
                                     param_groups=optimizer["param_groups"], scheduler_state=schedule,
                                     step=int(meta.get("step", 0)), world_size=int(meta.get("world_size", 1)))
        if trainer:
            _copy_trainer_files(source, output, skip={TRAINER_OPTIMIZER_DIR, tag_folder.name, *_DEEPSPEED_ONLY})
            if schedule is not None:
                torch.save(schedule, output / "scheduler.pt")
        return str(tag_folder)

    return Path(_on_rank_zero(work))
