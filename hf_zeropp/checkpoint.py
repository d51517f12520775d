"""Checkpoints: sharded and resumable (torch DCP), or consolidated for plain transformers (safetensors).

Both are written atomically: every rank writes into a hidden ``.<name>.partial`` folder beside the target, and
only when all ranks are done does rank 0 rename it into place (a rename within one file system is atomic). A
crash mid-save therefore leaves the previous checkpoint as the newest complete one, and
:func:`latest_checkpoint` never returns a partial folder.

A sharded checkpoint holds the model and optimizer state as DCP shards (loadable on another world size: DCP
reshards), the scheduler, every rank's RNG state, the step and ``extra`` (JSON) in ``zeropp_meta.json``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .hpz import reshard_all

META_FILE = "zeropp_meta.json"
_RNG_DIR = "rng"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _partial_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.partial"


def _begin(directory: Path) -> Path:
    partial = _partial_dir(directory)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left behind by a crashed save
        partial.mkdir(parents=True)
    _barrier()
    return partial


def _commit(partial: Path, directory: Path) -> None:
    """All ranks have written into ``partial``: rank 0 swaps it into place."""
    _barrier()
    if _rank() == 0:
        _fsync_tree(partial)
        replaced = directory.parent / f".{directory.name}.replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        if directory.exists():
            directory.rename(replaced)
        partial.rename(directory)
        _fsync_dir(directory.parent)
        shutil.rmtree(replaced, ignore_errors=True)
    _barrier()


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    import numpy

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, include_model: bool) -> dict[str, Any]:
    """The DTensor state dicts DCP writes and reads in place (each rank only its shards)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state} if include_model else {"optimizer": optim_state}


def _apply_dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    elif "model" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def save_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any | None = None, *, step: int, extra: dict[str, Any] | None = None,
                    include_model: bool = True) -> Path:
    """Write a sharded, resumable checkpoint (collective: call on every rank).

    ``include_model=False`` stores only the optimizer shards (and the rest), for trainers that write the
    weights themselves as a consolidated model.
    """
    directory = Path(directory)
    partial = _begin(directory)
    dcp.save(_dcp_state(model, optimizer, include_model), checkpoint_id=str(partial))
    rng_dir = partial / _RNG_DIR
    if _rank() == 0:
        rng_dir.mkdir(exist_ok=True)
    _barrier()
    torch.save(_rng_state(), rng_dir / f"rank{_rank()}.pt")
    if _rank() == 0:
        if scheduler is not None:
            torch.save(scheduler.state_dict(), partial / "scheduler.pt")
        meta = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "includes_model": include_model, "extra": extra or {}}
        zeropp = getattr(model, "_zeropp", None)
        if zeropp is not None:
            meta["zeropp_config"] = zeropp.config.to_dict()
        (partial / META_FILE).write_text(json.dumps(meta, indent=2))
    _commit(partial, directory)
    return directory


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any | None = None, *, restore_rng: bool = True) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` (any world size); returns its metadata."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a complete hf_zeropp checkpoint (no {META_FILE}); "
            f"pick one returned by latest_checkpoint()"
        )
    meta = json.loads(meta_path.read_text())
    reshard_all(model)
    state = _dcp_state(model, optimizer, meta.get("includes_model", True))
    dcp.load(state, checkpoint_id=str(directory))
    _apply_dcp_state(model, optimizer, state)
    if scheduler is not None and (directory / "scheduler.pt").is_file():
        scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
    rng_file = directory / _RNG_DIR / f"rank{_rank()}.pt"
    same_world = meta.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1)
    if restore_rng and same_world and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return meta


def latest_checkpoint(root: str | os.PathLike, prefix: str = "checkpoint-") -> Path | None:
    """The complete checkpoint under ``root`` with the highest step number (``<prefix><step>``), if any."""
    root = Path(root)
    if not root.is_dir():
        return None
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    found = [(int(m.group(1)), path) for path in root.iterdir()
             if (m := pattern.match(path.name)) and (path / META_FILE).is_file()]
    return max(found)[1] if found else None


def save_pretrained(model: nn.Module, directory: str | os.PathLike, **kwargs: Any) -> Path:
    """Consolidate the sharded model and write a ``from_pretrained``-loadable folder (collective).

    Rank 0 writes safetensors through the model's own ``save_pretrained``, so tied weights, sharded index files
    and the config are exactly what transformers writes; the folder loads without hf_zeropp installed.
    """
    directory = Path(directory)
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    partial = _begin(directory)
    if _rank() == 0:
        if not hasattr(model, "save_pretrained"):
            torch.save(full_state, partial / "pytorch_model.bin")
        else:
            model.save_pretrained(partial, state_dict=full_state, safe_serialization=True, **kwargs)
    _commit(partial, directory)
    return directory
