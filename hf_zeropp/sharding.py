"""shard_model: ZeRO stages 0-3 on torch FSDP2, with hf_zeropp's metered (and, for ZeRO++, quantized) comms.

How each stage maps onto FSDP2 (docs/design.md, "How the stages map onto FSDP2", explains where this differs from
DeepSpeed):

* stage 3 — every unit reshards after forward: one all-gather in forward, one in backward, one reduce-scatter.
* stage 2 — units keep their gathered weights from forward through backward: one all-gather, one reduce-scatter
  per micro-batch; gradients and optimizer state are sharded.
* stage 1 — as stage 2, and inside :func:`no_sync` (the non-final micro-batches of an accumulation) gradients
  accumulate unsharded and weights stay gathered: one all-gather and one reduce-scatter per optimizer step.
* stage 0 — plain data parallel for baselines: FSDP2 on a ``(world, 1)`` mesh, i.e. replicated weights and an
  all-reduce of gradients.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._compat import (
    apply_activation_checkpointing,
    fsdp_param_groups,
    group_gathered_bytes,
    group_parameters,
    no_split_modules,
    set_unshard_async_op,
)
from .comm_meter import CommMeter, in_backward
from .config import ZeroPPConfig
from .frozen import held_weight_bytes, quantize_frozen_weights
from .full_state import consolidate, consolidated_state_dict, holds_dtensors, is_loading_full_state, load_full_state_dict
from .hpz import reshard_all, set_hpz, shared_hpz_mesh
from .inference import route_generate
from .materialize import RANK0, REAL, agree_on_layout, fill_shards, frozen_weight_source
from .qgz import make_reduce_scatter
from .qwz import make_all_gather
from .topology import Topology, get_topology

_DTYPES = {"no": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ZeroPPState:
    """What shard_model attaches to the model (``model._zeropp``)."""

    config: ZeroPPConfig
    topology: Topology
    meter: CommMeter
    units: list[nn.Module]
    all_gathers: list = field(default_factory=list)
    reduce_scatters: list = field(default_factory=list)
    hpz_enabled: bool = False
    inference_depth: int = 0  # open gathered_for_inference blocks


def shard_model(model: nn.Module, config: ZeroPPConfig | str | os.PathLike | dict | None = None,
                *, device: torch.device | str | None = None, runs_schedule: bool = False,
                frozen: bool = False) -> nn.Module:
    """Shard ``model`` in place with ZeRO ``config.stage`` (+ ZeRO++ options) and return it.

    ``config`` is anything :meth:`ZeroPPConfig.coerce` takes: a :class:`ZeroPPConfig`, a preset name
    (``"zeropp"``), a YAML/JSON path, a dict, or None for ``ZEROPP_*`` environment variables. Build the optimizer
    *after* this call, on ``model.parameters()``: the parameters are then this rank's shards, so optimizer state is
    sharded by construction. Every check runs before the first collective.

    A config with a schedule (``quantized_weights_until``, ``hpz_until``, ``quantized_gradients_until``) is refused:
    only the Trainer integration, which passes ``runs_schedule=True``, applies it; elsewhere call
    :func:`set_techniques` at the point the schedule names.

    The model may hold real weights on every rank, be built on the meta device on every rank (the model's own
    init fills only this rank's shards), or hold real weights on rank 0 only (:func:`hf_zeropp.from_pretrained`;
    rank 0 sends them): see :mod:`hf_zeropp.materialize`.

    ``frozen=True`` is for a model that is only evaluated — an RLHF reference or reward model: every parameter is
    frozen (``requires_grad_(False)``; train/eval mode is left to the caller) before sharding, so the model holds
    no gradients or optimizer state, and with ``quantized_nontrainable_weights`` its matrices are stored INT8
    (their gathers inside the node with hpZ). Its root unit reshards after every forward like the others (a
    trained model's root stays gathered until backward, as stock FSDP2's does; a frozen one has no backward).
    """
    config = ZeroPPConfig.coerce(config)
    if not runs_schedule:
        config.refuse_schedule("shard_model")
    if getattr(model, "_zeropp", None) is not None:
        raise ValueError("this model is already sharded by hf_zeropp; call shard_model once per model")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed initialised: launch with torchrun or accelerate launch, "
            "or call torch.distributed.init_process_group first"
        )
    device = torch.device(device) if device is not None else _default_device()
    topology = get_topology(config, device.type)  # launch checks (node and hpZ sizes); builds no group yet
    has_blocks = bool(_blocks(model, config.wrap_modules))  # a wrap_modules that matches nothing fails here
    if frozen:  # after the checks: a refused call leaves the model as it was
        model.requires_grad_(False)
    # all ranks build every group now, in order
    _ = topology.world_mesh, topology.node_mesh, topology.hpz_mesh, topology.control_group
    meter = CommMeter(topology)
    original_class = type(model)
    layout = agree_on_layout(model, topology)
    before = dict(model.named_parameters())
    rank0_state = model.state_dict() if layout == RANK0 and topology.rank == 0 else {}  # references, not copies
    if layout == REAL:
        if device.type != "cpu" or any(p.device.type != device.type for p in model.parameters()):
            model.to(device)
        _make_initial_state_equal(model, topology)
    if config.quantized_nontrainable_weights:
        quantize_frozen_weights(model, topology, meter, config.weight_bits, config.block_size,
                                _DTYPES[config.mixed_precision], frozen_weight_source(layout, topology),
                                backend=config.kernel_backend)
    units = _units(model, config.wrap_modules)
    if config.activation_checkpointing:
        _enable_activation_checkpointing(model, units)

    mp_policy = MixedPrecisionPolicy(
        param_dtype=_DTYPES[config.mixed_precision],
        reduce_dtype=_DTYPES[config.reduce_dtype],
    )
    if config.stage == 0:
        replicated = _mesh_for_replication(topology)
        for unit in [*units, model]:
            fully_shard(unit, mesh=replicated, reshard_after_forward=False, mp_policy=mp_policy)
    else:
        reshard: bool | int = config.stage == 3
        if config.stage == 3 and topology.hpz_size > 1:
            reshard = topology.hpz_size
        with shared_hpz_mesh(topology):
            for unit in units:
                fully_shard(unit, mesh=topology.world_mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
            # the root keeps its weights gathered from forward to backward, as stock FSDP2's root does: backward
            # starts with it, so resharding would only gather the same weights again (the tied embedding, mostly).
            # A frozen model has no backward: it would hold its root gathered from one forward to the next
            root_reshard = reshard if frozen else False
            fully_shard(model, mesh=topology.world_mesh, reshard_after_forward=root_reshard, mp_policy=mp_policy)
        if device.type == "cpu":
            _prefetch_gathers(model, units)
    # named as the original class from here on (transformers judges by the class's module whether a model is its own
    # code, which decides how its init treats modules without parameters)
    model.__class__ = _zeropp_class(type(model), original_class)
    fill_shards(model, layout, rank0_state, topology, device)
    del rank0_state  # rank 0's full copy goes now

    if callable(getattr(model, "generate", None)):
        # generate() calls forward without the root module's __call__: let FSDP gather the root's weights for it
        register_fsdp_forward_method(model, "generate")
        route_generate(model, config.generation_gather)
    _remember_replaced_parameters(before, dict(model.named_parameters()))
    _install_optimizer_hooks()
    for param in model.parameters():  # lets an optimizer step find the model whose gathered copies it makes stale
        param._zeropp_model = weakref.ref(model)
    state = ZeroPPState(config, topology, meter, units, hpz_enabled=topology.hpz_mesh is not None)
    _install_comms(model, state)
    model._zeropp = state
    _report_techniques_that_cannot_apply(state)
    _report_width_format_without_kernel(state)
    _report_whole_model_as_one_unit(model, state, has_blocks)
    return model


def _make_initial_state_equal(model: nn.Module, topology: Topology) -> None:
    """Give every rank rank 0's parameters and buffers if the ranks built different ones, as DDP does.

    A script that seeds per rank or not at all builds different random weights on every rank; FSDP2 would shard
    each rank's own (stage 1-3 would train a mixture of the ranks' inits, stage 0 replicas that never agree). A
    checksum per tensor (sum and sum of squares, float64) is compared first, so the broadcast of the whole model
    only happens when they differ."""
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors or topology.world_size == 1:
        return
    with torch.no_grad():
        mine = torch.stack([torch.stack((t.double().sum(), t.double().square().sum())) for t in tensors]).view(-1)
        mine = mine.to(topology.device_type)
        everyone = [torch.empty_like(mine) for _ in range(topology.world_size)]
        dist.all_gather(everyone, mine)
        if all(torch.equal(everyone[0].cpu(), other.cpu()) for other in everyone[1:]):
            return
        if topology.rank == 0:
            warnings.warn("the ranks built different initial weights (per-rank or no seeding); hf_zeropp gives "
                          "every rank rank 0's parameters and buffers, as DDP does", stacklevel=3)
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def _report_techniques_that_cannot_apply(state: ZeroPPState) -> None:
    """Warn once (rank 0) about every requested technique this launch cannot apply, and say so in comm_stats."""
    config, topology = state.config, state.topology
    where = (f"all {topology.world_size} ranks are on one node (node size {topology.node_size} from "
             f"{topology.node_size_source})")
    reasons = {}
    if config.quantized_weights and topology.nodes == 1 and not config.quantize_hpz_gather:
        reasons["quantized_weights"] = f"qwZ quantizes only gathers that cross nodes, and {where}"
    if config.stage == 3 and config.hpz_partition_size != 1 and not state.hpz_enabled:
        reasons["hpz"] = (f"hpZ's secondary shard would span the whole world: {where}" if topology.nodes == 1
                          else "hpz_partition_size resolves to 1 rank per group")
    if config.quantized_gradients and topology.nodes == 1:
        for option in ("gradient_bit_allocation", "gradient_error_feedback"):
            if getattr(config, option):
                reasons[option] = f"it acts on qgZ's inter-node hop, and {where}"
    elif config.quantized_gradients and config.gradient_error_feedback and topology.node_size == 1:
        reasons["gradient_error_feedback"] = ("it compensates the requantization between qgZ's two hops, and with one "
                                              "rank per node there is a single hop")
    for technique, reason in reasons.items():
        state.meter.conditions[technique] = f"not applied: {reason}"
        if topology.rank == 0:
            warnings.warn(f"hf_zeropp: {technique} was requested but is not applied: {reason}. Set node_size (or "
                          f"ZEROPP_NODE_SIZE) if the launcher's node size is wrong", stacklevel=3)


def _report_width_format_without_kernel(state: ZeroPPState) -> None:
    """Warn once (rank 0) when qgZ's per-block widths will run as their plain-torch specification because the
    device has no compiled kernel for them (the CPU has one; CUDA has none yet): the same format, slower, and a user
    who chose the compiled kernels would not otherwise learn that this hop does not use them. comm_stats shows
    it in qgZ's implementation line ("plain torch")."""
    config, topology = state.config, state.topology
    if not (config.quantized_gradients and config.gradient_bit_allocation and topology.nodes > 1):
        return
    if topology.device_type == "cpu" or config.kernel_backend == "reference":
        return
    if topology.rank == 0:
        warnings.warn(f"hf_zeropp: gradient_bit_allocation runs its plain-torch specification on "
                      f"{topology.device_type}: the per-block width format has a compiled kernel for CPU only, so "
                      f"qgZ's inter-node hop is slower than with the fixed format (same bytes, same format). Set "
                      f"gradient_bit_allocation: false to keep every qgZ step in the fused kernels", stacklevel=3)


