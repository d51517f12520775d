"""torch.compile on a sharded model, one FSDP unit at a time: the recipe torchtitan uses with FSDP2.

Each unit below the root (the transformer blocks; an untied input embedding and output head) is compiled in place
with ``nn.Module.compile``, as Accelerate's FSDP2 path compiles regions. FSDP2's pre- and post-forward hooks, which
start and wait for the unit's all-gather (qwZ's INT8 codes, hpZ's node-local gather) and set up the backward hooks
that reduce-scatter its gradients (qgZ's all-to-alls), are not traced: torch wraps them in ``torch._dynamo.disable``
("skipping FSDP hooks") and runs them eagerly. So every unit is one graph without a break, and the collectives, with
their quantization kernels, run between the compiled units. The root's own layers (a tied model's embeddings, final
norm and head, and the loss) stay uncompiled: compiling the root whole would trace through each unit's call and break
its graph at every unit's hooks.

Why the collectives stay outside: torch 2.13's FSDP2 cannot be traced (its hooks are always excluded), and graphs
that hold the collectives (torchtitan's SimpleFSDP) replace FSDP2 and with it the custom all-gather and
reduce-scatter objects that carry qwZ, hpZ, qgZ, hybrid-q and the byte meter; such a graph would also be rebuilt
whenever ``set_techniques`` switches a technique.

``mode="reduce-overhead"`` and ``mode="max-autotune"`` ask inductor for CUDA graphs. Inductor takes them of graphs
whose tensors are all on one CUDA device; on CPU it skips them, saying so only in its ``cudagraphs`` log (shown with
``TORCH_LOGS=cudagraphs``) and a counter (``torch._inductor.cudagraph_utils``), and compiles without them.
hf_zeropp compiles as torch does there, and says so once.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from torch import nn

from .._compat import raise_recompile_limit, uncompiled
from .auto_trial import after_sharding, is_pending
from .state import zeropp_state

# torch.compile modes that turn on inductor's CUDA graphs (torch._inductor.list_mode_options)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# Graphs kept per unit: the first shapes, then dynamic shapes (torch marks a dimension dynamic when it changes), each
# with and without gradients (training and evaluation)
GRAPHS_PER_UNIT = 4
_SAID: set[str] = set()  # what rank 0 has warned of, once per process (a filter change elsewhere would repeat it)


def compile_units(model: nn.Module, *, asked_by: str = "compile_units", **compile_kwargs: Any) -> None:
    """Compile each FSDP unit of the sharded ``model`` in place (``compile_kwargs`` are ``torch.compile``'s) and record
    what was compiled in ``comm_stats(model)["implementations"]["compile"]``. A model without units below its root
    is compiled whole. A model awaiting auto's trial is compiled once the trial has sharded it. Compiling an already
    compiled model again does nothing. ``asked_by`` names the setting that asked, for the record."""
    model = uncompiled(model)
    if is_pending(model):
        after_sharding(model, lambda sharded: compile_units(sharded, asked_by=asked_by, **compile_kwargs))
        return
    state = zeropp_state(model)
    if "compile" in state.meter.conditions:
        return
    targets = state.units or [model]
    before, limit = raise_recompile_limit(GRAPHS_PER_UNIT * len(targets) + 8)
    for unit in targets:
        unit.compile(**compile_kwargs)
    classes = ", ".join(f"{count} {name}" for name, count in Counter(type(u).__name__ for u in targets).items())
    options = ", ".join(f"{key}={value!r}" for key, value in sorted(compile_kwargs.items()) if value is not None)
    where = ("per FSDP unit; FSDP2's gathers and reduce-scatters (and their quantization) run eagerly between the "
             "units, the root's own layers uncompiled" if state.units else
             "the whole model: it has no FSDP unit below its root")
    raised = f"; torch._dynamo recompile_limit raised from {before} to {limit}" if limit != before else ""
    state.meter.conditions["compile"] = f"torch.compile ({options or 'defaults'}) of {classes}, {where} (asked by " \
                                        f"{asked_by}){raised}{_without_cuda_graphs(state, compile_kwargs)}"


def _without_cuda_graphs(state: Any, compile_kwargs: dict[str, Any]) -> str:
    """The record's note (and rank 0's warning, once) where the compile asks for CUDA graphs off CUDA."""
    mode, options = compile_kwargs.get("mode"), compile_kwargs.get("options") or {}
    if (mode not in CUDA_GRAPH_MODES and not options.get("triton.cudagraphs")) or state.topology.device_type == "cuda":
        return ""
    asked = f"mode={mode!r}" if mode in CUDA_GRAPH_MODES else "options={'triton.cudagraphs': True}"
    note = f"; {asked} asks for CUDA graphs: none on {state.topology.device_type}, compiled without them"
    _warn_once(state.topology.rank, f"hf_zeropp: torch.compile {asked} asks for CUDA graphs; on "
               f"{state.topology.device_type} torch compiles without them (the step is inductor's, not CUDA "
               f"graphs'), comm_stats(model)['implementations']['compile'] records it")
    return note


def _warn_once(rank: int, message: str) -> None:
    if rank == 0 and message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, stacklevel=4)


def compile_as_accelerate_asks(model: nn.Module, plugin: Any, rank: int) -> None:
    """Compile a sharded model as Accelerate's dynamo settings (``TorchDynamoPlugin``: the launch's
    ``--dynamo_backend`` / ``dynamo_config``, the Trainer's ``--torch_compile``) ask: per FSDP unit. Where they ask for
    the whole model (``use_regional_compilation`` off, the default), rank 0 says once that the units are compiled
    instead; a whole-model graph would break at every unit's FSDP hooks."""
    if not plugin.use_regional_compilation:
        _warn_once(rank, "hf_zeropp compiles a sharded model per FSDP unit (each transformer block), not as one "
                         "whole-model graph as Accelerate's dynamo settings ask: the whole model's graph would break "
                         "at every unit's FSDP hooks (comm_stats(model)['implementations']['compile'] records it)")
    compile_units(model, asked_by="Accelerate's dynamo settings (Trainer --torch_compile, --dynamo_backend)",
                  **plugin.to_kwargs())


def record_whole_model_compile(model: nn.Module, asked_by: str) -> None:
    """Record that the script compiled the whole model itself (``torch.compile(model)``): torch traces the root's own
    layers and each unit's forward, breaking the graph at every unit's FSDP hooks, which run eagerly; the numbers
    are eager's."""
    inner = uncompiled(model)
    if inner is model or is_pending(inner):
        return
    zeropp_state(inner).meter.conditions.setdefault(
        "compile", f"torch.compile of the whole model ({asked_by}): its graph breaks at every FSDP unit's hooks, "
                   f"which run eagerly; hf_zeropp.compile_units compiles each unit without breaks")


def seeing_through_compile(shard: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``shard(torch.compile(model), ...)`` shards the model inside the wrapper and returns the wrapper as it came,
    recording that the script compiled the whole model."""
    @functools.wraps(shard)
    def shard_inside(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        inner = uncompiled(model)
        if inner is model:
            return shard(model, *args, **kwargs)
        shard(inner, *args, **kwargs)
        record_whole_model_compile(model, "torch.compile(model) before shard_model or prepare")
        return model
    return shard_inside


__all__ = ["compile_as_accelerate_asks", "compile_units", "record_whole_model_compile", "seeing_through_compile"]
