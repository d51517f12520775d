"""Hugging Face safetensors folders read and written by every rank at once, so that no rank holds the whole model.

Loading: :func:`hf_zeropp.from_pretrained` builds the model on the meta device on every rank and attaches the
folder it came from (:class:`SafetensorsFolder`, checked when opened: missing files, truncated files, no weights).
:func:`hf_zeropp.shard_model` then gives every rank its own slices of each tensor, read from the files through torch
DCP (its Hugging Face reader, opening the file per tensor; safetensors' ``get_slice``: only the slice is read).
Frozen weights stored INT8 are quantized from the rank's own rows. Parameters that a wrapper added after loading
(peft's LoRA adapters) are built by their own init, from one seed on every rank.

Saving: the standard files are laid out from the tensors' global shapes (the same on every rank); rank 0 writes
each file's header and every rank writes its own rows of each tensor at their offset in the file, straight from
its shard. FSDP2 shards tensors by rows, so a rank's rows are one contiguous range of the file: nothing is copied,
gathered or written twice. (torch DCP's Hugging Face writer plus its consolidation would write every byte twice and
hold a serialized file, then a whole tensor, in memory.) The files are written under a hidden folder in the target
and renamed into place when complete, so a save that fails leaves the previous weights readable."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.futures import Future

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PARTIAL = ".zeropp-weights.partial"
MAX_SHARD_SIZE = "50GB"  # transformers' save_pretrained default
_FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    shape: tuple[int, ...]


class SafetensorsFolder:
    """The tensors of a Hugging Face safetensors folder (one ``model.safetensors``, or the files an index names)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.tensors = _scan(self.directory)

    def shape_errors(self, expected: dict[str, tuple[int, ...]]) -> list[str]:
        """One line per tensor of ``expected`` (checkpoint name -> shape) stored with another shape."""
        return [f"{name}: {tuple(shape)} in the model, {self.tensors[name].shape} in {self.tensors[name].file}"
                for name, shape in expected.items() if name in self.tensors and self.tensors[name].shape != shape]

    def first_floating_dtype(self) -> torch.dtype | None:
        """The dtype of the first stored floating tensor (in name order): what transformers' ``dtype="auto"``
        reads when the config states no dtype."""
        from safetensors import safe_open

        for name in sorted(self.tensors):
            with safe_open(str(self.tensors[name].file), framework="pt") as handle:
                code = handle.get_slice(name).get_dtype()
            if code in _FLOAT_CODES:
                return _FLOAT_CODES[code]
        return None

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened (``stop`` cut at its end), reading only the rows
        that hold them."""
        from safetensors import safe_open

        stored = self.tensors[name]
        numel = 1
        for size in stored.shape:
            numel *= size
        stop = min(stop, numel)
        if stop <= start:
            return torch.empty(0)
        row = numel // stored.shape[0] if stored.shape else 1
        first, last = start // row, -(-stop // row)
        with safe_open(str(stored.file), framework="pt") as handle:
            rows = handle.get_slice(name)[first:last] if stored.shape else handle.get_tensor(name)
        return rows.reshape(-1)[start - first * row: stop - first * row]


def _scan(directory: Path) -> dict[str, StoredTensor]:
    from safetensors import SafetensorError, safe_open

    index = directory / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        for name, file in weight_map.items():
            if not (directory / file).is_file():
                raise FileNotFoundError(f"{index} names {file} as the file of tensor {name!r}, but {directory / file} "
                                        f"does not exist: download or copy the missing file, or save the model again")
        files = sorted(set(weight_map.values()))
    elif (directory / WEIGHTS_FILE).is_file():
        weight_map, files = {}, [WEIGHTS_FILE]
    else:
        raise FileNotFoundError(f"{directory} holds no safetensors weights ({WEIGHTS_FILE} or {INDEX_FILE})")
    tensors: dict[str, StoredTensor] = {}
    for file in files:
        path = directory / file
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = StoredTensor(path, tuple(handle.get_slice(name).get_shape()))
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file ({error}); it may be truncated or "
                             f"corrupt: download or save it again") from error
    for name, file in weight_map.items():
        if name not in tensors or tensors[name].file.name != Path(file).name:
            raise ValueError(f"{index} says tensor {name!r} is in {file}, but that file does not hold it: the index "
                             f"and the files are from different saves; save the model again")
    return tensors


def weight_folder(name_or_path: str | os.PathLike, kwargs: dict[str, Any]) -> Path | None:
    """The local folder of ``name_or_path``'s safetensors weights: the path itself, or its copy in the Hugging Face
    cache (downloaded if needed). None where there are none to slice (``.bin`` pickles only)."""
    directory = Path(name_or_path)
    subfolder = kwargs.get("subfolder") or ""
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        directory = Path(snapshot_download(
            str(name_or_path), revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"),
            token=kwargs.get("token"), local_files_only=kwargs.get("local_files_only", False),
            allow_patterns=["*.safetensors", "*.json"]))
    directory = directory / subfolder
    return directory if (directory / INDEX_FILE).is_file() or (directory / WEIGHTS_FILE).is_file() else None


# ------------------------------------------------------------------------------------------------ loading


class CheckpointSource:
    """A sharded model's tensors in a :class:`SafetensorsFolder`: state-dict names mapped to the folder's names
    (the prefix of a wrapper such as peft's ``base_model.model.``, peft's ``.base_layer`` inserted into wrapped
    layers' names). Also the source of frozen INT8 weights (:class:`hf_zeropp.engine.frozen.FrozenWeightSource`)."""

    def __init__(self, folder: SafetensorsFolder, prefix: str, device: torch.device) -> None:
        self.folder, self.prefix, self.device = folder, prefix, device

    @classmethod
    def of(cls, model: nn.Module, device: torch.device) -> CheckpointSource | None:
        """The source :func:`hf_zeropp.from_pretrained` attached to ``model`` or a module inside it, if any."""
        for name, module in model.named_modules():
            folder = vars(module).get("_zeropp_checkpoint")  # not getattr: wrappers forward attributes
            if folder is not None:
                return cls(folder, f"{name}." if name else "", device)
        return None

    def stored_name(self, key: str) -> str | None:
        if not key.startswith(self.prefix):
            return None
        name = key[len(self.prefix):].replace(".base_layer.", ".")
        return name if name in self.folder.tensors else None

    def fill(self, name: str, store: Any) -> None:
        stored = self.stored_name(name)
        if stored is None:
            raise ValueError(f"frozen weight {name!r} is not in {self.folder.directory}")
        store.load_own_part_(self.folder.read_flat(stored, *store.own_range()))


@dataclass
class ShardReads:
    """What :func:`read_shards` reads into the sharded model: checkpoint name -> the model's (sharded) tensor, the
    state dict they belong to, and the state-dict names the folder does not hold (adapters a wrapper added)."""

    into: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    not_stored: list[str]


def plan_reads(model: nn.Module, source: CheckpointSource) -> ShardReads:
    """Match the sharded ``model``'s tensors to ``source``'s and check their shapes, before anything is read."""
    state = get_model_state_dict(model)
    into: dict[str, torch.Tensor] = {}
    not_stored: list[str] = []
    for keys in aliases(model, state):
        stored = next((name for name in map(source.stored_name, keys) if name is not None), None)
        if stored is None:
            not_stored.extend(keys)
        else:
            into[stored] = state[keys[0]]
    mismatched = source.folder.shape_errors({name: tuple(value.shape) for name, value in into.items()})
    if mismatched:
        raise ValueError(f"{source.folder.directory} does not fit this model; tensors whose shapes differ: "
                         + "; ".join(mismatched[:5]) + ". Load the checkpoint with the config it was saved with")
    return ShardReads(into, state, not_stored)


def read_shards(model: nn.Module, source: CheckpointSource, reads: ShardReads) -> None:
    """Every rank reads its own slices of the planned tensors (collective: DCP plans the reads together)."""
    dcp.load(reads.into, storage_reader=_SliceReader(str(source.folder.directory)),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    stored = {key: value for key, value in reads.state.items() if key not in reads.not_stored}
    set_model_state_dict(model, stored, options=StateDictOptions(strict=False))


class _SliceReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader, opening the file once per tensor instead of once per file. safetensors maps the
    file into memory, and every page a rank read stays in its resident memory until the file is closed: with one
    open per file, that is the rank's whole share of the checkpoint (1.5B on 4 ranks: +1.6 GB per rank)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        for item in plan.items:
            with safe_open(str(self.storage_data[item.storage_index].relative_path), framework="pt") as handle:
                rows = tuple(slice(offset, offset + length)
                             for offset, length in zip(item.storage_offsets, item.lengths))
                target = planner.resolve_tensor(item).detach()
                target.copy_(handle.get_slice(item.storage_index.fqn)[rows])
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def aliases(model: nn.Module, keys: Iterable[str]) -> list[list[str]]:
    """``keys`` (state-dict names of ``model``) grouped by the parameter or buffer they name: tied weights form one
    group of several names, in the model's order."""
    keys = set(keys)
    groups: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for key, value in named:
        if key in keys:
            groups.setdefault(id(value), []).append(key)
    grouped = {key for group in groups.values() for key in group}
    return [*groups.values(), *([key] for key in keys if key not in grouped)]


# ------------------------------------------------------------------------------------------------ saving


# save_pretrained arguments the per-rank writer honours (the rest: transformers' own save of a consolidated copy)
_WRITER_ARGUMENTS = {"max_shard_size", "is_main_process", "save_function", "safe_serialization"}


def writes_per_rank(model: nn.Module, arguments: dict[str, Any] | None = None) -> bool:
    """Whether :func:`write_pretrained` can save ``model`` as ``model.save_pretrained(**arguments)`` would: a
    transformers model (not a peft wrapper, which saves its adapter), safetensors, no hub upload or variants."""
    from transformers import PreTrainedModel

    arguments = arguments or {}
    return (isinstance(model, PreTrainedModel) and hasattr(model, "is_remote_code")  # transformers 5
            and set(arguments) <= _WRITER_ARGUMENTS
            and arguments.get("safe_serialization", True) is not False)


def write_pretrained(model: nn.Module, directory: str | os.PathLike, max_shard_size: int | str = MAX_SHARD_SIZE,
                     control_group: dist.ProcessGroup | None = None) -> Path:
    """Write the sharded ``model`` as a Hugging Face safetensors folder from every rank (collective).

    The tensors are those of a consolidated save (tied weights once, INT8-stored frozen weights left out); files
    split at ``max_shard_size`` as transformers splits them. Rank 0 writes each file's header; every rank writes its
    own rows of each tensor at their place in the file, straight from its shard (no copy, no gather). Other files in
    ``directory`` are kept; weight files of an earlier save there are replaced. A rank that fails to write makes
    every rank raise."""
    directory = Path(directory)
    partial = directory / _PARTIAL
    state = _unique(model, get_model_state_dict(model))
    files = _layout(state, _bytes(max_shard_size))
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that failed
        partial.mkdir(parents=True)
        for file in files:
            file.create(partial)
    dist.barrier(group=control_group)
    failure = None
    try:
        for file in files:
            file.write_own_rows(partial, state)
    except OSError as error:
        failure = repr(error)
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure, group=control_group)
    failed = next(((rank, text) for rank, text in enumerate(failures) if text is not None), None)
    if failed is not None:
        raise OSError(f"saving {directory} failed: rank {failed[0]} could not write its slices ({failed[1]}); the "
                      f"files already in {directory} are untouched. Free space or fix the folder and save again")
    if dist.get_rank() == 0:
        _finish(model, partial, directory, files)
    dist.barrier(group=control_group)
    return directory


_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class _OutputFile:
    """One safetensors file of a save: its name, its header (length prefix included), where each tensor's bytes
    start in it, and its size."""

    name: str
    header: bytes
    starts: dict[str, int]
    size: int

    def create(self, folder: Path) -> None:
        """Rank 0: the header, and the file at its full size; the ranks that own the data write it."""
        with open(folder / self.name, "wb") as handle:
            handle.write(self.header)
            handle.truncate(self.size)

    def write_own_rows(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """Write this rank's rows of each tensor in the file (a tensor no mesh shards: rank 0) at their place."""
        fd = os.open(folder / self.name, os.O_WRONLY)
        try:
            for name, start in self.starts.items():
                owned = _own_rows(state[name])
                if owned is None:
                    continue
                first_row, rows = owned
                data = rows.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                row_bytes = data.nbytes // rows.shape[0] if rows.dim() else 0
                _pwrite_all(fd, memoryview(data), start + first_row * row_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)


def _layout(state: dict[str, torch.Tensor], max_bytes: int) -> list[_OutputFile]:
    """The files of a save of ``state`` (every rank computes the same): tensors in state-dict order, a new file
    when the next tensor would pass ``max_bytes`` (transformers' rule); one file is ``model.safetensors``."""
    for name, value in state.items():
        if value.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"cannot save {name}: dtype {value.dtype} has no safetensors code")
        for placement in getattr(value, "placements", ()):
            if not (placement.is_replicate() or (placement.is_shard() and placement.dim == 0)):
                raise ValueError(f"cannot save {name} in slices: it is placed {value.placements}, not in rows")
    groups: list[list[str]] = [[]]
    used = 0
    for name, value in state.items():
        size = value.numel() * value.element_size()
        if groups[-1] and used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    files = []
    for index, names in enumerate(groups, start=1):
        entries, offset = {}, 0
        for name in names:
            value = state[name]
            size = value.numel() * value.element_size()
            entries[name] = {"dtype": _SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                             "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        header = struct.pack("<Q", len(text)) + text
        file_name = WEIGHTS_FILE if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        files.append(_OutputFile(file_name, header, {name: len(header) + entry["data_offsets"][0]
                                                     for name, entry in entries.items()}, len(header) + offset))
    return files


def _own_rows(value: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(first row, the rows) of ``value`` this rank writes: its shard of a row-sharded DTensor (one replica of each
    shard: the ranks whose replicate coordinates are 0), a whole unsharded tensor on rank 0; None otherwise."""
    if not isinstance(value, DTensor):
        return (0, value) if dist.get_rank() == 0 else None
    coordinate = value.device_mesh.get_coordinate()
    first_row = 0
    for dim, placement in enumerate(value.placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return None
        if placement.is_shard():
            first_row += coordinate[dim] * -(-value.shape[0] // value.device_mesh.size(dim))
    local = value.to_local()
    return (first_row, local) if local.numel() else None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _unique(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per tensor, the first (a tied output layer is written under its input embedding's name only, as
    transformers writes it), in the state dict's order."""
    first = {keys[0] for keys in aliases(model, state)}
    return {key: value for key, value in state.items() if key in first}


_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _bytes(size: int | str) -> int:
    """``max_shard_size`` as transformers reads it: bytes, or a string such as ``"5GB"`` (10**9) or ``"2GiB"``."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"max_shard_size={size!r} is not a size; give bytes or a string such as '5GB' or '500MB'")


def _write_config(model: nn.Module, directory: Path) -> list[str]:
    """The files besides the weights that transformers' ``save_pretrained`` writes, as it writes them: the config
    (with the model's dtype and class), the generation config, and a remote-code model's source files."""
    from transformers.dynamic_module_utils import custom_object_save

    before = set(os.listdir(directory))
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    if model.is_remote_code():
        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    return sorted(set(os.listdir(directory)) - before)


def _finish(model: nn.Module, partial: Path, directory: Path, files: list[_OutputFile]) -> None:
    """Rank 0: add the index (several files), config and generation config, and move them into ``directory``;
    then delete the earlier save's weight files that were not overwritten."""
    names = [file.name for file in files]
    if len(files) > 1:
        weight_map = {tensor: file.name for file in files for tensor in file.starts}
        total = sum(file.size - len(file.header) for file in files)
        (partial / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2, sort_keys=True) + "\n")
        names.append(INDEX_FILE)
    names += _write_config(model, partial)
    directory.mkdir(parents=True, exist_ok=True)
    for name in sorted(names, key=lambda n: n == INDEX_FILE):
        os.replace(partial / name, directory / name)
    shutil.rmtree(partial)
    for stale in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        if stale.name not in names and stale.exists():
            stale.unlink()