def _report_whole_model_as_one_unit(model: nn.Module, state: ZeroPPState, has_blocks: bool) -> None:
    """Warn once (rank 0) when no layer became an FSDP unit of its own: the model lists no ``_no_split_modules``
    (or ones it does not contain) and ``wrap_modules`` names none. Training is still correct, but the layers form one
    unit: stage 3 gathers every weight at once (the full model per rank at peak, ZeRO-3's memory saving gone) and no
    gather overlaps compute. The fix is one option, and the layer class is usually the element type of the model's
    largest ``nn.ModuleList``, so the message names it. comm_stats shows it under ``fsdp_units``."""
    config, topology = state.config, state.topology
    if config.stage == 0 or has_blocks:
        return
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    layer = type(max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))[0]).__name__ if lists else None
    fix = f"wrap_modules=[{layer!r}]" if layer else "wrap_modules=[<the class name of its layers>]"
    listed = no_split_modules(model)
    source = (f"wrap_modules={config.wrap_modules} names no layer class" if config.wrap_modules is not None
              else f"{type(model).__name__}'s _no_split_modules {listed} match none of its modules" if listed
              else f"{type(model).__name__} lists no _no_split_modules")
    reason = (f"{source}, so no layer is an FSDP unit of its own: every forward gathers all of the layers' weights "
              f"at once and no gather overlaps compute")
    state.meter.conditions["fsdp_units"] = f"one unit: {reason}; set {fix}"
    if topology.rank == 0:
        warnings.warn(f"hf_zeropp: {reason}. Set {fix} in ZeroPPConfig to shard it layer by layer",
                      stacklevel=3)


