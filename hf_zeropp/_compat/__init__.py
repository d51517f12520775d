"""Every private or internal upstream API hf_zeropp uses, in one place: one module per upstream project
(:mod:`.torch_api`, :mod:`.transformers_api`, :mod:`.accelerate_api`), re-exported here.

Torch FSDP2's custom-collective base classes and parameter-group internals, ``torch._C`` and process-group
internals, transformers' model-init and Trainer hooks, and Accelerate's prepared-object registry are reached only
through these names; the rest of hf_zeropp imports them from ``hf_zeropp._compat``. Each entry says what it reaches
into and carries the versions it was checked on. ``tests/compat/test_compat.py`` exercises every entry against the
installed versions, so an upstream rename fails there with the upstream symbol named (``UPSTREAM`` maps entry ->
symbol).

Where a module moved between versions the right one is found by trying the known locations in order, never by
comparing version strings. PEFT and TRL: hf_zeropp uses none of their private APIs (TRL's trainers reach hf_zeropp
through the Trainer hooks, which they inherit).

These modules import only torch and third-party packages, never other hf_zeropp modules; transformers and
accelerate are imported inside the functions that need them.
"""

from __future__ import annotations

from . import accelerate_api, torch_api, transformers_api
from .accelerate_api import accelerator_models, accelerator_optimizers, accelerator_registry, is_accelerate_prepared
from .torch_api import (AllGather, ReduceScatter, apply_activation_checkpointing, default_store, drop_pending_gather,
                        fresh_grad_scaler_state, fsdp_param_group, fsdp_param_groups, group_gathered_bytes,
                        group_is_sharded, group_parameters, group_reshards_after_forward, group_shard_world_size,
                        hsdp_mesh_info, in_backward, keep_all_gathered, local_tensor, observe_gradient_reduction,
                        post_forward_mesh_info_override,
                        process_group_timeout, queue_backward_callback, raise_recompile_limit, set_post_forward_mesh_info,
                        set_unshard_async_op, threaded_process_groups, uncompiled, unshard_all)
from .transformers_api import (TrainerHooks, build_from_config, default_load_dtype_is_auto, extend_valid_dict_fields,
                               hub_kernels_by_default, init_non_persistent_buffers, no_split_modules,
                               run_init_with_hooks, trainer_accelerator_class, trainer_save)

UPSTREAM: dict[str, str] = {**torch_api.UPSTREAM, **transformers_api.UPSTREAM, **accelerate_api.UPSTREAM}

__all__ = sorted(UPSTREAM)
