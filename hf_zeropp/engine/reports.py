"""The warnings :func:`hf_zeropp.shard_model` gives once, on rank 0, when what was asked for is not what will run —
each also recorded in ``comm_stats()["implementations"]``: a requested technique this launch cannot apply, a kernel
format that falls back to its plain-torch specification, a model whose layers do not become FSDP units. The FSDP
settings a launch or TrainingArguments gave (:mod:`hf_zeropp.config.fsdp_settings`, which warned where it read them) are
recorded there too."""

from __future__ import annotations

import warnings

from torch import nn

from .._compat import no_split_modules
from ..config.fsdp_settings import remembered
from .state import ZeroPPState


def report_what_will_not_run_as_asked(model: nn.Module, state: ZeroPPState, has_blocks: bool) -> None:
    _report_techniques_that_cannot_apply(state)
    _report_width_format_without_kernel(state)
    _report_whole_model_as_one_unit(model, state, has_blocks)
    _record_fsdp_settings(state)


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
    if config.shard_group == "node" and topology.nodes == 1:
        quantized = " (and nothing crosses nodes for hybrid_gradient_bits to quantize)" if config.hybrid_gradient_bits \
            else ""
        reasons["shard_group"] = (f"hybrid sharding replicates across nodes, and {where}: it runs as ZeRO-3 (preset "
                                  f"zero3){quantized}")
    for technique, reason in reasons.items():
        state.meter.conditions[technique] = f"not applied: {reason}"
        if topology.rank == 0:
            warnings.warn(f"hf_zeropp: {technique} was requested but is not applied: {reason}. Set node_size (or "
                          f"ZEROPP_NODE_SIZE) if the launcher's node size is wrong", stacklevel=4)


def _report_width_format_without_kernel(state: ZeroPPState) -> None:
    """Warn once (rank 0) when qgZ's per-block widths will run as their plain-torch specification because the
    device has no compiled kernel for them (CPU and CUDA have one): the same format, but slower than the fixed
    format's plain torch (its width rule is a bisection that waits on the device at every step). Not said where
    plain torch everywhere was asked for (``kernel_backend: reference``): the widths are then no exception.
    comm_stats shows it in qgZ's implementation line ("plain torch")."""
    config, topology = state.config, state.topology
    if not (config.quantized_gradients and config.gradient_bit_allocation and topology.nodes > 1):
        return
    if topology.device_type in ("cpu", "cuda") or config.kernel_backend == "reference":
        return
    if topology.rank == 0:
        warnings.warn(f"hf_zeropp: gradient_bit_allocation runs its plain-torch specification on "
                      f"{topology.device_type}: the per-block width format has compiled kernels for CPU and CUDA "
                      f"only, so qgZ's inter-node hop is slower than with the fixed format (same bytes, same format). "
                      f"Set gradient_bit_allocation: false to keep that hop as fast as qgZ's others", stacklevel=4)


def _report_whole_model_as_one_unit(model: nn.Module, state: ZeroPPState, has_blocks: bool) -> None:
    """Warn once (rank 0) when no layer became an FSDP unit of its own: the model lists no ``_no_split_modules``
    (or ones it does not contain) and ``wrap_modules`` names none. Training is still correct, but the layers form one
    unit: stage 3 gathers every weight at once (the full model per rank at peak, ZeRO-3's memory saving gone) and no
    gather overlaps compute. The fix is one option, and the layer class is usually the element type of the model's
    largest ``nn.ModuleList``, so the message names it. comm_stats shows it under ``fsdp_units``."""
    config, topology = state.config, state.topology
    sharded = [name for name, _ in model.named_parameters() if name not in state.replicated.reasons]
    if config.stage == 0 or has_blocks or not sharded:  # nothing sharded (RegressionModel): nothing to gather
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
                      stacklevel=4)


def _record_fsdp_settings(state: ZeroPPState) -> None:
    """Which options the process's FSDP settings gave the model (``fsdp_settings``), and each setting that does not
    run as under Accelerate's FSDP (an ignored key, a checkpoint format), under its own ``key=value``."""
    settings = remembered()
    if settings is None:
        return
    taken = [f"{option}={value!r} ({settings.stated_by[option]})"
             for option, value in {**settings.implied, **settings.options}.items()
             if getattr(state.config, option) == value]  # an implied option the hf_zeropp config set is not taken
    state.meter.conditions["fsdp_settings"] = f"from {settings.where}: {', '.join(taken) or 'no option'}"
    for setting, why in settings.warnings.items():
        state.meter.conditions[setting] = f"{settings.where}: {why}"


__all__ = ["report_what_will_not_run_as_asked"]
