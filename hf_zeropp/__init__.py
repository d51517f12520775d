"""hf_zeropp: ZeRO stage 1-3 sharding and the ZeRO++ communication optimizations (qwZ, hpZ, qgZ) on torch FSDP2,
for Hugging Face Accelerate, the Transformers Trainer and TRL — without DeepSpeed.

The public names are imported on first use (PEP 562): ``hf-zeropp launch``, ``python -m hf_zeropp.dropin`` and any
``import hf_zeropp.<module>`` load only what they need, instead of the Trainer, Accelerate and DeepSpeed-checkpoint
modules every time (about 3 s of a launcher's start)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .failure_report import install as _report_failures_to_the_launcher

__version__ = "0.1.0"

_report_failures_to_the_launcher()  # only in a torchrun worker: see hf_zeropp.failure_report

_MODULE_OF: dict[str, str] = {
    "Accelerator": "accelerate_integration",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "save_pretrained": "checkpoint",
    "PRESETS": "config",
    "ZeroPPConfig": "config",
    "convert_deepspeed_checkpoint": "deepspeed_convert",
    "export_deepspeed_universal": "deepspeed_convert",
    "load_deepspeed_checkpoint": "deepspeed_restore",
    "gathered_for_inference": "inference",
    "from_pretrained": "materialize",
    "active_techniques": "runtime",
    "comm_stats": "runtime",
    "gathered_parameter_bytes": "runtime",
    "no_sync": "runtime",
    "set_techniques": "runtime",
    "state_bytes": "runtime",
    "shard_model": "sharding",
    "ZeroPPCallback": "trainer",
    "ZeroPPTrainer": "trainer",
    "ZeroPPTrainerMixin": "trainer",
    "ZeroPPTrainingArguments": "trainer",
    "with_zeropp_field": "trainer",
}

__all__ = sorted([*_MODULE_OF, "__version__"])


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # hf_zeropp.kernels and the like, without an import
    else:
        raise AttributeError(f"module 'hf_zeropp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
