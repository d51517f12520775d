"""Checkpoints: sharded and resumable (torch DCP), or consolidated for plain transformers (safetensors).

Both are written atomically: every rank writes into a hidden ``.<name>.partial`` folder beside the target, and
only when all ranks are done does rank 0 rename it into place (a rename within one file system is atomic). A
crash mid-save therefore leaves the previous checkpoint as the newest complete one, and
:func:`latest_checkpoint` never returns a partial folder. Overwriting an existing folder takes two renames (old
folder aside to ``.<name>.replaced``, new one into place); a crash between them leaves ``.<name>.replaced`` as the
only complete copy, which :func:`latest_checkpoint` then returns and the next save of that name keeps until the
new folder is in place.

A sharded checkpoint holds the model and optimizer state as DCP shards (loadable on another world size: DCP
reshards), the scheduler, every rank's RNG state, the step and ``extra`` (JSON) in ``zeropp_meta.json``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from .._compat import uncompiled
from ..interop.deepspeed.checkpoint import is_deepspeed_checkpoint
from ..engine.full_state import consolidated_state_dict
from ..interop.hf_checkpoint import MAX_SHARD_SIZE, write_pretrained, writes_per_rank
from ..engine.state import replacing_weights
from ..engine.sharding import ZeroPPModule

META_FILE = "zeropp_meta.json"
_RNG_DIR = "rng"
# options that leave the error-feedback residuals' meaning unchanged: which kernel runs, when a technique switches
# off, how generation gathers, recomputation; node_size is compared as resolved (the launcher's or the option's).
# A change of any other option, of the world size or of the node size means a rank's saved residual belongs to
# other elements or another encoding, so it is not restored.
_RESIDUAL_NEUTRAL_OPTIONS = frozenset({"kernel_backend", "quantized_weights_until", "hpz_until",
                                       "quantized_gradients_until", "generation_gather", "activation_checkpointing",
                                       "node_size"})


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


def _replaced_dir(directory: Path) -> Path:
    return directory.parent / f".{directory.name}.replaced"


def _commit(partial: Path, directory: Path) -> None:
    """All ranks have written into ``partial``: rank 0 swaps it into place.

    At every instant a complete copy stays on disk: ``directory`` itself, or — between the two renames, or after a
    crash there — ``.<name>.replaced``, which is only deleted once the new ``directory`` is in place.
    """
    _barrier()
    if _rank() == 0:
        _fsync_tree(partial)
        replaced = _replaced_dir(directory)
        if directory.exists():
            shutil.rmtree(replaced, ignore_errors=True)  # a stale copy: ``directory`` is complete
            directory.rename(replaced)
        # else: a ``.replaced`` left by a crash between the renames is the only complete copy; keep it until now
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
    model = uncompiled(model)  # a torch.compile wrapper: the model's own names
    directory = Path(directory)
    partial = _begin(directory)
    dcp.save(_dcp_state(model, optimizer, include_model), checkpoint_id=str(partial))
    rng_dir = partial / _RNG_DIR
    if _rank() == 0:
        rng_dir.mkdir(exist_ok=True)
    _barrier()
    qgz_states = _qgz_states(model)
    all_reduce = _cross_node_all_reduce(model)
    torch.save({**_rng_state(), "qgz_residuals": [state["error_feedback"] for state in qgz_states],
                "cross_node_residuals": None if all_reduce is None else all_reduce.residuals_state_dict()},
               rng_dir / f"rank{_rank()}.pt")
    if _rank() == 0:
        if scheduler is not None:
            torch.save(scheduler.state_dict(), partial / "scheduler.pt")
        meta = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "includes_model": include_model, "extra": extra or {}}
        zeropp = getattr(model, "_zeropp", None)
        if zeropp is not None:
            meta["zeropp_config"] = zeropp.config.to_dict()
            meta["node_size"] = zeropp.topology.node_size
            meta["qgz_calls"] = [state["calls"] for state in qgz_states]
            if all_reduce is not None:
                meta["cross_node_all_reduce"] = all_reduce.state_dict()
        (partial / META_FILE).write_text(json.dumps(meta, indent=2))
    _commit(partial, directory)
    return directory


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any | None = None, *, restore_rng: bool = True) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` (any world size); returns its metadata."""
    model = uncompiled(model)  # a torch.compile wrapper: the model's own names
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file() and is_deepspeed_checkpoint(directory):
        raise FileNotFoundError(
            f"{str(directory)!r} is a DeepSpeed checkpoint, not an hf_zeropp one: resume it with "
            f"hf_zeropp.load_deepspeed_checkpoint (weights, optimizer and scheduler), or convert it once with "
            f"`hf-zeropp from-deepspeed`")
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a complete hf_zeropp checkpoint (no {META_FILE}); "
            f"pick one returned by latest_checkpoint()"
        )
    meta = json.loads(meta_path.read_text())
    replacing_weights(model)
    state = _dcp_state(model, optimizer, meta.get("includes_model", True))
    dcp.load(state, checkpoint_id=str(directory))
    _apply_dcp_state(model, optimizer, state)
    if scheduler is not None and (directory / "scheduler.pt").is_file():
        scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
    rng_file = directory / _RNG_DIR / f"rank{_rank()}.pt"
    same_world = meta.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1)
    rank_state = torch.load(rng_file, weights_only=False) if same_world and rng_file.is_file() else {}
    if restore_rng and rank_state:
        _set_rng_state(rank_state)
    keep_residuals = _residuals_apply(directory, meta, model)
    _restore_qgz_states(model, meta.get("qgz_calls"), rank_state.get("qgz_residuals") if keep_residuals else None)
    all_reduce = _cross_node_all_reduce(model)
    if all_reduce is not None and "cross_node_all_reduce" in meta:
        all_reduce.load_state_dict(meta["cross_node_all_reduce"])
    if all_reduce is not None and keep_residuals and rank_state.get("cross_node_residuals") is not None:
        all_reduce.load_residuals_state_dict(rank_state["cross_node_residuals"])
    return meta


