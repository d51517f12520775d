"""Models larger than one rank: shard_model on a model built on the meta device, or whose weights only rank 0 holds.

ZeRO-3 exists for models that do not fit on one device, yet a model built or loaded in full on every rank needs one
full copy per rank before it can be sharded. :func:`shard_model` tells three placements apart (one small all-gather of
what each rank holds) and takes a path for each:

* ``real`` — every rank holds real weights: shard them (the ranks are made equal first, as DDP does).
* ``meta`` — every rank built the model on the meta device (``torch.device("meta")``, accelerate's
  ``init_empty_weights``): FSDP2 shards the empty model, each rank allocates only its shards, and the model's own
  init fills them. Each FSDP unit in turn exists in full for the moment its modules are initialised, in the order
  the model initialises them (transformers' ``initialize_weights``; otherwise every module's ``reset_parameters``,
  children before their parent), and is then cut to this rank's shard — every rank draws the same random numbers,
  so the shards are exactly those of that init run on the full model. Peak: the root unit (embeddings, head,
  final norm) plus one block in full.
* ``checkpoint`` — every rank built the model on the meta device with :func:`from_pretrained`, which attached
  its safetensors folder: every rank allocates its shards and reads its own slices from the files
  (:mod:`hf_zeropp.interop.hf_checkpoint`). Peak: shards plus one slice being read, on every rank.
* ``rank0`` — rank 0 holds real weights, the others the same model on the meta device (what
  :func:`from_pretrained` builds when the files cannot be read in slices): the others allocate only their shards
  and rank 0 sends tensor by tensor (torch's ``set_model_state_dict(..., broadcast_from_rank0=True)``). Peak: one
  full copy on rank 0; shards plus the largest tensor elsewhere. Frozen weights stored INT8 are quantized from
  rank 0's real tensors as they arrive.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from .._compat import init_non_persistent_buffers, local_tensor, run_init_with_hooks
from .frozen import FrozenInt8Weight, FrozenWeightSource
from ..interop.hf_checkpoint import CheckpointSource, SafetensorsFolder, aliases, plan_reads, read_shards, weight_folder
from .skeleton import build_skeleton
from ..comm.topology import Topology

REAL, META, RANK0, CHECKPOINT = "real", "meta", "rank0", "checkpoint"


def agree_on_placement(model: nn.Module, topology: Topology) -> str:
    """``real``, ``meta`` or ``rank0`` (see the module docstring), the same answer on every rank (collective).

    Any other combination fails on every rank with the same message, before FSDP's collectives start."""
    params = dict(model.named_parameters())
    on_meta = [name for name, p in params.items() if p.is_meta]
    mine = META if params and len(on_meta) == len(params) else REAL if not on_meta else (
        f"partly on the meta device ({len(on_meta)} of {len(params)} parameters, e.g. {on_meta[0]})")
    if mine == META and CheckpointSource.of(model, torch.device("cpu")) is not None:
        mine = CHECKPOINT
    everyone = [None] * topology.world_size
    dist.all_gather_object(everyone, mine, group=topology.control_group)
    for placement in (REAL, META, CHECKPOINT):
        if all(each == placement for each in everyone):
            return placement
    if everyone[0] == REAL and all(placement == META for placement in everyone[1:]):
        return RANK0
    described = ", ".join(f"rank {rank}: {placement}" for rank, placement in enumerate(everyone))
    raise ValueError(
        f"shard_model needs the model's weights real on every rank, on the meta device on every rank (the model's "
        f"own init fills the shards), or real on rank 0 only (rank 0 sends them); got {described}. Build it with "
        f"hf_zeropp.from_pretrained(...) to load on rank 0 only, or under torch.device('meta') on every rank"
    )


