"""hf_zeropp: ZeRO stage 1-3 sharding and the ZeRO++ communication optimizations (qwZ, hpZ, qgZ) on torch FSDP2,
for Hugging Face Accelerate, the Transformers Trainer and TRL — without DeepSpeed."""

from .accelerate_integration import Accelerator
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_pretrained
from .config import PRESETS, ZeroPPConfig
from .deepspeed_convert import convert_deepspeed_checkpoint, export_deepspeed_universal
from .deepspeed_restore import load_deepspeed_checkpoint
from .failure_report import install as _report_failures_to_the_launcher
from .inference import gathered_for_inference
from .materialize import from_pretrained
from .runtime import active_techniques, comm_stats, gathered_parameter_bytes, no_sync, set_techniques, state_bytes
from .sharding import shard_model

__version__ = "0.1.0"

_report_failures_to_the_launcher()  # only in a torchrun worker: see hf_zeropp.failure_report

from .trainer import (  # noqa: E402  (needs transformers; imported last)
    ZeroPPCallback,
    ZeroPPTrainer,
    ZeroPPTrainerMixin,
    ZeroPPTrainingArguments,
    with_zeropp_field,
)

__all__ = [
    "Accelerator",
    "PRESETS",
    "ZeroPPCallback",
    "ZeroPPConfig",
    "ZeroPPTrainer",
    "ZeroPPTrainerMixin",
    "ZeroPPTrainingArguments",
    "active_techniques",
    "comm_stats",
    "convert_deepspeed_checkpoint",
    "export_deepspeed_universal",
    "from_pretrained",
    "gathered_for_inference",
    "gathered_parameter_bytes",
    "latest_checkpoint",
    "load_checkpoint",
    "load_deepspeed_checkpoint",
    "no_sync",
    "save_checkpoint",
    "save_pretrained",
    "set_techniques",
    "shard_model",
    "state_bytes",
    "with_zeropp_field",
    "__version__",
]
