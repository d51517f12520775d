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

import inspect
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)

from .._compat import apply_activation_checkpointing, no_split_modules
from .auto import choose as choose_configuration
from .auto_trial import start_trial
from ..comm.comm_meter import CommMeter
from .compile import seeing_through_compile
from ..config.config import ZeroPPConfig
from ..interop.deepspeed.training import refuse_training_loop
from .frozen import quantize_frozen_weights
from .full_state import (consolidate, consolidated_state_dict, expect_every_rank, holds_dtensors, is_loading_full_state,
                         load_full_state_dict)
from ..interop.hf_checkpoint import MAX_SHARD_SIZE, write_pretrained, writes_per_rank
from ..comm.hpz import shared_hpz_mesh
from ..comm.hybrid import check_hybrid_fits, install_hybrid_all_reduce
from .inference import route_generate
from .live_weights import persistent_parameters, prefetch_gathers, resolve_hidden_size_auto, units_kept_gathered
from .materialize import RANK0, REAL, agree_on_placement, fill_shards, frozen_weight_source, loading_description
from .optimizer_hooks import watch_parameters
from ..comm.qgz import make_reduce_scatter
from ..comm.weight_deltas import make_all_gather
from ..comm.replicated import ReplicatedParameters
from .reports import report_what_will_not_run_as_asked
from .state import ZeroPPState, attach, fsdp_modules, zeropp_state
from .unused_parameters import UnusedParameters
from ..comm.topology import Topology, get_topology

