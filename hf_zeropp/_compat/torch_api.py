"""torch internals hf_zeropp reaches into: FSDP2's custom-collective base classes and parameter-group state,
``torch._C`` and process-group internals, the threaded test process group (checked on torch 2.13; FSDP2 modules that
moved are found by trying their known locations, newest first)."""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# entry -> the upstream symbol it reaches into (named in tests/compat/test_compat.py's failure messages)
UPSTREAM: dict[str, str] = {
    "AllGather": "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather",
    "ReduceScatter": "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
    "in_backward": "torch._C._current_graph_task_id",
    "queue_backward_callback": "torch.autograd.Variable._execution_engine.queue_callback",
    "hsdp_mesh_info": "torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo",
    "post_forward_mesh_info_override": "torch.distributed.fsdp._fully_shard._fully_shard._get_post_forward_mesh_info",
    "fsdp_param_groups": "FSDPModule._get_fsdp_state()._fsdp_param_groups",
    "fsdp_param_group": "FSDPModule._get_fsdp_state()._fsdp_param_group",
    "group_parameters": "FSDPParamGroup.fsdp_params / FSDPParam.sharded_param, .padded_sharded_param_size",
    "group_shard_world_size": "FSDPParamGroup.mesh_info.shard_mesh_size",
    "observe_gradient_reduction": "FSDPParamGroup.post_backward, .reduce_grads; FSDPParam._unsharded_param.grad, "
                                  ".unsharded_accumulated_grad",
    "group_reshards_after_forward": "FSDPParamGroup.post_forward_mesh_info",
    "group_is_sharded": "FSDPParam.sharded_state, torch.distributed.fsdp._fully_shard._fsdp_param.ShardedState",
    "set_post_forward_mesh_info": "FSDPParamGroup/FSDPParam.post_forward_mesh_info, "
                                  "FSDPParam._init_sharded_post_forward_param_metadata, FSDPParam._orig_size",
    "group_gathered_bytes": "FSDPParam.sharded_state, .all_gather_outputs, ._sharded_post_forward_param_data",
    "unshard_all": "FSDPModule.unshard(async_op=True) and its handle's wait",
    "keep_all_gathered": "FSDPState._lazy_init, FSDPModule.unshard, FSDPParamGroup.post_forward_mesh_info",
    "apply_activation_checkpointing": "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
                                      ".apply_activation_checkpointing",
    "process_group_timeout": "ProcessGroup._get_backend(device).options._timeout",
    "default_store": "torch.distributed.distributed_c10d._get_default_store",
    "threaded_process_groups": "torch.testing._internal.distributed.multi_threaded_pg (_install_threaded_pg, "
                               "Collective.join, ProcessLocalGroup.exception_handle), "
                               "torch._C._distributed_c10d._set_thread_isolation_mode",
    "local_tensor": "torch.distributed.tensor.DTensor._local_tensor",
    "fresh_grad_scaler_state": "torch.amp.grad_scaler._refresh_per_optimizer_state",
    "uncompiled": "torch._dynamo.eval_frame.OptimizedModule._orig_mod",
    "raise_recompile_limit": "torch._dynamo.config.recompile_limit",
}


def _import_first(modules: tuple[str, ...], name: str) -> Any:
    """``name`` from the first of ``modules`` that has it (a module that moved between versions)."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(f"hf_zeropp needs {name} from one of {', '.join(modules)}; this torch {torch.__version__} has "
                      f"none (hf_zeropp/_compat/torch_api.py lists the versions it was checked on)")


_FSDP_PACKAGES = ("torch.distributed.fsdp._fully_shard", "torch.distributed._composable.fsdp")  # new first

# ---------------------------------------------------------------- torch FSDP2 (checked on torch 2.13)

# FSDP2's custom all-gather / reduce-scatter protocols (set_custom_all_gather / set_custom_reduce_scatter): the
# base classes hf_zeropp's metered and quantized collectives subclass. Checked: torch 2.13.
AllGather = _import_first(tuple(f"{p}._fsdp_api" for p in _FSDP_PACKAGES), "AllGather")
ReduceScatter = _import_first(tuple(f"{p}._fsdp_api" for p in _FSDP_PACKAGES), "ReduceScatter")


def _fsdp_module(name: str) -> Any:
    """FSDP2's internal module ``name`` (``_fully_shard``, ``_fsdp_common``, ``_fsdp_param``), wherever it lives."""
    for package in _FSDP_PACKAGES:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ImportError:
            continue
    raise ImportError(f"hf_zeropp needs FSDP2's internal module {name} (looked in {', '.join(_FSDP_PACKAGES)})")


