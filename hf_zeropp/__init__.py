"""hf_zeropp: ZeRO stage 1-3 sharding and the ZeRO++ communication optimizations (qwZ, hpZ, qgZ) on torch FSDP2,
for Hugging Face Accelerate, the Transformers Trainer and TRL — without DeepSpeed.

The public names are imported on first use (PEP 562): ``hf-zeropp launch``, ``python -m hf_zeropp.integrations.dropin``
and any ``import hf_zeropp.<wing>.<module>`` load only what they need, instead of the Trainer, Accelerate and
DeepSpeed-checkpoint modules every time (about 3 s of a launcher's start). The modules live in wings by concern
(``kernels``, ``_compat``, ``testing``, ``interop``, ``config``, ``comm``, ``engine``, ``checkpoint``,
``integrations``; docs/design.md, "Map"); ``_MODULE_OF`` says where each public name is defined."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .engine.failure_report import install as _report_failures_to_the_launcher

__version__ = "0.1.0"

_report_failures_to_the_launcher()  # only in a torchrun worker: see hf_zeropp.engine.failure_report

_MODULE_OF: dict[str, str] = {
    "Accelerator": "integrations.accelerate_integration",
    "latest_checkpoint": "checkpoint.checkpoint",
    "load_checkpoint": "checkpoint.checkpoint",
    "save_checkpoint": "checkpoint.checkpoint",
    "save_pretrained": "checkpoint.checkpoint",
    "PRESETS": "config.config",
    "ZeroPPConfig": "config.config",
    "convert_deepspeed_checkpoint": "checkpoint.deepspeed_convert",
    "export_deepspeed_universal": "checkpoint.deepspeed_convert",
    "load_deepspeed_checkpoint": "checkpoint.deepspeed_restore",
    "compile_units": "engine.compile",
    "gathered_for_inference": "engine.inference",
    "from_pretrained": "engine.materialize",
    "active_techniques": "engine.runtime",
    "comm_stats": "engine.runtime",
    "gathered_parameter_bytes": "engine.runtime",
    "no_sync": "engine.runtime",
    "set_techniques": "engine.runtime",
    "state_bytes": "engine.runtime",
    "shard_model": "engine.sharding",
    "ZeroPPCallback": "integrations.trainer",
    "ZeroPPTrainer": "integrations.trainer",
    "ZeroPPTrainerMixin": "integrations.trainer",
    "ZeroPPTrainingArguments": "integrations.trainer",
    "with_zeropp_field": "integrations.trainer",
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