def _residuals_apply(directory: Path, meta: dict[str, Any], model: nn.Module) -> bool:
    """Whether the saved error-feedback residuals belong to this run's layout. A residual is what one rank's
    quantization dropped from its own slice of a gradient, so on another world size, node size or quantization
    setting it would be added to other elements (with equal shapes, silently). There they start from zero, as on a
    fresh start, and rank 0 says so once; ``comm_stats()["implementations"]`` records it."""
    zeropp = getattr(model, "_zeropp", None)
    saved = meta.get("zeropp_config") or {}
    if zeropp is None or not (saved.get("gradient_error_feedback") and zeropp.config.gradient_error_feedback):
        return True  # nothing saved to restore, or nothing here to restore it into
    current = zeropp.config.to_dict()
    world = dist.get_world_size() if dist.is_initialized() else 1
    changes = [f"{what} {before} -> {now}" for what, before, now in (
        ("world size", meta.get("world_size"), world),
        ("node size", meta.get("node_size", "unrecorded"), zeropp.topology.node_size)) if before != now]
    changes += [f"{option} {saved.get(option)!r} -> {current.get(option)!r}"
                for option in sorted(set(saved) | set(current))
                if option not in _RESIDUAL_NEUTRAL_OPTIONS and saved.get(option) != current.get(option)]
    if not changes:
        return True
    reason = (f"the error-feedback residuals in {str(directory)!r} were not restored ({'; '.join(changes)}): they "
              f"belong to other gradient elements in this layout, so they start from zero, as on a fresh start")
    zeropp.meter.conditions["gradient_error_feedback_residuals"] = f"not restored: {reason}"
    if _rank() == 0:
        warnings.warn(f"hf_zeropp: {reason}. Resume on the saving run's world size, node size and options to "
                      f"restore them", stacklevel=3)
    return False


def _cross_node_all_reduce(model: nn.Module):
    """Hybrid-q's quantized cross-node all-reduce of the model (None for other configurations)."""
    return getattr(getattr(model, "_zeropp", None), "cross_node_all_reduce", None)


def _reduce_scatters(model: nn.Module) -> list:
    """The model's qgZ reduce-scatters, one per FSDP unit (none for an unsharded model)."""
    return getattr(getattr(model, "_zeropp", None), "reduce_scatters", None) or []


def _qgz_states(model: nn.Module) -> list[dict]:
    """Each qgZ reduce-scatter's :meth:`~hf_zeropp.comm.qgz.QuantizedReduceScatter.state_dict`."""
    return [reduce_scatter.state_dict() for reduce_scatter in _reduce_scatters(model)]


def _restore_qgz_states(model: nn.Module, calls: list[int] | None, residuals: list | None) -> None:
    """Give each qgZ reduce-scatter its saved call count (rank 0's, from the metadata) and this rank's
    error-feedback residuals (``None`` where :func:`_residuals_apply` found another layout). Saved from a
    differently wrapped model, they are left out: seeds restart and residuals start from zero (only rounding
    differs, by one step's worth)."""
    reduce_scatters = _reduce_scatters(model)
    for key, saved in (("calls", calls), ("error_feedback", residuals)):
        if saved and len(saved) == len(reduce_scatters):
            for reduce_scatter, value in zip(reduce_scatters, saved):
                reduce_scatter.load_state_dict({key: value})