_DTYPES = {"no": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@seeing_through_compile
def shard_model(model: nn.Module, config: ZeroPPConfig | str | os.PathLike | dict | None = None,
                *, device: torch.device | str | None = None, runs_schedule: bool = False,
                frozen: bool = False) -> nn.Module:
    """Shard ``model`` in place with ZeRO ``config.stage`` (+ ZeRO++ options) and return it (a ``torch.compile``
    wrapper as it came); build the optimizer afterwards, on ``model.parameters()``. ``config`` is anything
    :meth:`ZeroPPConfig.coerce` takes. Every check runs before the first collective. The model may be real on every
    rank, on meta on every rank, or real on rank 0 only (:mod:`hf_zeropp.engine.materialize`). A ``*_until`` schedule
    needs ``runs_schedule`` (the Trainer applies it); ``frozen=True`` (an RLHF reference or reward model) freezes every
    parameter first. ``shard_group: auto`` on several nodes shards at the first forward, after its trial
    (:mod:`hf_zeropp.engine.auto_trial`). The steps, in order: docs/api.md, ``shard_model``."""
    config = resolve_hidden_size_auto(model, ZeroPPConfig.coerce(config))
    topology, device, has_blocks = _check_before_any_collective(model, config, device, runs_schedule)
    if frozen:  # after the checks: a refused call leaves the model as it was
        model.requires_grad_(False)
    meter = None
    if config.shard_group == "auto":  # probe the links; shard as the chosen preset, or at the first forward's trial
        chosen = _choose(model, config, topology, device, runs_schedule, frozen)
        if chosen is None:
            return model
        config, topology, device, has_blocks, meter = chosen
    meter = meter or CommMeter(topology)
    original_class, before = type(model), dict(model.named_parameters())
    placement, rank0_state = _place_weights(model, config, topology, device, meter)
    replicated = _replicated_parameters(model, config, topology, meter)
    units = _apply_fsdp_units(model, config, topology, device, frozen, replicated.ignored, meter)
    model.__class__ = _zeropp_class(type(model), original_class)
    fill_shards(model, placement, rank0_state, topology, device)
    del rank0_state  # rank 0's full copy goes now
    replicated.start(model)
    _route_generation(model, config)
    watch_parameters(model, before)
    state = ZeroPPState(config, topology, meter, units, hpz_enabled=topology.hpz_mesh is not None,
                        replicated=replicated)
    _install_comms(model, state)
    UnusedParameters(model, topology, meter)  # kept alive by the hooks it puts on FSDP2's parameter groups
    attach(model, state)
    report_what_will_not_run_as_asked(model, state, has_blocks)
    return model


def _replicated_parameters(model: nn.Module, config: ZeroPPConfig, topology: Topology,
                           meter: CommMeter) -> ReplicatedParameters:
    """Those ``fully_shard`` refuses (0-d, empty) and those ``persistence_threshold`` keeps whole: DDP's way."""
    persistent, not_persisted = persistent_parameters(model, config)
    if not_persisted:
        _warn_and_record(meter, topology, "persistence_threshold", not_persisted)
    return ReplicatedParameters(model, topology, meter, persistent)


def _place_weights(model: nn.Module, config: ZeroPPConfig, topology: Topology, device: torch.device,
                   meter: CommMeter) -> tuple[str, dict[str, torch.Tensor]]:
    """Agree on where the weights are (:mod:`hf_zeropp.engine.materialize`), give real replicas rank 0's values and
    store frozen matrices INT8 if asked; returns the placement and, on rank 0 of a rank-0 load, its state dict."""
    placement = agree_on_placement(model, topology)
    rank0_state = model.state_dict() if placement == RANK0 and topology.rank == 0 else {}  # references, not copies
    if loading_description(model, placement):
        meter.conditions["loading"] = loading_description(model, placement)
    if placement == REAL:
        _make_replicas_equal(model, topology, device)
    if config.quantized_nontrainable_weights:
        quantize_frozen_weights(model, topology, meter, config.weight_bits, config.block_size,
                                _DTYPES[config.mixed_precision],
                                frozen_weight_source(model, placement, topology, device, rank0_state),
                                backend=config.kernel_backend)
    return placement, rank0_state


def _check_before_any_collective(model: nn.Module, config: ZeroPPConfig, device: torch.device | str | None,
                                 runs_schedule: bool) -> tuple[Topology, torch.device, bool]:
    """The launch checks, then every process group built on every rank in the same order; returns the topology,
    the device, and whether any layer will be a unit of its own (a ``wrap_modules`` that matches nothing fails)."""
    if not runs_schedule:
        config.refuse_schedule("shard_model")
    refuse_training_loop(config.deepspeed_training, "shard_model")
    if getattr(model, "_zeropp", None) is not None:
        raise ValueError("this model is already sharded by hf_zeropp; call shard_model once per model")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed initialised: launch with torchrun or accelerate launch, "
            "or call torch.distributed.init_process_group first"
        )
    device = torch.device(device) if device is not None else _default_device()
    topology = get_topology(config, device.type)  # node and hpZ sizes checked; no group built yet
    has_blocks = bool(_blocks(model, config.wrap_modules))
    check_hybrid_fits(model, config, topology, device)
    _ = topology.world_mesh, topology.node_mesh, topology.hpz_mesh, topology.control_group
    return topology, device, has_blocks


def _choose(model: nn.Module, config: ZeroPPConfig, topology: Topology, device: torch.device, runs_schedule: bool,
            frozen: bool) -> tuple[ZeroPPConfig, Topology, torch.device, bool, CommMeter] | None:
    """``shard_group: auto``: probe the links and predict (:mod:`hf_zeropp.engine.auto`); then either leave the model to
    its first forward's trial (None), or say on rank 0 what was chosen and why and check the chosen config as any
    other before its first collective (its meter records the choice)."""
    plan = choose_configuration(model, config, topology, device, len(_units(model, config.wrap_modules)))
    line = start_trial(model, plan, shard_model, topology, device, runs_schedule, frozen)
    if line is None:  # the twins the trial times share these weights: rank 0's, on the device, before any is built
        _make_replicas_equal(model, topology, device)
        return None
    if topology.rank == 0:
        print(f"hf_zeropp {line}", flush=True)
    config = plan.configs[plan.choice]
    topology, device, has_blocks = _check_before_any_collective(model, config, device, runs_schedule)
    meter = CommMeter(topology)
    meter.conditions["auto"] = line
    return config, topology, device, has_blocks, meter