# checked: torch 2.13
def in_backward() -> bool:
    """``torch._C._current_graph_task_id``: True while autograd runs a backward pass (FSDP's pre-backward all-gathers
    happen there; it tells forward from backward gathers and guards the optimizer-step hook)."""
    return torch._C._current_graph_task_id() != -1


# checked: torch 2.13
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """``Variable._execution_engine.queue_callback``: run ``callback`` once the running backward pass has finished
    (after FSDP's own final callback, which is queued when backward starts)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# checked: torch 2.13
def hsdp_mesh_info(mesh: Any, shard_mesh_dim: int, replicate_mesh_dim: int) -> Any:
    """FSDP2's internal ``HSDPMeshInfo`` for ``mesh``: the post-forward (hpZ) mesh description FSDP expects."""
    return _fsdp_module("_fsdp_common").HSDPMeshInfo(mesh, shard_mesh_dim=shard_mesh_dim,
                                                     replicate_mesh_dim=replicate_mesh_dim)


# checked: torch 2.13 (defined in _fsdp_init, looked up by fully_shard as a global of _fully_shard)
@contextlib.contextmanager
def post_forward_mesh_info_override(choose: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Inside the block, in this thread, FSDP2's private ``_get_post_forward_mesh_info`` (as ``fully_shard`` sees
    it) asks ``choose(reshard_after_forward, mesh_info)`` first, and builds its own when that returns None (FSDP
    builds a new device mesh per call for an integer reshard, pytorch#153302). The choice is per thread, so ranks
    that are threads of one process (the threaded test group) each keep their own."""
    module = _fsdp_module("_fully_shard")
    if not hasattr(module._get_post_forward_mesh_info, "choices"):
        build = module._get_post_forward_mesh_info
        choices = threading.local()

        def post_forward_mesh_info(reshard_after_forward, mesh_info):
            choose = getattr(choices, "choose", None)
            chosen = choose(reshard_after_forward, mesh_info) if choose is not None else None
            return chosen if chosen is not None else build(reshard_after_forward, mesh_info)

        post_forward_mesh_info.choices = choices
        module._get_post_forward_mesh_info = post_forward_mesh_info
    choices = module._get_post_forward_mesh_info.choices
    outer, choices.choose = getattr(choices, "choose", None), choose
    try:
        yield
    finally:
        choices.choose = outer


# The parameter-group walks below take FSDP modules and return FSDP2's FSDPParamGroup objects as opaque handles:
# only the functions here read or write their attributes.

# checked: torch 2.13 (list ``_fsdp_param_groups``), 2.11 (one optional ``_fsdp_param_group``)
def fsdp_param_groups(module: nn.Module) -> list:
    """``module._get_fsdp_state()._fsdp_param_groups``: the FSDP unit's parameter groups (opaque handles)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


# checked: torch 2.13
def fsdp_param_group(module: nn.Module) -> Any:
    """``module._get_fsdp_state()._fsdp_param_group``: the unit's one parameter group, or None (no parameters)."""
    return module._get_fsdp_state()._fsdp_param_group


# checked: torch 2.13
def group_parameters(group: Any) -> list[tuple[nn.Parameter, int]]:
    """``FSDPParam.sharded_param`` and ``padded_sharded_param_size.numel()`` of each of the group's parameters, in
    the order of its flat all-gather / reduce-scatter buffers."""
    return [(param.sharded_param, param.padded_sharded_param_size.numel()) for param in group.fsdp_params]


# checked: torch 2.13
def group_shard_world_size(group: Any) -> int:
    """``FSDPParamGroup.mesh_info.shard_mesh_size``: the number of ranks the group's parameters are sharded over."""
    return group.mesh_info.shard_mesh_size


# checked: torch 2.13
def observe_gradient_reduction(group: Any, observe: Callable[[list[bool] | None], None]) -> None:
    """Before each ``FSDPParamGroup.post_backward`` of ``group`` (the step where FSDP2 picks the gradients it
    reduces), call ``observe`` with, per parameter in ``group_parameters`` order, whether this rank holds an unsharded
    gradient for it (``_unsharded_param.grad`` or ``unsharded_accumulated_grad``; False for a frozen or never
    gathered one), or with None when this backward does not reduce (``reduce_grads`` off: inside ``no_sync``)."""
    post_backward = group.post_backward

    def observed_post_backward(*args: Any) -> Any:
        if not group.reduce_grads:
            observe(None)
        else:
            observe([hasattr(param, "_unsharded_param") and param._unsharded_param.requires_grad
                     and (param.unsharded_accumulated_grad is not None or param._unsharded_param.grad is not None)
                     for param in group.fsdp_params])
        return post_backward(*args)

    group.post_backward = observed_post_backward


# checked: torch 2.13
def group_reshards_after_forward(group: Any) -> bool:
    """Whether ``FSDPParamGroup.post_forward_mesh_info`` is set (False: the group keeps its weights gathered
    after forward, stage 1/2)."""
    return group.post_forward_mesh_info is not None


# checked: torch 2.13
def group_is_sharded(group: Any) -> bool:
    """Whether every ``FSDPParam.sharded_state`` of the group is ``ShardedState.SHARDED`` (no gathered weights and
    no post-forward shard held)."""
    sharded = _fsdp_module("_fsdp_param").ShardedState.SHARDED
    return all(param.sharded_state == sharded for param in group.fsdp_params)


# checked: torch 2.13
def set_post_forward_mesh_info(group: Any, mesh_info: Any | None) -> None:
    """Set the post-forward mesh info of the group and of each ``FSDPParam`` (None: the group's own
    ``mesh_info``, i.e. plain resharding) and rebuild their private post-forward shard metadata
    (``_init_sharded_post_forward_param_metadata``): switches hpZ between steps."""
    info = mesh_info if mesh_info is not None else group.mesh_info
    group.post_forward_mesh_info = info
    for param in group.fsdp_params:
        param.post_forward_mesh_info = info
        param._init_sharded_post_forward_param_metadata(torch.empty(param._orig_size, device="meta"))


# checked: torch 2.13
def unshard_all(root: nn.Module) -> None:
    """Gather every FSDP unit under ``root`` now (all gathers in flight at once, then waited on), in
    ``root.modules()`` order, the same on every rank; a unit already gathered costs nothing."""
    from torch.distributed.fsdp import FSDPModule

    handles = [module.unshard(async_op=True) for module in root.modules() if isinstance(module, FSDPModule)]
    for handle in handles:
        if handle is not None:
            handle.wait()


# checked: torch 2.13
@contextlib.contextmanager
def keep_all_gathered(root: nn.Module) -> Iterator[None]:
    """Gather every FSDP unit under ``root`` on entry and keep it gathered after each forward inside the block
    (each group's ``post_forward_mesh_info`` set to None, as FSDP does for its root); on exit each group's own
    setting comes back (resharding is the caller's).

    FSDP's lazy init (``FSDPState._lazy_init``, normally run by the first forward) runs first: it is what turns
    the root's resharding off, and it must not happen inside the block, where the restore would undo it. The
    gathers run before resharding is switched off: a unit that holds an hpZ secondary shard from an earlier forward
    gathers through that shard's mesh, which FSDP reads from the same field."""
    from torch.distributed.fsdp import FSDPModule

    root._get_fsdp_state()._lazy_init()
    unshard_all(root)
    groups = [group for module in root.modules() if isinstance(module, FSDPModule)
              for group in fsdp_param_groups(module)]
    saved = [group.post_forward_mesh_info for group in groups]
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        yield
    finally:
        for group, info in zip(groups, saved):
            group.post_forward_mesh_info = info


# checked: torch 2.13
def set_unshard_async_op(root: nn.Module, async_op: bool) -> None:
    """FSDP's private switch for issuing every unit's pre-forward/pre-backward all-gather with ``async_op``."""
    root._set_unshard_async_op(async_op)


# checked: torch 2.13
def drop_pending_gather(group: Any) -> None:
    """Wait for and discard a prefetched all-gather that no forward or backward consumed: FSDP keeps it in
    ``_all_gather_result`` and would serve it at the unit's next unshard, with the weights of when it started."""
    result = group._all_gather_result
    if result is None:
        return
    if isinstance(result.all_gather_work, dist.Work):
        result.all_gather_work.wait()
    group._all_gather_result = None


# checked: torch 2.13
def group_gathered_bytes(group: Any) -> int:
    """Bytes the group holds beyond its shards: ``all_gather_outputs`` of unsharded parameters and the private
    ``_sharded_post_forward_param_data`` of hpZ post-forward (secondary) shards."""
    states = _fsdp_module("_fsdp_param").ShardedState
    total = 0
    for param in group.fsdp_params:
        if param.sharded_state == states.UNSHARDED:
            total += sum(t.untyped_storage().nbytes() for t in param.all_gather_outputs)
        elif param.sharded_state == states.SHARDED_POST_FORWARD:
            data = param._sharded_post_forward_param_data
            total += data.numel() * data.element_size()
    return total


# ---------------------------------------------------------------- other torch internals (checked on torch 2.13)

# checked: torch 2.13
def apply_activation_checkpointing(model: nn.Module, check_fn: Callable[[nn.Module], bool]) -> None:
    """torch's ``apply_activation_checkpointing`` from the private ``torch.distributed.algorithms._checkpoint``
    package: non-reentrant checkpointing of the units of a model that has no ``gradient_checkpointing_enable``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as apply

    apply(model, check_fn=check_fn)


# checked: torch 2.13
def process_group_timeout(group: dist.ProcessGroup, device_type: str) -> Any:
    """``group._get_backend(device).options._timeout``: the group's collective timeout (None if the backend does
    not expose it), so hf_zeropp's own groups can inherit the world group's."""
    try:
        backend = group._get_backend(torch.device(device_type))
    except RuntimeError:  # a group implemented in Python (torch's threaded test group) has no backend object
        return None
    return getattr(getattr(backend, "options", None), "_timeout", None)


# checked: torch 2.13 (the harness torch's own FSDP2 tests run threaded ranks with)
@contextlib.contextmanager
def threaded_process_groups() -> Iterator[tuple[dist.Store, Callable[[BaseException], None]]]:
    """Inside the block, ``init_process_group("threaded", ...)`` in a thread makes that thread a rank of a world
    held in this process; yields the store the ranks share and the function that stops every rank after one
    failed. Collectives order after the caller's current CUDA stream and return with their outputs written
    (:mod:`hf_zeropp.testing.threaded_ranks` says why)."""
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    join = threaded.Collective.join

    def stream_ordered_join(self, rank, data):
        if torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the inputs this rank issued are complete
            if rank == 0 and "work" not in vars(self._collective):  # rank 0's thread copies for every rank
                copy = self._collective.work

                def work_then_wait(ranks_data):
                    copy(ranks_data)
                    torch.cuda.current_stream().synchronize()

                self._collective.work = work_then_wait
        return join(self, rank, data)

    threaded._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    threaded.Collective.join = stream_ordered_join
    try:
        yield dist.HashStore(), threaded.ProcessLocalGroup.exception_handle
    finally:
        threaded.Collective.join = join
        threaded.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded._uninstall_threaded_pg()


# checked: torch 2.13
def default_store() -> dist.Store:
    """``distributed_c10d._get_default_store()``: the store the world group was built on (the launcher's, under
    torchrun), which outlives a failed collective."""
    return dist.distributed_c10d._get_default_store()


# checked: torch 2.13
def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``DTensor._local_tensor`` (the tensor itself, so its ``_version`` shows in-place writes) or a plain tensor."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor



# checked: torch 2.13
def fresh_grad_scaler_state() -> dict[str, Any]:
    """``torch.amp.grad_scaler._refresh_per_optimizer_state()``: what a GradScaler's per-optimizer record holds at the
    start of an iteration; a scaler with its own update rule resets it as ``GradScaler.update`` does."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    return _refresh_per_optimizer_state()


# checked: torch 2.13
def uncompiled(module: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``), or the argument itself: hf_zeropp shards, saves and reports on the model inside, whose parameter names are the model's
    own (the wrapper prefixes them with ``_orig_mod.``)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was compiled in this process; importing dynamo would cost 0.5 CPU-s
        return module
    return module._orig_mod if isinstance(module, eval_frame.OptimizedModule) else module


# checked: torch 2.13
def raise_recompile_limit(at_least: int) -> tuple[int, int]:
    """Raise ``torch._dynamo.config.recompile_limit`` (graphs kept per code object) to ``at_least``; returns it before
    and after. Compiled one by one, the blocks of a transformers model share one ``forward`` code object and get one
    graph each (each specializes on its ``layer_idx``), so a model with more blocks than the limit would run the rest
    uncompiled."""
    from torch._dynamo import config

    before = config.recompile_limit
    config.recompile_limit = max(before, at_least)
    return before, config.recompile_limit


__all__ = sorted(UPSTREAM)
