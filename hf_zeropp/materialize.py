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
* ``rank0`` — rank 0 holds real weights (``from_pretrained``), the others the same model on the meta device
  (:func:`from_pretrained` builds both): the others allocate only their shards and rank 0 sends tensor by tensor
  (torch's ``set_model_state_dict(..., broadcast_from_rank0=True)``). Peak: one full copy on rank 0; shards plus
  the largest tensor elsewhere. Frozen weights stored INT8 are quantized from rank 0's real tensors as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from ._compat import local_tensor, run_init_with_hooks
from .topology import Topology

REAL, META, RANK0 = "real", "meta", "rank0"


def agree_on_placement(model: nn.Module, topology: Topology) -> str:
    """``real``, ``meta`` or ``rank0`` (see the module docstring), the same answer on every rank (collective).

    Any other combination fails on every rank with the same message, before FSDP's collectives start."""
    params = dict(model.named_parameters())
    on_meta = [name for name, p in params.items() if p.is_meta]
    mine = META if params and len(on_meta) == len(params) else REAL if not on_meta else (
        f"partly on the meta device ({len(on_meta)} of {len(params)} parameters, e.g. {on_meta[0]})")
    everyone = [None] * topology.world_size
    dist.all_gather_object(everyone, mine, group=topology.control_group)
    if all(placement == REAL for placement in everyone):
        return REAL
    if all(placement == META for placement in everyone):
        return META
    if everyone[0] == REAL and all(placement == META for placement in everyone[1:]):
        return RANK0
    described = ", ".join(f"rank {rank}: {placement}" for rank, placement in enumerate(everyone))
    raise ValueError(
        f"shard_model needs the model's weights real on every rank, on the meta device on every rank (the model's "
        f"own init fills the shards), or real on rank 0 only (rank 0 sends them); got {described}. Build it with "
        f"hf_zeropp.from_pretrained(...) to load on rank 0 only, or under torch.device('meta') on every rank"
    )


def from_pretrained(model_class: Any, name_or_path: str | Any, *args: Any, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(name_or_path, ...)`` on rank 0, the same model on the meta device elsewhere.

    Pass the result to :func:`hf_zeropp.shard_model`, ``hf_zeropp.Accelerator.prepare`` or a ZeroPP trainer: rank
    0's weights are sent to the other ranks' shards, so one full copy exists on the node, not one per rank. Without
    an initialised process group (one process) this is plain ``from_pretrained``. ``model_class`` is any
    transformers class with ``from_pretrained`` (``AutoModelForCausalLM``, ``LlamaForCausalLM``...)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        if "device_map" in kwargs:
            raise ValueError("hf_zeropp.from_pretrained places the weights itself (rank 0: CPU, others: meta); "
                             f"drop device_map={kwargs['device_map']!r}")
        kwargs["device_map"] = "meta"
    return model_class.from_pretrained(name_or_path, *args, **kwargs)


def frozen_weight_source(placement: str, topology: Topology) -> Callable[[torch.Tensor], torch.Tensor]:
    """How ``quantize_frozen_weights`` gets the real values of a frozen weight under ``placement``."""
    if placement == REAL:
        return lambda weight: weight
    if placement == META:
        def refuse(weight: torch.Tensor) -> torch.Tensor:
            raise ValueError(
                "quantized_nontrainable_weights stores frozen weights INT8 from their real values, but this model "
                "was built on the meta device on every rank (random init): load pretrained weights instead "
                "(hf_zeropp.from_pretrained loads them on rank 0 only), or unfreeze the model"
            )
        return refuse
    group = topology.world_mesh.get_group()

    def from_rank0(weight: torch.Tensor) -> torch.Tensor:
        values = (weight.detach().to(topology.device_type) if topology.rank == 0
                  else torch.empty(weight.shape, dtype=weight.dtype, device=topology.device_type))
        dist.broadcast(values, src=0, group=group)
        return values

    return from_rank0


def fill_shards(model: nn.Module, placement: str, rank0_state: dict[str, torch.Tensor], topology: Topology,
                device: torch.device) -> None:
    """Give the shards of the just-sharded ``model`` their values under ``placement`` (``real``: they have them)."""
    if placement == REAL:
        return
    allocated = _allocate_shards(model, device) if placement == META or topology.rank != 0 else []
    if placement == META:
        initialize_from_meta(model, allocated)
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

    changed = [name for name, p in model.named_parameters() if _local(p)._version != cut.get(id(p))]
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
    """Swap the unit's sharded parameters for full, uninitialised ones (a shared parameter stays shared)."""
    full: dict[int, nn.Parameter] = {}
    for module, name in list(_managed(unit, units)):
        sharded = module._parameters[name]
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