def latest_checkpoint(root: str | os.PathLike, prefix: str = "checkpoint-") -> Path | None:
    """The complete checkpoint under ``root`` with the highest step number (``<prefix><step>``), if any.

    Hidden ``.<prefix><step>.partial`` folders (a save that did not finish) are never returned. A
    ``.<prefix><step>.replaced`` folder is returned only when ``<prefix><step>`` itself is missing: it is the
    previous complete copy of that step, left by a crash between the two renames that overwrite a checkpoint.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    replaced = re.compile(r"\." + re.escape(prefix) + r"(\d+)\.replaced$")
    found: dict[int, Path] = {}
    for path in root.iterdir():
        if (m := pattern.match(path.name)) and (path / META_FILE).is_file():
            found[int(m.group(1))] = path
    for path in root.iterdir():
        if (m := replaced.match(path.name)) and (path / META_FILE).is_file():
            found.setdefault(int(m.group(1)), path)
    return found[max(found)] if found else None


TRAINER_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME: the last file a Trainer checkpoint gets
TRAINER_OPTIMIZER_DIR = "zeropp_optimizer"  # where ZeroPPTrainer keeps the optimizer shards in a checkpoint


def is_complete_trainer_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a Trainer ``checkpoint-<step>`` folder was written to the end.

    The Trainer writes straight into ``checkpoint-<step>``: weights, then optimizer (for hf_zeropp: the collective,
    atomic ``zeropp_optimizer/``, whose last barrier means every rank's shards are on disk), RNG states, and
    ``trainer_state.json`` last. A crash in between leaves a folder with that name but no ``trainer_state.json``,
    or a hidden ``.zeropp_optimizer.partial``. (Other ranks' ``rng_state_<rank>.pth`` are written without a
    barrier before ``trainer_state.json``; a crash there loses only those RNG states, which the Trainer then skips
    with a warning.)
    """
    path = Path(path)
    if not (path / TRAINER_STATE_FILE).is_file() or (path / f".{TRAINER_OPTIMIZER_DIR}.partial").exists():
        return False
    optimizer_dir = path / TRAINER_OPTIMIZER_DIR
    return not optimizer_dir.exists() or (optimizer_dir / META_FILE).is_file()


def latest_trainer_checkpoint(output_dir: str | os.PathLike, prefix: str = "checkpoint-") -> Path | None:
    """The newest *complete* Trainer checkpoint in ``output_dir``, for ``trainer.train(resume_from_checkpoint=...)``.

    transformers' ``get_last_checkpoint`` (what ``resume_from_checkpoint=True`` uses) returns the highest-numbered
    ``checkpoint-<step>`` folder whether or not it was written to the end; after a crash mid-save that is a partial
    folder without ``trainer_state.json``, and every resume then fails on it. This skips such folders.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return None
    pattern = re.compile(re.escape(prefix) + r"(\d+)$")
    found = [(int(m.group(1)), path) for path in root.iterdir()
             if (m := pattern.match(path.name)) and path.is_dir() and is_complete_trainer_checkpoint(path)]
    return max(found)[1] if found else None


def save_pretrained(model: nn.Module, directory: str | os.PathLike, **kwargs: Any) -> Path:
    """Write the sharded model as a ``from_pretrained``-loadable folder, atomically (collective).

    Every rank writes its own rows of the standard safetensors files
    (:func:`hf_zeropp.interop.hf_checkpoint.write_pretrained`); no rank gathers the model. The folder loads without
    hf_zeropp installed. Other models (and arguments the per-rank writer does not take) are consolidated on rank 0
    and written by the model's own ``save_pretrained``; a model without one (a plain ``nn.Module``) as
    ``pytorch_model.bin``.
    """
    model = uncompiled(model)  # a torch.compile wrapper: the model's own names
    directory = Path(directory)
    zeropp = getattr(model, "_zeropp", None)
    control_group = zeropp.topology.control_group if zeropp is not None else None
    per_rank = zeropp is not None and writes_per_rank(model, kwargs)
    full_state = {} if per_rank else consolidated_state_dict(model, control_group)
    partial = _begin(directory)
    if per_rank:
        write_pretrained(model, partial, kwargs.get("max_shard_size", MAX_SHARD_SIZE), control_group)
    elif _rank() == 0:
        # every sharded model has ZeroPPModule's save_pretrained, which calls its own class's: ask that class
        own = super(ZeroPPModule, model) if isinstance(model, ZeroPPModule) else model
        if not hasattr(own, "save_pretrained"):
            torch.save(full_state, partial / "pytorch_model.bin")
        else:
            model.save_pretrained(partial, state_dict=full_state, safe_serialization=True, **kwargs)
    _commit(partial, directory)
    return directory
