"""Full (consolidated) state dicts in and out of a sharded model: what plain transformers and Trainer code expects.

Stock code saves with ``model.save_pretrained(dir)`` and loads with ``model.load_state_dict(full_state_dict)``
(the Trainer's ``load_best_model_at_end``, peft's ``load_adapter``, user scripts). Under sharding both touch every
rank's shards, so both are collectives here: saving consolidates onto rank 0, loading hands every rank its slices
of the full tensors (torch's ``set_model_state_dict``). Before either gathers, every rank must have arrived: a
script that saves on rank 0 alone (``if accelerator.is_main_process: model.save_pretrained(...)``, fine under DDP)
gets an error that says so instead of a silent hang.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from .frozen import frozen_stores
from ..interop.hf_checkpoint import (INDEX_FILE, WEIGHTS_FILE, CheckpointSource, SafetensorsFolder, aliases, plan_reads,
                                     read_shards)
from .state import replacing_weights

# How long rank 0 waits for the other ranks to join a consolidating save or load before it names the missing ones.
ARRIVAL_TIMEOUT = datetime.timedelta(minutes=5)


def holds_dtensors(state_dict: Mapping[str, Any]) -> bool:
    return any(isinstance(value, DTensor) for value in state_dict.values())


def expect_every_rank(control_group: dist.ProcessGroup | None, what: str) -> None:
    """Fail with a clear message, instead of hanging, when some rank does not take part in a collective ``what``."""
    if control_group is None:
        return
    try:
        dist.monitored_barrier(group=control_group, timeout=ARRIVAL_TIMEOUT, wait_all_ranks=True)
    except RuntimeError as error:
        raise RuntimeError(
            f"{what} on a model sharded by hf_zeropp is collective: every rank must call it (each holds only its "
            f"shards). Call it on all ranks and let is_main_process / rank 0 decide who writes, e.g. "
            f"model.save_pretrained(dir, is_main_process=accelerator.is_main_process). ({error})"
        ) from error


def consolidated_state_dict(model: nn.Module, control_group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Every parameter and buffer in full, on the CPU, on rank 0; an empty dict on the other ranks (collective).

    INT8-stored frozen weights (``quantized_nontrainable_weights``) are not included: they are not parameters, and a
    dequantized copy would not be the weights the model was given."""
    expect_every_rank(control_group, "saving the full state dict")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _share_tied_tensors(model, state)


def _share_tied_tensors(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Give names that alias one parameter (tied input embedding and output layer) one tensor again.

    Consolidation gathers each name on its own, so tied names come back as equal but separate tensors; transformers
    writes a tied duplicate only once when the two share storage, as in a stock ``state_dict()``, so without this the
    saved file would hold the matrix twice (vocabulary x hidden size more bytes than stock writes)."""
    for first, *others in aliases(model, state):
        for name in others:
            state[name] = state[first]
    return state


def consolidate(model: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``model``'s sharded ``state_dict`` with every DTensor replaced by its full tensor (collective: each DTensor is
    gathered), tied names sharing one tensor as in a stock ``state_dict()``."""
    full = {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state_dict.items()}
    return _share_tied_tensors(model, full)


@contextlib.contextmanager
def _loading(model: nn.Module) -> Iterator[None]:
    """Inside, the model's own ``load_state_dict`` (which torch calls with DTensors) takes the sharded path."""
    model._zeropp_loading_full_state = True
    try:
        yield
    finally:
        model._zeropp_loading_full_state = False


def is_loading_full_state(model: nn.Module) -> bool:
    return getattr(model, "_zeropp_loading_full_state", False)


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True,
                         control_group: dist.ProcessGroup | None = None):
    """Load full (unsharded) tensors into the sharded ``model`` (collective: every rank passes the same keys).

    Gathered weights and hpZ secondary shards are dropped first, so no forward computes with the old values. Frozen
    INT8-stored weights are re-quantized from the given tensors. Returns ``(missing_keys, unexpected_keys)`` as
    ``nn.Module.load_state_dict`` does."""
    expect_every_rank(control_group, "load_state_dict with full tensors")
    replacing_weights(model)
    remaining = dict(state_dict)
    for name, store in frozen_stores(model).items():
        if name in remaining:
            store.load_(remaining.pop(name))
    with _loading(model):
        return set_model_state_dict(model, remaining, options=StateDictOptions(full_state_dict=True, strict=strict))



def load_pretrained_in_slices(model: nn.Module, directory: str | os.PathLike,
                              control_group: dist.ProcessGroup | None = None) -> bool:
    """Read a Hugging Face safetensors folder into the sharded ``model``, each rank only its own slices
    (collective); False, with nothing read, where the folder does not hold every tensor of the model or the model
    stores frozen weights INT8 (the caller then loads the full tensors)."""
    if frozen_stores(model) or not any((Path(directory) / name).is_file() for name in (WEIGHTS_FILE, INDEX_FILE)):
        return False
    expect_every_rank(control_group, "loading a saved model")
    replacing_weights(model)
    source = CheckpointSource(SafetensorsFolder(directory), "", torch.device("cpu"))
    reads = plan_reads(model, source)
    if reads.not_stored:
        return False
    read_shards(model, source, reads)
    return True