def _make_replicas_equal(model: nn.Module, topology: Topology, device: torch.device) -> None:
    """Move real weights to the device and give every rank rank 0's parameters and buffers if the ranks built
    different ones, as DDP does.

    A script that seeds per rank or not at all builds different random weights on every rank; FSDP2 would shard
    each rank's own (stage 1-3 would train a mixture of the ranks' inits, stage 0 replicas that never agree). A
    checksum per tensor (sum and sum of squares, float64) is compared first, so the broadcast of the whole model
    only happens when they differ."""
    if device.type != "cpu" or any(p.device.type != device.type for p in model.parameters()):
        model.to(device)
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


def _apply_fsdp_units(model: nn.Module, config: ZeroPPConfig, topology: Topology, device: torch.device,
                      frozen: bool, ignored: set[nn.Parameter], meter: CommMeter) -> list[nn.Module]:
    """``fully_shard`` every unit and the root with the stage's resharding (hpZ: an integer, on the topology's one
    hpZ mesh; stage 3 units within the live-weights budget: none, :mod:`hf_zeropp.engine.live_weights`), activation
    checkpointing first if asked, leaving the ``ignored`` parameters to :mod:`hf_zeropp.comm.replicated`; returns the
    units below the root."""
    units = _units(model, config.wrap_modules)
    if config.activation_checkpointing:
        _enable_activation_checkpointing(model, units)
    policies = _mixed_precision_policies(model, units, config, ignored)
    if config.stage == 0:
        for unit in [*units, model]:
            fully_shard(unit, mesh=topology.replicated_mesh, reshard_after_forward=False, mp_policy=policies[unit],
                        ignored_params=ignored)
        return units
    reshard: bool | int = config.stage == 3
    if config.stage == 3 and topology.hpz_size > 1:
        reshard = topology.hpz_size
    mesh = _sharding_mesh(config, topology)
    # pinned host memory makes the copies to and from a GPU asynchronous; on a CPU-only run there is no device
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if config.cpu_offload else OffloadPolicy()
    kept, decided = units_kept_gathered(model, units, config, ignored) if not frozen else ([], None)
    if decided:
        meter.conditions["live_weights"] = decided
    with shared_hpz_mesh(topology):
        for unit in units:
            unit_reshard = False if any(unit is k for k in kept) else reshard
            fully_shard(unit, mesh=mesh, reshard_after_forward=unit_reshard, mp_policy=policies[unit],
                        offload_policy=offload, ignored_params=ignored)
        # the root keeps its weights gathered from forward to backward, as stock FSDP2's root does: backward
        # starts with it, so resharding would only gather the same weights again (the tied embedding, mostly).
        # A frozen model has no backward: it would hold its root gathered from one forward to the next
        root_reshard = reshard if frozen else False
        fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=policies[model],
                    offload_policy=offload, ignored_params=ignored)
    if over_budget := prefetch_gathers(model, units, config, ignored, device, kept):
        _warn_and_record(meter, topology, "prefetch_depth", over_budget)
    return units


def _mixed_precision_policies(model: nn.Module, units: list[nn.Module], config: ZeroPPConfig,
                              ignored: set[nn.Parameter]) -> dict[nn.Module, MixedPrecisionPolicy]:
    """FSDP2's mixed-precision policy for every unit and the root. FSDP2 casts a unit's floating inputs to the
    compute dtype so that they meet the weights it gathers in that dtype. A unit that gathers none (all its own
    parameters replicated, such as Accelerate's ``RegressionModel``, or none at all) leaves its inputs as the script
    passed them: its replicated parameters keep their dtype, so it computes as under stock DDP's autocast, where such
    elementwise work stays in fp32."""
    replicated = {id(p) for p in ignored}
    policies = {}
    for unit in [*units, model]:
        inner = [other for other in units if other is not unit and any(other is m for m in unit.modules())]
        elsewhere = replicated | {id(p) for other in inner for p in other.parameters()}
        gathers = any(id(p) not in elsewhere for p in unit.parameters())
        policies[unit] = MixedPrecisionPolicy(param_dtype=_DTYPES[config.mixed_precision],
                                              reduce_dtype=_DTYPES[config.reduce_dtype], cast_forward_inputs=gathers)
    return policies


