"""accelerate internals hf_zeropp reaches into: the registry of prepared models and optimizers and the flag
``prepare`` sets (checked on accelerate 1.10 - 1.15)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# entry -> the upstream symbol it reaches into (named in tests/compat/test_compat.py's failure messages)
UPSTREAM: dict[str, str] = {
    "is_accelerate_prepared": "accelerate: the _is_accelerate_prepared flag Accelerator.prepare sets",
    "accelerator_models": "accelerate.Accelerator._models",
    "accelerator_optimizers": "accelerate.Accelerator._optimizers",
    "accelerator_registry": "accelerate.Accelerator._models / ._optimizers (assigned)",
}


# ---------------------------------------------------------------- accelerate (checked on 1.10 - 1.15)

# checked: accelerate 1.10 - 1.15
def is_accelerate_prepared(obj: Any) -> bool:
    """The private ``_is_accelerate_prepared`` flag that ``Accelerator.prepare`` sets on what it returns."""
    return getattr(obj, "_is_accelerate_prepared", False)


# checked: accelerate 1.10 - 1.15
def accelerator_models(accelerator: Any) -> list:
    """``Accelerator._models``, the live list of prepared models (save_state, clip_grad_norm_ and
    get_state_dict walk it)."""
    return accelerator._models


# checked: accelerate 1.10 - 1.15
def accelerator_optimizers(accelerator: Any) -> list:
    """``Accelerator._optimizers``, the live list of prepared (wrapped) optimizers."""
    return accelerator._optimizers


# checked: accelerate 1.10 - 1.15
@contextlib.contextmanager
def accelerator_registry(accelerator: Any, models: list, optimizers: list) -> Iterator[None]:
    """Inside the block ``Accelerator._models`` / ``_optimizers`` are ``models`` / ``optimizers`` (the originals
    come back after): hides sharded models from Accelerate's own save_state/load_state."""
    original_models, original_optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = models, optimizers
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = original_models, original_optimizers


__all__ = sorted(UPSTREAM)