class ZeroPPModule:
    """Put in front of FSDP2's ``FSDP<Name>`` class of every model that :func:`shard_model` returns, so that the stock
    calls users make on a model keep their meaning under sharding (both are collectives: call them on every rank):

    * ``load_state_dict`` with full tensors (a ``from_pretrained`` file, the Trainer's ``load_best_model_at_end``,
      peft's ``load_adapter``) loads them into the shards; a sharded (DTensor) state dict loads as in FSDP2;
    * ``save_pretrained`` without a ``state_dict``, or with a sharded one, writes the consolidated model from rank 0,
      loadable by plain transformers, and returns on every rank once it is written. Only rank 0 writes, also when
      given a full state dict: it alone holds the consolidated copy (``get_state_dict`` is empty elsewhere).
    """

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if is_loading_full_state(self) or holds_dtensors(state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return load_full_state_dict(self, state_dict, strict, zeropp_state(self).topology.control_group)

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any):
        base = super().save_pretrained
        named = _named_arguments(base, save_directory, *args, **kwargs)
        state_dict = named.get("state_dict")
        control_group = zeropp_state(self).topology.control_group
        collective = state_dict is None or holds_dtensors(state_dict)
        if state_dict is None:
            state_dict = consolidated_state_dict(self, control_group)
        elif holds_dtensors(state_dict):
            state_dict = consolidate(self, state_dict)
        result = base(**{**named, "state_dict": state_dict}) if dist.get_rank() == 0 else None
        if collective:  # every rank returns once the files exist, as when each wrote them (stock DDP)
            dist.barrier(group=control_group)
        return result