def _warn_and_record(meter: CommMeter, topology: Topology, option: str, line: str) -> None:
    """A requested option that cannot apply: said once on rank 0 and kept in ``comm_stats()["implementations"]``."""
    meter.conditions[option] = line
    if topology.rank == 0:
        warnings.warn(f"hf_zeropp: {line}", stacklevel=4)


def _sharding_mesh(config: ZeroPPConfig, topology: Topology):
    """All ranks (ZeRO); or, hybrid, the 2-D ``(nodes, node_size)`` mesh on which FSDP2 shards in the node and
    all-reduces across nodes itself (HSDP), or the node's ranks alone when hf_zeropp quantizes that all-reduce."""
    if config.shard_group != "node" or topology.nodes == 1:
        return topology.world_mesh
    return topology.node_mesh if config.hybrid_gradient_bits is None else topology.node_shard_mesh


def _route_generation(model: nn.Module, config: ZeroPPConfig) -> None:
    if callable(getattr(model, "generate", None)):
        # generate() calls forward without the root module's __call__: let FSDP gather the root's weights for it
        register_fsdp_forward_method(model, "generate")
        route_generate(model, config.generation_gather)


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _units(model: nn.Module, wrap_modules: list[str] | None) -> list[nn.Module]:
    """The FSDP units below the root: transformer blocks, plus untied input embeddings and output head (first, so
    that one inside a block is sharded before it; of a container of them, MusicGen's one per codebook, its members).

    Blocks come from ``wrap_modules`` or the model's ``_no_split_modules`` (transformers' list of layer classes
    that must stay whole). Tied embeddings stay with the root, so the shared weight lives in one unit."""
    blocks = _blocks(model, wrap_modules)
    units: list[nn.Module] = []
    ends = [m for e in (_call(model, "get_input_embeddings"), _call(model, "get_output_embeddings")) if e is not None
            for m in (e.children() if isinstance(e, (nn.ModuleList, nn.ModuleDict)) else [e])]
    tied = len({id(p) for m in ends for p in m.parameters()}) < sum(1 for m in ends for _ in m.parameters())
    if not tied:
        units += [m for m in ends if any(True for _ in m.parameters())]
    inside_a_block = {id(m) for b in blocks for m in b.modules() if m is not b}
    # an untied embedding or head inside a block stays a unit of its own, nested in the block's: a model may call it
    # alone (ModernVBERT embeds its tokens through its text model's ``get_input_embeddings()``), which gathers its
    # weight only if it is a unit
    units += [b for b in blocks if id(b) not in inside_a_block]
    return _shared_weights_left_to_the_root(model, units)


