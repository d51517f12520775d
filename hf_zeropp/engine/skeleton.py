"""The empty model that :func:`hf_zeropp.from_pretrained` shards before each rank reads its slices.

``from_pretrained(path, device_map="meta")`` was the obvious way to get it, but transformers does not support it:
since 5.25 ``from_pretrained`` kernelizes the model for the device it is placed on, and the Hub-kernels library
refuses ``meta`` (and transformers has steered users away from meta loading before). The supported way to build a
model without memory is the one Accelerate documents for big models: the model class built from its config under
``torch.device("meta")``. Everything ``from_pretrained`` would decide besides the weights is decided here the same
way, so the skeleton has the names, shapes and dtypes stock loading gives (``tests/engine/test_skeleton.py`` compares
them):

* the config, with ``from_pretrained``'s extra keyword arguments applied to it as transformers applies them;
* the dtype: the one asked for, or ``"auto"`` (transformers 5's default) resolved from the config, else from the
  stored tensors; modules ``_keep_in_fp32_modules`` names stay float32 where transformers keeps them so;
* evaluation mode and the saved generation config, as ``from_pretrained`` returns the model;
* Hub kernels, where the user's ``use_kernels`` (transformers' default included) asks for them: the skeleton is
  kernelized for the device the ranks compute on, which transformers caches for later re-kernelizations
  (``model.train()``). Kernelizing swaps layer forwards only; it reads no weights, so doing it before the shards
  exist is what transformers itself does for offloaded models.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._compat import build_from_config, default_load_dtype_is_auto, hub_kernels_by_default
from ..interop.hf_checkpoint import SafetensorsFolder

# from_pretrained's own arguments (the rest go to the config, then to the model's constructor); hub arguments are
# passed on to the config's and generation config's own from_pretrained
_HUB = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies",
        "trust_remote_code", "code_revision")
_LOADING = ("ignore_mismatched_sizes", "use_safetensors", "weights_only", "low_cpu_mem_usage", "output_loading_info",
            "variant", "key_mapping", "_fast_init", "disable_mmap", "_from_auto", "_from_pipeline", "_commit_hash",
            "adapter_name", "adapter_kwargs")
_KERNELS = ("use_kernels", "kernel_config", "kernels_mode")
_UNSUPPORTED = ("quantization_config", "tp_plan", "tp_size", "device_mesh", "distributed_config", "max_memory",
                "offload_folder", "offload_state_dict", "offload_buffers", "gguf_file", "state_dict", "load_in_8bit",
                "load_in_4bit", "allow_all_kernels")


def build_skeleton(model_class: Any, name_or_path: str | os.PathLike, folder: SafetensorsFolder | None,
                   *args: Any, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(name_or_path, *args, **kwargs)`` as an empty model on the meta device."""
    from transformers import AutoConfig, GenerationConfig, PreTrainedModel

    if args:
        raise ValueError("hf_zeropp.from_pretrained passes keyword arguments on to the model; give the "
                         f"{len(args)} positional model argument(s) by name")
    refused = [key for key in _UNSUPPORTED if kwargs.get(key) not in (None, False)]
    if (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path"):  # the path holds a PEFT adapter
        refused.insert(0, "adapter_kwargs")
    if refused:
        raise ValueError(f"hf_zeropp.from_pretrained reads each rank's slices of plain weights; {refused[0]} "
                         f"(given a {type(kwargs[refused[0]]).__name__}) changes how from_pretrained loads them. Call "
                         f"{getattr(model_class, '__name__', model_class)}.from_pretrained on every rank instead and "
                         f"pass the model to hf_zeropp.shard_model")
    hub = {key: kwargs.pop(key) for key in _HUB if key in kwargs}
    for key in (*_LOADING, *_UNSUPPORTED):  # loading arguments, and the unsupported ones left at their defaults
        kwargs.pop(key, None)
    generation_config = kwargs.pop("generation_config", None)
    kernels = {key: kwargs.pop(key) for key in _KERNELS if key in kwargs}
    requested_dtype = kwargs.pop("dtype", None)
    legacy_dtype = kwargs.pop("torch_dtype", None)
    requested_dtype = requested_dtype if requested_dtype is not None else legacy_dtype
    attn_implementation = kwargs.pop("attn_implementation", None)

    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config_class = AutoConfig if not _is_model_class(model_class) else model_class.config_class
        config, kwargs = config_class.from_pretrained(config or name_or_path, return_unused_kwargs=True, **hub,
                                                      **kwargs)
    else:
        config = copy.deepcopy(config)
    dtype = _resolve_dtype(requested_dtype, config, folder)
    with torch.device("meta"):
        model = build_from_config(model_class, config, dtype=dtype, attn_implementation=attn_implementation,
                                  trust_remote_code=hub.get("trust_remote_code"), **kwargs)
    _keep_in_float32(model, dtype)
    model.eval()
    if generation_config is not None:
        model.generation_config = generation_config
    elif isinstance(model, PreTrainedModel) and model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(name_or_path, **hub)
        except OSError:  # no generation_config.json: the one built from the model config stays, as in from_pretrained
            pass
    _kernelize(model, kernels)
    return model


def _is_model_class(model_class: Any) -> bool:
    from transformers import PreTrainedModel

    return isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)


def _resolve_dtype(requested: Any, config: Any, folder: SafetensorsFolder | None) -> torch.dtype:
    """The dtype ``from_pretrained`` loads in: the requested one; for ``"auto"`` the config's, else the stored
    tensors'; for nothing, ``"auto"`` where transformers defaults to it (5.x), else torch's default dtype."""
    if requested is None:
        requested = "auto" if default_load_dtype_is_auto() else torch.get_default_dtype()
    if isinstance(requested, torch.dtype):
        return requested
    if requested != "auto":
        resolved = getattr(torch, str(requested), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype={requested!r} is not a torch dtype; pass one (torch.bfloat16, 'bfloat16') or "
                             f"'auto'")
        return resolved
    stated = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if stated is not None:
        return stated if isinstance(stated, torch.dtype) else getattr(torch, str(stated))
    stored = folder.first_floating_dtype() if folder is not None else None
    return stored or torch.get_default_dtype()


def _keep_in_float32(model: nn.Module, dtype: torch.dtype) -> None:
    """transformers keeps ``_keep_in_fp32_modules`` in float32 under float16, and ``..._strict`` under float16 and
    bfloat16: the same parameters are float32 here."""
    names = list(getattr(model, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    if dtype in (torch.float16, torch.bfloat16):
        names += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if not names:
        return
    for module_name, module in model.named_modules():
        if any(name in module_name.split(".") for name in names):
            module.to(torch.float32)


def _kernelize(model: nn.Module, kernels: dict[str, Any]) -> None:
    """Hub kernels as ``from_pretrained`` applies them (its default included), for the ranks' compute device."""
    use_kernels = kernels.get("use_kernels")
    if use_kernels is None:
        use_kernels = hub_kernels_by_default()
    if not use_kernels or not hasattr(model, "set_use_kernels"):
        return
    device = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    model.set_use_kernels(True, kernels.get("kernel_config"), kernels.get("kernels_mode"), {"": device})
