"""transformers internals hf_zeropp reaches into: model-init hooks, the Trainer's private save/load/move methods and
the Accelerator class it instantiates, TrainingArguments' dict fields (checked on transformers 4.56.1 - 5.25; TRL's
trainers reach hf_zeropp through the same Trainer hooks, which they inherit)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# entry -> the upstream symbol it reaches into (named in tests/compat/test_compat.py's failure messages)
UPSTREAM: dict[str, str] = {
    "no_split_modules": "transformers.PreTrainedModel._no_split_modules",
    "run_init_with_hooks": "transformers.PreTrainedModel._initialize_weights (+ initialize_weights)",
    "init_non_persistent_buffers": "transformers.PreTrainedModel._init_weights",
    "trainer_accelerator_class": "transformers.trainer.Accelerator (looked up by "
                                 "Trainer.create_accelerator_and_postprocess)",
    "TrainerHooks": "transformers.Trainer._move_model_to_device, ._save_optimizer_and_scheduler, "
                    "._load_optimizer_and_scheduler, ._load_from_checkpoint, ._load_best_model",
    "trainer_save": "transformers.Trainer._save",
    "extend_valid_dict_fields": "transformers.TrainingArguments._VALID_DICT_FIELDS",
    "build_from_config": "transformers.PreTrainedModel._from_config (AutoModel*.from_config for auto classes)",
    "default_load_dtype_is_auto": "transformers.PreTrainedModel.from_pretrained's dtype default",
    "hub_kernels_by_default": "transformers.integrations.hub_kernels._kernels_enabled (from_pretrained's "
                              "use_kernels default)",
}


# ---------------------------------------------------------------- transformers (checked on 4.56.1 - 5.23)

# checked: transformers 4.56.1 - 5.23
def no_split_modules(model: nn.Module) -> list[str]:
    """``PreTrainedModel._no_split_modules``: the layer class names that must stay whole (FSDP units); [] if none."""
    return list(getattr(model, "_no_split_modules", None) or [])


# checked: transformers 4.56.1 - 5.23 (5.x passes _initialize_weights an extra is_custom_code argument)
def run_init_with_hooks(model: nn.Module, before: Callable[[nn.Module], None],
                        after: Callable[[nn.Module], None]) -> None:
    """Run transformers' ``model.initialize_weights()`` with every sub-model's private per-module
    ``_initialize_weights`` wrapped in ``before(module)`` / ``after(module)`` (transformers' own traversal,
    children first, each sub-model with its own ``_init_weights``)."""
    from transformers import PreTrainedModel

    wrapped = [m for m in model.modules() if isinstance(m, PreTrainedModel)]

    def wrap(original: Callable) -> Callable:
        def initialize(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            before(module)
            original(module, *args, **kwargs)
            after(module)
        return initialize

    for sub in wrapped:
        sub._initialize_weights = wrap(sub._initialize_weights)
    try:
        model.initialize_weights()
    finally:
        for sub in wrapped:
            del sub._initialize_weights


# checked: transformers 4.56.1 - 5.23
@contextlib.contextmanager
def trainer_accelerator_class(factory: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, ``transformers.trainer.Accelerator`` (the module global that
    ``Trainer.create_accelerator_and_postprocess`` instantiates) is ``factory``."""
    import transformers.trainer as trainer_module

    original = trainer_module.Accelerator
    trainer_module.Accelerator = factory
    try:
        yield
    finally:
        trainer_module.Accelerator = original