_ZEROPP_CLASSES: dict[type, type] = {}


def _zeropp_class(fsdp_class: type, original_class: type) -> type:
    """``ZeroPPModule`` + FSDP2's class, named as the original (``save_pretrained`` records the class name as the
    model's architecture, which plain transformers must find)."""
    if fsdp_class not in _ZEROPP_CLASSES:
        _ZEROPP_CLASSES[fsdp_class] = type(original_class.__name__, (ZeroPPModule, fsdp_class),
                                           {"__module__": original_class.__module__,
                                            "__qualname__": original_class.__qualname__})
    return _ZEROPP_CLASSES[fsdp_class]


def _named_arguments(method, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A call's arguments by parameter name, those that went through ``**kwargs`` included."""
    signature = inspect.signature(method)
    named = dict(signature.bind(*args, **kwargs).arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return named


# id(parameter before sharding) -> (weak reference to it, weak reference to the shard that replaced it, or None for
# a frozen weight now stored INT8): lets an optimizer built before sharding be pointed at the shards, and lets the
# optimizer-step guard below recognise one that was not.
_replaced: dict[int, tuple[weakref.ref, weakref.ref | None]] = {}


def _remember_replaced_parameters(before: dict[str, nn.Parameter], after: dict[str, nn.Parameter]) -> None:
    for name, old in before.items():
        new = after.get(name)
        if new is old:
            continue
        key = id(old)
        _replaced[key] = (weakref.ref(old, lambda _, key=key: _replaced.pop(key, None)),
                          weakref.ref(new) if new is not None else None)


def _replacement(param: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """(whether shard_model replaced ``param``, its replacement or None for a frozen weight stored INT8)."""
    entry = _replaced.get(id(param))
    if entry is None or entry[0]() is not param:
        return False, None
    return True, entry[1]() if entry[1] is not None else None


def rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer built on a model's parameters *before* :func:`shard_model` at the shards that replaced them,
    and drop the frozen weights now stored INT8 (they need no optimizer slot, and holding them would keep the full
    weights alive). Raises if the optimizer has already stepped: its state cannot be re-sharded."""
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            replaced, new = _replacement(param)
            if not replaced:
                params.append(param)
                continue
            if optimizer.state.get(param):
                raise ValueError("the optimizer has already taken a step on the unsharded model: its state cannot be "
                                 "re-sharded; build or prepare the optimizer before its first step")
            if new is not None:
                params.append(new)
        group["params"] = params


_hooks_installed = False


def _install_optimizer_hooks() -> None:
    """Two process-wide optimizer-step hooks, for the rules that keep a sharded model's weights right:

    * before a step, fail if the optimizer holds parameters shard_model replaced: they receive no gradients any
      more, so the step would silently train nothing (DDP keeps the parameters; FSDP2 and hf_zeropp do not);
    * after a step, drop the gathered weights and hpZ secondary shards of every model it updated. Normally there
      are none (backward reshards), but a no-grad forward between backward and step (an evaluation, generate(),
      a reward) leaves them, and the next forward would compute with the pre-step weights. Cost: nothing in the
      usual order; after such a forward, the next forward gathers again, as it must.
    """
    global _hooks_installed
    if _hooks_installed:
        return

    def refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not _replaced:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                replaced, new = _replacement(param)
                if replaced and new is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds parameters from before hf_zeropp sharded the model; they "
                        f"no longer receive gradients, so this step would train nothing. Build the optimizer after "
                        f"shard_model on model.parameters(), or pass it to accelerator.prepare (together with the "
                        f"model or in a later call), which points it at the shards"
                    )

    def drop_stale_copies(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if in_backward():  # an optimizer stepping inside backward: FSDP still needs its gathered weights
            return
        models = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                model = getattr(param, "_zeropp_model", lambda: None)()
                if model is not None:
                    models[id(model)] = model
        for model in models.values():
            reshard_all(model)

    register_optimizer_step_pre_hook(refuse_replaced_parameters)
    register_optimizer_step_post_hook(drop_stale_copies)
    _hooks_installed = True


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _units(model: nn.Module, wrap_modules: list[str] | None) -> list[nn.Module]:
    """The FSDP units below the root: transformer blocks, plus untied input embeddings and output head.

    Blocks come from ``wrap_modules`` or the model's ``_no_split_modules`` (transformers' list of layer classes
    that must stay whole). Tied embeddings stay with the root, so the shared weight lives in one unit.
    """
    blocks = _blocks(model, wrap_modules)
    units: list[nn.Module] = []
    embeddings = _call(model, "get_input_embeddings")
    head = _call(model, "get_output_embeddings")
    tied = embeddings is not None and head is not None and head.weight is embeddings.weight
    if not tied:
        units += [m for m in (embeddings, head) if m is not None and any(True for _ in m.parameters())]
    units += blocks
    inside_a_block = {id(m) for b in blocks for m in b.modules() if m is not b}
    return [u for u in units if id(u) not in inside_a_block]


def _blocks(model: nn.Module, wrap_modules: list[str] | None) -> list[nn.Module]:
    """The submodules whose class is named by ``wrap_modules`` or, without it, by ``_no_split_modules``."""
    names = wrap_modules if wrap_modules is not None else no_split_modules(model)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if wrap_modules and not blocks:
        raise ValueError(f"wrap_modules={wrap_modules} matches no submodule of {type(model).__name__}; "
                         f"use class names of its layers")
    return blocks


def _prefetch_gathers(model: nn.Module, units: list[nn.Module]) -> None:
    """Overlap the weight gathers with compute where collectives block the host (gloo on CPU).

    On CUDA, FSDP runs its gathers on a separate stream and the host runs ahead, so they overlap by themselves. On
    CPU a collective called without ``async_op`` blocks until its bytes have arrived, so FSDP is told to issue
    every gather asynchronously and, in forward, to start each unit's gather when the unit before it starts
    computing (backward prefetches one unit ahead by default). Units are chained in the order ``model.modules()``
    visits them, the execution order of transformers models; where it is not, a gather starts early and its
    weights are held longer, nothing else. A prefetched gather that no forward consumed is dropped by
    :func:`hf_zeropp.hpz.reshard_all`, so an optimizer step never leaves one holding old weights."""
    position = {id(module): index for index, module in enumerate(model.modules())}
    chain = [model, *sorted(units, key=lambda unit: position[id(unit)])]
    for current, following in zip(chain, chain[1:]):
        current.set_modules_to_forward_prefetch([following])
    set_unshard_async_op(model, True)


def _call(model: nn.Module, method: str) -> nn.Module | None:
    try:
        return getattr(model, method)() if hasattr(model, method) else None
    except NotImplementedError:
        return None


def _enable_activation_checkpointing(model: nn.Module, units: list[nn.Module]) -> None:
    if hasattr(model, "gradient_checkpointing_enable") and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    block_ids = {id(u) for u in units}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in block_ids)


def _mesh_for_replication(topology: Topology):
    from .topology import _mesh

    return _mesh(topology.device_type, (topology.world_size, 1), ("replicate", "shard"))


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _install_comms(model: nn.Module, state: ZeroPPState) -> None:
    """Give every FSDP unit hf_zeropp's all-gather and reduce-scatter, and make FSDP request plain SUMs."""
    for module in fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
        if state.config.stage == 0:
            module.set_all_reduce_hook(_allreduce_meter(state.meter, state.topology))
            continue
        all_gather = make_all_gather(state.config, state.topology, state.meter, module)
        reduce_scatter = make_reduce_scatter(state.config, state.topology, state.meter, module)
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        state.all_gathers.append(all_gather)
        state.reduce_scatters.append(reduce_scatter)


def _allreduce_meter(meter: CommMeter, topology: Topology):
    group = topology.world_mesh.get_group()

    def hook(reduced: torch.Tensor) -> None:
        meter.record_allreduce(group, reduced.numel() * reduced.element_size(), f"all_reduce {reduced.dtype}")

    return hook


def zeropp_state(model: nn.Module) -> ZeroPPState:
    state = getattr(model, "_zeropp", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} was not sharded by hf_zeropp.shard_model")
    return state


def comm_stats(model: nn.Module, reset: bool = False) -> dict[str, Any]:
    """Bytes this rank sent since the last reset, per collective kind, split into intra_node and inter_node.

    See :mod:`hf_zeropp.comm_meter` for the accounting rule. ``implementations`` lists, per kind, every distinct
    way it ran in this window (e.g. the 2-hop quantized all-to-all for the gradient reduce-scatter, with the kernel
    backend that ran), plus, per requested technique this launch cannot apply, why.
    """
    return zeropp_state(model).meter.stats(reset=reset)


def set_techniques(model: nn.Module, *, quantized_weights: bool | None = None, hpz: bool | None = None,
                   quantized_gradients: bool | None = None) -> dict[str, bool]:
    """Switch qwZ, hpZ and qgZ on or off between optimizer steps without re-wrapping the model (e.g. the ZeRO++
    paper's "qgZ for the first 50 % of training"). None leaves a technique as it is; returns what is on now.

    qwZ and qgZ can be switched on even if the model was sharded without them (stages 1-3); hpZ only if it was
    configured (``hpz_partition_size > 1``), since its process groups are built at sharding time.
    """
    state = zeropp_state(model)
    if state.config.stage == 0 and (quantized_weights or hpz or quantized_gradients):
        raise ValueError("stage 0 (plain data parallel) has no sharded collectives to quantize; use stage 3")
    if quantized_weights is not None:
        for comm in state.all_gathers:
            comm.enabled = quantized_weights
    if quantized_gradients is not None:
        for comm in state.reduce_scatters:
            comm.enabled = quantized_gradients
    if hpz is not None and hpz != state.hpz_enabled:
        set_hpz(model, state.topology, hpz)
        state.hpz_enabled = hpz
    return active_techniques(model)


def active_techniques(model: nn.Module) -> dict[str, bool]:
    """What is in effect now: a technique switched on that this launch cannot apply (qwZ with every rank on one
    node, where no gather crosses nodes) is reported off."""
    state = zeropp_state(model)
    return {
        "quantized_weights": any(c.enabled and c.applies() for c in state.all_gathers),
        "hpz": state.hpz_enabled,
        "quantized_gradients": any(c.enabled for c in state.reduce_scatters),
    }


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Micro-batches inside this context accumulate gradients for a later synchronising backward.

    Stage 0 skips the all-reduce and stage 1 the reduce-scatter (and keeps weights gathered); stages 2 and 3
    reduce-scatter every micro-batch as ZeRO-2/3 do, so their gradients stay sharded.
    """
    stage = zeropp_state(model).config.stage
    if stage not in (0, 1):
        yield
        return
    root = model
    root.set_requires_gradient_sync(False)
    if stage == 1:
        root.set_reshard_after_backward(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
        if stage == 1:
            root.set_reshard_after_backward(True)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded models: the norm of the full gradients (each rank's shards'
    norms combined over the ranks, per device mesh), returned as a plain tensor equal on every rank (collective)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(param)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    for mesh, group in by_mesh.items():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, DTensor.from_local(total, mesh) if mesh is not None else total)
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds at rest: parameter shards (INT8-stored frozen weights included), gradients and optimizer
    state. Gathered weights held beyond the shards are :func:`gathered_parameter_bytes`."""
    from .frozen import frozen_weight_bytes

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def size(t: torch.Tensor) -> int:
        return local(t).numel() * local(t).element_size()

    # FSDP's world-sharded parameters: between a forward and its backward (or after a no-grad forward) a unit's
    # registered parameters are its gathered or hpZ-sharded ones instead
    fsdp_params = [param for module in fsdp_modules(model) for group in fsdp_param_groups(module)
                   for param, _ in group_parameters(group)]
    shards = fsdp_params if fsdp_params else list(model.parameters())
    result = {
        "parameters": sum(size(t) for t in shards) + frozen_weight_bytes(model),
        "gradients": sum(size(t.grad) for t in shards if t.grad is not None),
        "optimizer_state": 0,
    }
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    result["optimizer_state"] += size(value)
    return result


def gathered_parameter_bytes(model: nn.Module) -> int:
    """Bytes of gathered weights this rank holds right now beyond its shards: full unsharded parameters of units
    that are not resharded, hpZ's post-forward (secondary) slices, and frozen INT8 weights held dequantized by
    :func:`hf_zeropp.gathered_for_inference`."""
    fsdp = sum(group_gathered_bytes(group) for module in fsdp_modules(model) for group in fsdp_param_groups(module))
    return fsdp + held_weight_bytes(model)


__all__ = ["active_techniques", "clip_grad_norm_", "comm_stats", "fsdp_modules", "gathered_parameter_bytes", "no_sync",
           "rebind_optimizer", "set_techniques", "shard_model", "state_bytes", "zeropp_state"]
