"""DeepSpeed configs as hf_zeropp options: which ``zero_optimization`` keys map onto which option, which only tune
DeepSpeed's own engine (ignored, with a warning), and which cannot be honoured (an error naming the key)."""

from __future__ import annotations

import warnings
from typing import Any

# DeepSpeed zero_optimization keys hf_zeropp maps onto its own fields.
MAPPED = {
    "stage": "stage",
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_gradients": "quantized_gradients",
    "zero_quantized_nontrainable_weights": "quantized_nontrainable_weights",
}
# DeepSpeed keys that only tune DeepSpeed's own buffers and scheduling; FSDP2 has its own, so they are ignored.
TUNING_ONLY = {
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", "memory_efficient_linear",
    "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
}
# Top-level DeepSpeed keys that belong to the training loop (Trainer/Accelerate own them), not to sharding.
TRAINER_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "communication_data_type", "prescale_gradients", "gradient_predivide_factor", "flops_profiler",
    "activation_checkpointing", "tensorboard", "wandb", "csv_monitor", "amp", "zero_force_ds_cpu_optimizer",
}


def options_from_deepspeed(ds_config: dict[str, Any]) -> dict[str, Any]:
    """hf_zeropp option values from a DeepSpeed config's ZeRO(++) keys; DeepSpeed-only tuning keys are ignored with a
    warning, and keys whose meaning hf_zeropp cannot honour raise."""
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise TypeError(f"zero_optimization must be a mapping, got {type(zero).__name__}")
    values: dict[str, Any] = {}
    ignored = []
    for key, value in zero.items():
        if key in MAPPED:
            values[MAPPED[key]] = value
        elif key in ("offload_optimizer", "offload_param"):
            device = (value or {}).get("device", "none") if isinstance(value, dict) else value
            if device not in (None, "none"):
                raise ValueError(
                    f"zero_optimization.{key}.device={device!r} (CPU/NVMe offload) is not supported by hf_zeropp; "
                    f"remove {key} from the DeepSpeed config"
                )
        elif key in TUNING_ONLY:
            ignored.append(key)
        else:
            raise ValueError(
                f"zero_optimization.{key} has no hf_zeropp equivalent; remove it (mapped keys: "
                f"{sorted(MAPPED)})"
            )
    # "auto" (as Hugging Face's DeepSpeed configs write it) leaves the precision to the Trainer / Accelerate
    enabled = [p for p in ("bf16", "fp16")
               if isinstance(ds_config.get(p), dict) and ds_config[p].get("enabled") is True]
    if len(enabled) > 1:
        raise ValueError("the DeepSpeed config enables both bf16 and fp16; enable one of them")
    if enabled:
        values["mixed_precision"] = enabled[0]
    for key in ds_config:
        if key not in ("zero_optimization", "bf16", "fp16") and key not in TRAINER_KEYS:
            raise ValueError(f"DeepSpeed config key {key!r} cannot be mapped to hf_zeropp; remove it")
    if values.get("hpz_partition_size") == 1:
        values.pop("hpz_partition_size")
    if ignored:
        warnings.warn(f"hf_zeropp ignores DeepSpeed-only tuning keys {sorted(ignored)}", stacklevel=3)
    return values