def from_pretrained(model_class: Any, name_or_path: str | Any, *args: Any, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(name_or_path, ...)`` built on the meta device, its weights read when it is
    sharded: each rank reads only its own slices of the safetensors files.

    Pass the result to :func:`hf_zeropp.shard_model`, ``hf_zeropp.Accelerator.prepare`` or a ZeroPP trainer; no
    rank ever holds the whole model. Where the files cannot be read in slices (``.bin`` pickles, a checkpoint that
    lacks some of the model's tensors, buffers without an init), it warns and rank 0 loads the model and sends
    each rank its shards when the model is sharded. Without an initialised process group (one process) this is
    plain ``from_pretrained``. ``model_class`` is any transformers class with ``from_pretrained``
    (``AutoModelForCausalLM``, ``LlamaForCausalLM``...)."""
    return load_in_slices(model_class, model_class.from_pretrained, name_or_path, *args, **kwargs)


def load_in_slices(model_class: Any, load: Callable[..., nn.Module], name_or_path: str | Any, *args: Any,
                   **kwargs: Any) -> nn.Module:
    """:func:`from_pretrained`, with ``load`` (``model_class``'s stock ``from_pretrained``) loading where slices
    cannot be read. The empty model comes from :func:`hf_zeropp.engine.skeleton.build_skeleton`."""
    if not (dist.is_available() and dist.is_initialized()):
        return load(name_or_path, *args, **kwargs)
    if "device_map" in kwargs:
        raise ValueError("hf_zeropp.from_pretrained places the weights itself (each rank reads its shards when the "
                         f"model is sharded); drop device_map={kwargs['device_map']!r}")
    directory = weight_folder(name_or_path, kwargs)
    folder = SafetensorsFolder(directory) if directory is not None else None  # bad files fail here, on every rank
    model = build_skeleton(model_class, name_or_path, folder, *args, **kwargs)
    reason = _why_not_in_slices(model, folder, kwargs.get("ignore_mismatched_sizes", False))
    if reason is None:
        model._zeropp_checkpoint = folder
        return model
    warnings.warn(f"hf_zeropp.from_pretrained({str(name_or_path)!r}): {reason}, so rank 0 loads the whole model and "
                  f"sends each rank its shards when it is sharded (one full copy on rank 0)", stacklevel=3)
    failure: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            model = load(name_or_path, *args, **kwargs)
        except Exception as error:
            failure = [(type(error), str(error))]
            raise
        finally:  # the others learn whether rank 0 loaded, so a bad folder fails on every rank, not in a hang
            dist.broadcast_object_list(failure, src=0)
    else:
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:  # the same error as rank 0's, so every rank says the same
            kind, message = failure[0]
            raise (kind if issubclass(kind, (OSError, ValueError)) else RuntimeError)(message)
    model._zeropp_loaded_by = f"rank 0 ({reason})"
    return model


def attach_checkpoint(model: nn.Module, directory: str | os.PathLike) -> None:
    """Make the not yet sharded meta ``model`` (from :func:`from_pretrained`) read its shards from ``directory``
    instead (a resumed run's checkpoint); it must hold every tensor of the model, with the same shapes."""
    folder = SafetensorsFolder(directory)
    reason = _why_not_in_slices(model, folder, mismatch_allowed=False)
    if reason is not None:
        raise ValueError(f"cannot resume the weights from {directory}: {reason}")
    model._zeropp_checkpoint = folder


def _why_not_in_slices(model: nn.Module, folder: SafetensorsFolder | None, mismatch_allowed: bool) -> str | None:
    """Why the meta ``model`` cannot read its tensors from ``folder`` rank by rank, or None if it can (then its
    non-persistent buffers are real now). A tensor stored with another shape fails, unless ``mismatch_allowed``
    (transformers' ``ignore_mismatched_sizes``: it initialises such tensors)."""
    if folder is None:
        return "there are no safetensors files to read in slices"
    mismatched = folder.shape_errors({key: tuple(value.shape) for key, value in model.state_dict().items()})
    if mismatched and mismatch_allowed:
        return f"tensors are stored with other shapes ({mismatched[0]}; ignore_mismatched_sizes=True)"
    if mismatched:
        raise ValueError(f"{folder.directory} does not fit this model; tensors whose shapes differ: "
                         + "; ".join(mismatched[:5]) + ". Load it with the config it was saved with, or pass "
                         "ignore_mismatched_sizes=True to initialise those tensors instead")
    missing = []
    for keys in aliases(model, model.state_dict().keys()):
        if not any(key in folder.tensors for key in keys):
            missing.extend(keys)
    if missing:
        return (f"{folder.directory} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}), which "
                f"transformers initialises")
    unset = init_non_persistent_buffers(model)
    if unset:
        return f"buffers {', '.join(unset[:3])} are not saved and the model's init does not compute them"
    return None


def frozen_weight_source(model: nn.Module, placement: str, topology: Topology, device: torch.device,
                         rank0_state: dict[str, torch.Tensor]) -> FrozenWeightSource | None:
    """How ``quantize_frozen_weights`` gets the real values of a frozen weight under ``placement`` (None: the
    model holds them; ``rank0_state``: rank 0's state dict under ``rank0``)."""
    if placement == REAL:
        return None
    if placement == CHECKPOINT:
        return CheckpointSource.of(model, device)
    return _RefuseRandomInit(device) if placement == META else _FromRank0(topology, rank0_state)


class _RefuseRandomInit:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fill(self, name: str, store: FrozenInt8Weight) -> None:
        raise ValueError(
            "quantized_nontrainable_weights stores frozen weights INT8 from their real values, but this model "
            "was built on the meta device on every rank (random init): load pretrained weights instead "
            "(hf_zeropp.from_pretrained), or unfreeze the model"
        )


class _FromRank0:
    """Rank 0's real weight, broadcast whole; every rank quantizes its part."""

    def __init__(self, topology: Topology, rank0_state: dict[str, torch.Tensor]) -> None:
        self.topology, self.device, self.values = topology, torch.device(topology.device_type), rank0_state

    def fill(self, name: str, store: FrozenInt8Weight) -> None:
        weight = self.values[name] if self.topology.rank == 0 else None
        values = (weight.detach().to(self.device) if weight is not None
                  else torch.empty(store.shape, dtype=store.dtype, device=self.device))
        dist.broadcast(values, src=0, group=self.topology.world_mesh.get_group())
        store.load_(values)


def fill_shards(model: nn.Module, placement: str, rank0_state: dict[str, torch.Tensor], topology: Topology,
                device: torch.device) -> None:
    """Give the shards of the just-sharded ``model`` their values under ``placement`` (``real``: they have them)."""
    if placement == REAL:
        return
    allocated = _allocate_shards(model, device) if placement != RANK0 or topology.rank != 0 else []
    if placement == META:
        initialize_from_meta(model, allocated)
    elif placement == CHECKPOINT:  # adapters first: building one's unit in full overwrites the unit's shards
        source = CheckpointSource.of(model, device)
        reads = plan_reads(model, source)
        initialize_adapters(model, reads.not_stored, topology.control_group)
        read_shards(model, source, reads)
    else:
        load_from_rank0(model, rank0_state, topology)


def _allocate_shards(model: nn.Module, device: torch.device) -> list[tuple[nn.Module, str]]:
    """Give every meta parameter and buffer of the (already sharded) ``model`` uninitialised memory on ``device``;
    returns the buffer slots that were on the meta device.

    FSDP2 allocates only this rank's shard of each parameter. Buffers that are already real (accelerate's
    ``init_empty_weights`` keeps them) keep their values."""
    slots = [(module, name, buffer) for module in model.modules()
             for name, buffer in module._buffers.items() if buffer is not None]
    model.to_empty(device=device)
    for module, name, buffer in slots:
        if not buffer.is_meta:
            module._buffers[name] = buffer.to(device)
    return [(module, name) for module, name, buffer in slots if buffer.is_meta]


def load_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor], topology: Topology) -> None:
    """Rank 0's ``full_state`` (its model's state dict, captured before sharding) into every rank's shards, one
    tensor at a time; then the buffers no state dict holds (non-persistent ones, e.g. rotary frequencies)."""
    keys = set(model.state_dict().keys())
    if topology.rank == 0:
        full_state = {key: value for key, value in full_state.items() if key in keys}
    set_model_state_dict(model, full_state if topology.rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    group = topology.world_mesh.get_group()
    for name, buffer in model.named_buffers():
        if name not in keys:
            dist.broadcast(buffer, src=0, group=group)


def loading_description(model: nn.Module, placement: str) -> str | None:
    """How the shards of a model under ``placement`` get their values (``comm_stats()["implementations"]``)."""
    if placement == CHECKPOINT:
        return f"each rank reads its own slices of {CheckpointSource.of(model, torch.device('cpu')).folder.directory}"
    if placement == RANK0:
        return "rank 0 loads the whole model and sends the shards" + (
            f": {getattr(model, '_zeropp_loaded_by', '')}" if hasattr(model, "_zeropp_loaded_by") else "")
    return None


def initialize_adapters(model: nn.Module, names: list[str], control_group: dist.ProcessGroup) -> None:
    """Give the sharded parameters ``names``, which a wrapper added to a model loaded on the meta device (peft's
    LoRA adapters), their own init: each unit holding some is built in full for a moment on every rank, the
    adapters' layers initialised from one seed (rank 0's) in that full unit, and the unit cut to this rank's shards.

    Parameters that are not an adapter's fail: nothing could give them values."""
    if not names:
        return
    layers = {}
    for name in names:
        layer = _adapter_layer(model, name)
        if layer is None:
            raise ValueError(f"{name} is neither in the checkpoint nor an adapter's parameter (peft's lora_*): "
                             f"nothing gives it a value; load the model in full (device_map=None) or add that "
                             f"module after sharding")
        layers[id(layer)] = layer
    seed = [torch.randint(0, 2**62, ()).item() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(seed, src=0, group=control_group)
    units = {id(m): m for m in model.modules() if isinstance(m, FSDPModule)}
    owners = _owning_units(model, units)
    by_unit: dict[int, list[nn.Module]] = {}
    for layer in layers.values():
        by_unit.setdefault(id(owners[id(layer)]), []).append(layer)
    peft_config = getattr(model, "peft_config", {})
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed[0])
        for unit_layers in by_unit.values():
            unit = owners[id(unit_layers[0])]
            slots: dict[tuple[int, str], DTensor] = {}
            _materialize(unit, units, slots)
            for layer in unit_layers:
                for adapter in layer.lora_A:
                    config = peft_config.get(adapter)
                    layer.reset_lora_parameters(adapter, getattr(config, "init_lora_weights", True))
            _cut(unit, units, slots, {})


def _adapter_layer(model: nn.Module, name: str) -> nn.Module | None:
    """The peft LoRA layer whose adapter ``name`` belongs to (``...q_proj.lora_A.default.weight``), if any."""
    path = name.split(".")
    for end in range(len(path) - 1, 0, -1):
        if path[end].startswith("lora_"):
            layer = model.get_submodule(".".join(path[:end]))
            return layer if callable(getattr(layer, "reset_lora_parameters", None)) else None
    return None


def initialize_from_meta(model: nn.Module, allocated_buffers: list[tuple[nn.Module, str]]) -> None:
    """Fill the shards of a model built on the meta device with its own init, unit by unit (module docstring).

    Raises if the init changed a unit's shards after that unit was cut (an init that reaches into other modules'
    weights from a module above them), or left one of ``allocated_buffers`` (those that were on the meta device)
    unset: either would leave values no eager init gives."""
    units = {id(m): m for m in model.modules() if isinstance(m, FSDPModule)}
    owners = _owning_units(model, units)
    sharded_slots: dict[tuple[int, str], DTensor] = {}  # (id(module), name) -> its sharded parameter, while full
    materialized: set[int] = set()
    cut: dict[int, int] = {}  # id(sharded parameter) -> version of its local shard when it was cut
    buffers = [(module, name, module._buffers[name], module._buffers[name]._version)
               for module, name in allocated_buffers]
    # a parameter FSDP2 does not manage is written whole by the init: it must have been written
    whole = {id(p): p._version for p in model.parameters() if not isinstance(p, DTensor)}

    def before(module: nn.Module) -> None:
        unit = owners[id(module)]
        if id(unit) not in materialized:
            materialized.add(id(unit))
            _materialize(unit, units, sharded_slots)

    def after(module: nn.Module) -> None:
        if id(module) in units and id(module) in materialized:
            _cut(module, units, sharded_slots, cut)

    with torch.no_grad():
        _run_own_init(model, before, after)
        after(model)  # transformers visits the root last; make sure it is cut whatever the init did

    changed = [name for name, p in model.named_parameters()
               if (p._version == whole[id(p)] if id(p) in whole else _local(p)._version != cut.get(id(p)))]
    if changed:
        raise RuntimeError(f"the model's init changed {changed[:3]} after their FSDP unit was initialised (an init "
                           f"of an outer module writes into an inner block's weights), or never initialised them; "
                           f"initialise this model eagerly on every rank, or load pretrained weights with "
                           f"hf_zeropp.from_pretrained")
    unset = [name for module, name, b, version in buffers if module._buffers.get(name) is b and b._version == version]
    if unset:
        raise RuntimeError(f"buffers {unset[:3]} were on the meta device and the model's init did not set them; "
                           f"build the model with real buffers (accelerate's init_empty_weights() keeps them on "
                           f"the CPU) or make its init set them")


def _run_own_init(model: nn.Module, before: Callable, after: Callable) -> None:
    """Run the model's own init, calling ``before(module)`` / ``after(module)`` around each module's turn."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        # transformers' own traversal (children first, each sub-model with its own _init_weights), with every
        # model's per-module hook wrapped
        run_init_with_hooks(model, before, after)
        return
    # torch's convention: every module's reset_parameters, children before their parent (so that a unit is cut as
    # soon as its last module is done); for modules built in the order they are registered, the order
    # construction draws random numbers in
    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        before(module)
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        after(module)

    visit(model)


def _owning_units(model: nn.Module, units: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """Each module -> the innermost FSDP unit at or above it (whose parameter group holds its parameters)."""
    owners: dict[int, nn.Module] = {}

    def walk(module: nn.Module, unit: nn.Module) -> None:
        unit = module if id(module) in units else unit
        owners[id(module)] = unit
        for child in module.children():
            walk(child, unit)

    walk(model, model)
    return owners


def _managed(unit: nn.Module, units: dict[int, nn.Module]) -> Iterator[tuple[nn.Module, str]]:
    """(module, name) of every parameter slot the unit's FSDP group manages: its subtree minus nested units."""
    def walk(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name
        for child in module.children():
            if id(child) not in units:
                yield from walk(child)

    yield from walk(unit)


def _materialize(unit: nn.Module, units: dict[int, nn.Module], sharded_slots: dict[tuple[int, str], DTensor]) -> None:
    """Swap the unit's sharded parameters for full, uninitialised ones (a shared parameter stays shared). Those
    FSDP2 left unmanaged (plain tensors, :mod:`hf_zeropp.comm.replicated`) are whole already: the init writes them."""
    full: dict[int, nn.Parameter] = {}
    for module, name in list(_managed(unit, units)):
        sharded = module._parameters[name]
        if not isinstance(sharded, DTensor):
            continue
        if id(sharded) not in full:
            full[id(sharded)] = nn.Parameter(torch.empty(sharded.shape, dtype=sharded.dtype,
                                                         device=_local(sharded).device),
                                             requires_grad=sharded.requires_grad)
        sharded_slots[(id(module), name)] = sharded
        module._parameters[name] = full[id(sharded)]


def _cut(unit: nn.Module, units: dict[int, nn.Module], sharded_slots: dict[tuple[int, str], DTensor],
         cut: dict[int, int]) -> None:
    """Copy this rank's shard of each full parameter into the sharded one and put the sharded ones back."""
    for module, name in list(_managed(unit, units)):
        sharded = sharded_slots.pop((id(module), name), None)
        if sharded is None:
            continue
        if id(sharded) not in cut:
            values = module._parameters[name].detach()
            piece = distribute_tensor(values, sharded.device_mesh, sharded.placements, src_data_rank=None)
            _local(sharded).copy_(piece.to_local())
            cut[id(sharded)] = _local(sharded)._version
        module._parameters[name] = sharded


def _local(param: torch.Tensor) -> torch.Tensor:
    return local_tensor(param)