# checked: transformers 4.56.1 - 5.23; TRL 0.23 - 1.16 (SFT/DPO/GRPO trainers inherit these or, GRPOTrainer's
# _load_optimizer_and_scheduler in 1.16, override them with the same signature)
class TrainerHooks:
    """Overrides of five private ``transformers.Trainer`` methods, each handed to an hf_zeropp-named method with
    the next class's implementation: ``_move_model_to_device`` -> ``_zeropp_move_model_to_device``,
    ``_save_optimizer_and_scheduler`` -> ``_zeropp_save_optimizer_and_scheduler``, ``_load_optimizer_and_scheduler``
    -> ``_zeropp_load_optimizer_and_scheduler``, ``_load_from_checkpoint`` -> ``_zeropp_load_from_checkpoint``,
    ``_load_best_model`` -> ``_zeropp_load_best_model``. Put it right before the Trainer class in the bases."""

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        return self._zeropp_move_model_to_device(model, device, super()._move_model_to_device)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        return self._zeropp_save_optimizer_and_scheduler(output_dir, super()._save_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        return self._zeropp_load_optimizer_and_scheduler(checkpoint, super()._load_optimizer_and_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        return self._zeropp_load_from_checkpoint(resume_from_checkpoint, model, super()._load_from_checkpoint)

    def _load_best_model(self) -> None:
        return self._zeropp_load_best_model(super()._load_best_model)


# checked: transformers 4.56.1 - 5.23
def trainer_save(trainer: Any, output_dir: str, state_dict: dict[str, Any]) -> None:
    """``Trainer._save(output_dir, state_dict=...)``: writes the model (on rank 0 only), tokenizer and args."""
    trainer._save(output_dir, state_dict=state_dict)


# checked: transformers 5.23 (older versions leave the buffers unset; callers fall back)
def init_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Give the non-persistent buffers that are on the meta device (a model loaded with ``device_map="meta"``)
    real values on the CPU, computed by transformers' per-module ``_init_weights`` of the sub-model that owns them
    (rotary frequencies); returns the names it left unset."""
    from transformers import PreTrainedModel

    unset = []

    def visit(module: nn.Module, owner: PreTrainedModel | None, prefix: str) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        names = [name for name in getattr(module, "_non_persistent_buffers_set", ())
                 if module._buffers.get(name) is not None and module._buffers[name].is_meta]
        if names:
            for name in names:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            versions = {name: module._buffers[name]._version for name in names}
            if owner is not None:
                with torch.no_grad():
                    owner._init_weights(module)
            unset.extend(prefix + name for name in names if module._buffers[name]._version == versions[name])
        for child_name, child in module.named_children():
            visit(child, owner, f"{prefix}{child_name}.")

    visit(model, None, "")
    return unset


# checked: transformers 4.56.1 - 5.23
def extend_valid_dict_fields(new_class: type, base_class: type, name: str) -> None:
    """Set ``new_class._VALID_DICT_FIELDS`` to the base's plus ``name``: TrainingArguments parses the fields listed
    there from JSON strings (``--zeropp '{"stage": 3}'``)."""
    new_class._VALID_DICT_FIELDS = [*base_class._VALID_DICT_FIELDS, name]


__all__ = sorted(UPSTREAM)


# checked: transformers 4.56.1 - 5.25 (5.x names the argument dtype, 4.x torch_dtype)
def build_from_config(model_class: Any, config: Any, *, dtype: torch.dtype, attn_implementation: str | None,
                      trust_remote_code: bool | None, **model_kwargs: Any) -> nn.Module:
    """``model_class`` (a ``PreTrainedModel`` subclass or an ``AutoModel*`` class) built from ``config`` in
    ``dtype``, as ``from_pretrained`` builds it before loading weights (under the caller's device context)."""
    from transformers import PreTrainedModel

    dtype_key = "dtype" if default_load_dtype_is_auto() else "torch_dtype"
    options = {dtype_key: dtype, **model_kwargs}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
        return model_class._from_config(config, **options)
    if trust_remote_code is not None:
        options["trust_remote_code"] = trust_remote_code
    return model_class.from_config(config, **options)


# checked: transformers 4.56.1 - 5.25
def default_load_dtype_is_auto() -> bool:
    """Whether ``from_pretrained`` without ``dtype`` loads in the checkpoint's dtype (``"auto"``, transformers 5) or
    in torch's default dtype (4.x)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).major >= 5


# checked: transformers 4.56.1 - 5.25 (5.25 made _kernels_enabled a function and use_kernels default to it)
def hub_kernels_by_default() -> bool:
    """Whether ``from_pretrained`` kernelizes a model whose caller did not pass ``use_kernels``: since transformers
    5.25 it does, unless ``USE_HUB_KERNELS`` says no; before, ``_kernels_enabled`` was a module flag that only
    allowed an explicit ``use_kernels=True``."""
    try:
        from transformers.integrations import hub_kernels
        from transformers.utils import is_kernels_available
    except ImportError:
        return False
    enabled = getattr(hub_kernels, "_kernels_enabled", None)
    return callable(enabled) and is_kernels_available() and bool(enabled())