def _shared_weights_left_to_the_root(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``units`` less those holding a parameter that a module outside them also holds: FSDP2 manages a parameter in
    one unit only, so such a weight goes to the root (BERT's embeddings block shares its word embeddings with the LM
    head's decoder, which sits at the root). Repeated, as a unit left out passes its parameters to the one above."""
    while True:
        unit_ids = {id(u) for u in units}
        holders: dict[int, set[int]] = {}  # parameter -> the innermost unit (or the root) of each module holding it

        def visit(module: nn.Module, owner: int) -> None:
            owner = id(module) if id(module) in unit_ids else owner
            for _, parameter in module.named_parameters(recurse=False, remove_duplicate=False):
                holders.setdefault(id(parameter), set()).add(owner)
            for child in module.children():
                visit(child, owner)

        visit(model, id(model))
        sharing = {owner for owners in holders.values() if len(owners) > 1 for owner in owners}
        if not sharing & unit_ids:
            return units
        units = [u for u in units if id(u) not in sharing]


def _blocks(model: nn.Module, wrap_modules: list[str] | None) -> list[nn.Module]:
    """The submodules whose class is named by ``wrap_modules`` or, without it, by ``_no_split_modules``."""
    names = wrap_modules if wrap_modules is not None else no_split_modules(model)
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if wrap_modules and not blocks:
        raise ValueError(f"wrap_modules={wrap_modules} matches no submodule of {type(model).__name__}; "
                         f"use class names of its layers")
    return blocks


def _call(model: nn.Module, method: str) -> nn.Module | None:
    """``model.method()`` where it returns a module (Perceiver's ``get_input_embeddings`` returns a bare parameter)."""
    try:
        found = getattr(model, method)() if hasattr(model, method) else None
    except NotImplementedError:
        return None
    return found if isinstance(found, nn.Module) else None


def _enable_activation_checkpointing(model: nn.Module, units: list[nn.Module]) -> None:
    if hasattr(model, "gradient_checkpointing_enable") and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    block_ids = {id(u) for u in units}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in block_ids)


def _install_comms(model: nn.Module, state: ZeroPPState) -> None:
    """Give every FSDP unit hf_zeropp's all-gather and reduce-scatter, and make FSDP request plain SUMs."""
    if state.config.cpu_offload:
        state.meter.conditions["cpu_offload"] = (
            "FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state in CPU memory"
            + (" (pinned), optimizer step on the CPU; each unit's shard is copied to the GPU for its all-gather"
               if state.topology.device_type == "cuda" else
               ", optimizer step on the CPU (a CPU-only run: the compute device is the CPU too, so nothing moves)"))
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
    if state.config.shard_group == "node" and state.topology.nodes > 1:
        state.cross_node_all_reduce = install_hybrid_all_reduce(fsdp_modules(model), state.config, state.topology,
                                                                state.meter, _call(model, "get_input_embeddings"),
                                                                _call(model, "get_output_embeddings"))


def _allreduce_meter(meter: CommMeter, topology: Topology):
    group = topology.world_mesh.get_group()

    def hook(reduced: torch.Tensor) -> None:
        meter.record_allreduce(group, reduced.numel() * reduced.element_size(), f"all_reduce {reduced.dtype}")

    return hook


class ZeroPPModule:
    """Put in front of FSDP2's ``FSDP<Name>`` class of every model that :func:`shard_model` returns, so that the stock
    calls users make on a model keep their meaning under sharding (both are collectives: call them on every rank):

    * ``load_state_dict`` with full tensors (a ``from_pretrained`` file, the Trainer's ``load_best_model_at_end``,
      peft's ``load_adapter``) loads them into the shards; a sharded (DTensor) state dict loads as in FSDP2;
    * ``save_pretrained`` without a ``state_dict``, or with a sharded one, writes the consolidated model from rank 0,
      loadable by plain transformers, and returns on every rank once it is written. Only rank 0 writes, also when
      given a full state dict: it alone holds the consolidated copy (``get_state_dict`` is empty elsewhere);
    * ``set_requires_gradient_sync`` (what :func:`hf_zeropp.no_sync` switches) also switches the gradient all-reduce
      of the parameters FSDP2 leaves replicated (:mod:`hf_zeropp.comm.replicated`).
    """

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        super().set_requires_gradient_sync(requires_gradient_sync, recurse=recurse)
        zeropp_state(self).replicated.sync = requires_gradient_sync  # the parameters FSDP2 does not manage follow

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # torch's own loaders call this with DTensors, or, inside shard_model (rank 0's weights arriving), with the
        # plain tensors of a model that has nothing sharded (all its parameters replicated)
        if is_loading_full_state(self) or holds_dtensors(state_dict) or getattr(self, "_zeropp", None) is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        return load_full_state_dict(self, state_dict, strict, zeropp_state(self).topology.control_group)

    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any):
        base = super().save_pretrained
        named = _named_arguments(base, save_directory, *args, **kwargs)
        state_dict = named.get("state_dict")
        control_group = zeropp_state(self).topology.control_group
        collective = state_dict is None or holds_dtensors(state_dict)
        writer_arguments = {k: v for k, v in named.items() if k not in ("self", "save_directory", "state_dict")}
        if state_dict is None and writes_per_rank(self, writer_arguments):
            expect_every_rank(control_group, "save_pretrained")
            write_pretrained(self, save_directory, named.get("max_shard_size", MAX_SHARD_SIZE), control_group)
            return None
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


__all__ = ["ZeroPPModule", "shard_model"]
