"""DeepSpeed configs as hf_zeropp options, key by key: what maps onto an hf_zeropp option, what is carried to the
training loop (optimizer, scheduler, clipping, batch sizes, loss scaling: :mod:`hf_zeropp.interop.deepspeed.training`
applies them as DeepSpeed does), what only tunes DeepSpeed's own engine or its logging (ignored, with one warning
naming the keys), and what cannot be honoured (an error naming the key and the alternative). Every key of a
DeepSpeed config falls in exactly one of these tables; docs/design.md prints them."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from .optim import check_optimizer, check_scheduler

# zero_optimization keys hf_zeropp maps onto its own fields.
MAPPED = {
    "stage": "stage",
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_gradients": "quantized_gradients",
    "zero_quantized_nontrainable_weights": "quantized_nontrainable_weights",
}
# zero_optimization keys of stage 3's memory knobs, mapped at stage 3 (at stages 0-2 DeepSpeed does not read them:
# ignored with the warning). A stage-3 config that leaves one out gets DeepSpeed's default (DeepSpeedZeroConfig),
# so that it keeps, replicates and prefetches what DeepSpeed would.
STAGE3_MAPPED = {
    "stage3_max_live_parameters": ("max_live_parameters", 10**9),
    "stage3_max_reuse_distance": ("max_reuse_distance", 10**9),
    "stage3_param_persistence_threshold": ("persistence_threshold", 10**5),
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", 5 * 10**7),
}
# the options a stage-3 DeepSpeed config without these keys maps to
STAGE3_DEFAULTS = {option: default for option, default in STAGE3_MAPPED.values()}
# zero_optimization keys that only tune DeepSpeed's own buffers and scheduling; FSDP2 has its own, so they are ignored.
TUNING_ONLY = {
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "round_robin_gradients", "sub_group_size", "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", "memory_efficient_linear",
    "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
}
# zero_optimization.offload_* keys: "device: cpu" is FSDP2's CPUOffloadPolicy (``cpu_offload``), which offloads the
# sharded parameters, their gradients and the optimizer state together; these tune DeepSpeed's own offload engine.
OFFLOAD = ("offload_optimizer", "offload_param")
OFFLOAD_TUNING = {"pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write",
                  "fast_init", "cpuadam_cores_perc", "nvme_path"}
# Top-level keys the training loop applies as DeepSpeed's engine would (carried as ``deepspeed_training``).
TRAINING_LOOP = ("optimizer", "scheduler", "gradient_clipping", "gradient_accumulation_steps", "train_batch_size",
                 "train_micro_batch_size_per_gpu", "fp16", "bf16")
# fp16 keys: the loss scaler's (DeepSpeed's dynamic scaler, with hysteresis and a floor) and the switch itself
FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"}
# Top-level keys that steer only DeepSpeed's logging, profiling, checkpoint engine or launcher: nothing here trains
# differently without them.
ENGINE_ONLY = {
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "flops_profiler", "comms_logger",
    "tensorboard", "wandb", "csv_monitor", "comet", "timers", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "checkpoint", "aio", "autotuning", "dataloader_drop_last", "disable_python_gc",
    "log_level", "seq_parallel_communication_data_type", "zero_allow_comm_data_type_fp32",
}
# Top-level keys that change how gradients are averaged, not what they average to (in fp32, rounding only):
# hf_zeropp divides once, after reducing in fp32. Ignored with a warning unless they hold DeepSpeed's default.
AVERAGING = {"prescale_gradients": False, "gradient_predivide_factor": 1.0}
# communication_data_type -> hf_zeropp's reduce_dtype
COMMUNICATION_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
# Sections that hf_zeropp cannot honour once enabled: what to use instead.
REFUSED_WHEN_ENABLED = {
    "amp": "apex AMP; use fp16 or bf16 (the Trainer's --fp16 / --bf16)",
    "torch_autocast": "DeepSpeed's autocast; use bf16 or fp16 (mixed_precision)",
    "activation_checkpointing": "DeepSpeed's checkpointing API (deepspeed.checkpointing); use the Trainer's "
                                "--gradient_checkpointing or hf_zeropp's activation_checkpointing: true",
    "sparse_attention": "DeepSpeed's sparse attention kernels; remove it",
    "pipeline": "pipeline parallelism; hf_zeropp is data parallel (ZeRO)",
    "tensor_parallel": "tensor parallelism; hf_zeropp is data parallel (ZeRO)",
    "elasticity": "DeepSpeed's elastic batch sizes; set the batch size and use hf-zeropp launch --max_restarts",
    "compression_training": "DeepSpeed's compression library; remove it",
    "data_efficiency": "DeepSpeed's data sampling library; remove it",
    "curriculum_learning": "DeepSpeed's curriculum learning; remove it",
    "progressive_layer_drop": "DeepSpeed's progressive layer drop; remove it",
    "eigenvalue": "DeepSpeed's eigenvalue computation; remove it",
    "quantize_training": "DeepSpeed's quantization-aware training; remove it",
    "hybrid_engine": "DeepSpeed's RLHF hybrid engine; use TRL behind the Trainer integration",
    "compile": "DeepSpeed's compile; call torch.compile in the script",
    "sparse_gradients": "DeepSpeed's sparse embedding gradients; remove it",
    "data_types": "DeepSpeed's gradient-accumulation dtype; hf_zeropp accumulates gradients in fp32",
}


def options_from_deepspeed(ds_config: dict[str, Any]) -> dict[str, Any]:
    """hf_zeropp option values from a DeepSpeed config: its ZeRO(++) and offload keys, its precision and
    communication dtype, and its training-loop sections as ``deepspeed_training``. DeepSpeed-only keys are ignored
    with one warning; keys whose meaning hf_zeropp cannot honour raise."""
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise TypeError(f"zero_optimization must be a mapping, got {type(zero).__name__}")
    values: dict[str, Any] = {}
    ignored = [f"zero_optimization.{key}" for key in _zero_options(zero, values)]
    enabled = [p for p in ("bf16", "fp16") if _enabled(ds_config.get(p)) is True]
    if len(enabled) > 1:
        raise ValueError("the DeepSpeed config enables both bf16 and fp16; enable one of them")
    if enabled:
        values["mixed_precision"] = enabled[0]
    ignored += _top_level_options(ds_config, values)
    training = {key: copy.deepcopy(ds_config[key]) for key in TRAINING_LOOP if key in ds_config}
    check_training_sections(training)
    if any(key not in ("bf16",) for key in training):  # bf16 alone asks nothing of the training loop
        values["deepspeed_training"] = training
    if values.get("hpz_partition_size") == 1:
        values.pop("hpz_partition_size")
    if ignored:
        warnings.warn(f"hf_zeropp ignores DeepSpeed-only tuning keys {sorted(ignored)}", stacklevel=3)
    return values


def _zero_options(zero: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """Map ``zero_optimization`` into ``values``; returns the keys ignored."""
    ignored = []
    for key, value in zero.items():
        if key in MAPPED:
            values[MAPPED[key]] = value
        elif key in STAGE3_MAPPED:
            continue  # below, once the stage is known
        elif key in OFFLOAD:
            ignored += [f"{key}.{name}" for name in _offload(key, value, values)]
        elif key in TUNING_ONLY:
            if value not in (None, False):  # a switched-off tuning asks nothing: not worth a warning
                ignored.append(key)
        else:
            raise ValueError(
                f"zero_optimization.{key} has no hf_zeropp equivalent; remove it (mapped keys: "
                f"{sorted(MAPPED)}, plus {list(OFFLOAD)} with device cpu)"
            )
    if values.get("stage", 3) != 3:
        return ignored + sorted(key for key in STAGE3_MAPPED if zero.get(key) not in (None, False))
    for key, (option, deepspeed_default) in STAGE3_MAPPED.items():
        values[option] = _stage3_value(key, zero.get(key, deepspeed_default))
    return ignored


def _stage3_value(key: str, value: Any) -> int | str:
    """A stage-3 knob's value as an element count (DeepSpeed configs write 1e9 as a float), or "auto" where
    Transformers fills it from the model's hidden size."""
    if value == "auto" and key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ValueError(f"zero_optimization.{key}={value!r} must be a whole number of elements >= 0"
                         + (' or "auto"' if key in ("stage3_param_persistence_threshold",
                                                     "stage3_prefetch_bucket_size") else
                            " (Transformers fills no \"auto\" here; DeepSpeed's default is 1e9)"))
    return int(value)


def _offload(key: str, section: Any, values: dict[str, Any]) -> list[str]:
    """``offload_optimizer`` / ``offload_param``: device cpu becomes ``cpu_offload``; returns the tuning keys set."""
    section = section if isinstance(section, dict) else {"device": section}
    device = str(section.get("device") or "none").lower()
    if device == "nvme":
        raise ValueError(f"zero_optimization.{key}.device='nvme' (NVMe offload) is not supported by hf_zeropp; use "
                         f"device 'cpu' (FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state in CPU "
                         f"memory) or remove {key}")
    if device not in ("cpu", "none"):
        raise ValueError(f"zero_optimization.{key}.device={section.get('device')!r} is not a DeepSpeed offload "
                         f"device; use 'cpu' or 'none'")
    ratio = section.get("ratio", 1.0)
    if device == "cpu" and ratio != 1.0:
        raise ValueError(f"zero_optimization.{key}.ratio={ratio} offloads part of the optimizer state, which FSDP2 "
                         f"cannot; remove ratio (offload all of it) or remove {key}")
    unknown = set(section) - OFFLOAD_TUNING - {"device", "ratio"}
    if unknown:
        raise ValueError(f"zero_optimization.{key} has keys {sorted(unknown)} that DeepSpeed does not define; remove "
                         f"them")
    if device == "cpu":
        values["cpu_offload"] = True
    return sorted(k for k in set(section) & OFFLOAD_TUNING if section[k] is not None) if device == "cpu" else []


def _top_level_options(ds_config: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """Map or classify every top-level key but ``zero_optimization`` and the training loop's; returns those
    ignored."""
    ignored = []
    for key, value in ds_config.items():
        if key in ("zero_optimization", *TRAINING_LOOP):
            continue
        if key == "communication_data_type":
            if value is not None:
                if value not in COMMUNICATION_DTYPES:
                    raise ValueError(f"communication_data_type={value!r} is not one of DeepSpeed's "
                                     f"{sorted(COMMUNICATION_DTYPES)}")
                values["reduce_dtype"] = COMMUNICATION_DTYPES[value]
        elif key == "bfloat16":
            raise ValueError("the DeepSpeed config's 'bfloat16' section is the old spelling of 'bf16'; rename it bf16")
        elif key in AVERAGING:
            if value != AVERAGING[key]:
                ignored.append(key)
        elif key in ENGINE_ONLY:
            if value not in (None, False):
                ignored.append(key)
        elif key in REFUSED_WHEN_ENABLED:
            if _enabled(value) is not False:
                raise ValueError(f"DeepSpeed config key {key!r} ({REFUSED_WHEN_ENABLED[key]}) cannot be mapped to "
                                 f"hf_zeropp; remove it")
        else:
            raise ValueError(f"DeepSpeed config key {key!r} cannot be mapped to hf_zeropp; remove it")
    return ignored


def _enabled(section: Any) -> bool | str | None:
    """A section's ``enabled`` value (True, False or "auto"); None where the section does not say."""
    if isinstance(section, dict):
        value = section.get("enabled")
        return value if value in (True, False, "auto") else None if value is None else bool(value)
    return None


def check_training_sections(training: dict[str, Any]) -> None:
    """What can be checked of the training-loop sections before "auto" is filled: optimizer and scheduler types and
    parameters (:mod:`hf_zeropp.interop.deepspeed.optim`), the fp16 loss-scale keys, and that numbers are numbers."""
    if "optimizer" in training:
        check_optimizer(training["optimizer"])
    if "scheduler" in training:
        check_scheduler(training["scheduler"])
    fp16 = training.get("fp16")
    if isinstance(fp16, dict) and set(fp16) - FP16_KEYS:
        raise ValueError(f"fp16 has keys {sorted(set(fp16) - FP16_KEYS)} hf_zeropp cannot map (it maps "
                         f"{sorted(FP16_KEYS)}); remove them")
    for key in ("gradient_clipping", "gradient_accumulation_steps", "train_batch_size",
                "train_micro_batch_size_per_gpu"):
        value = training.get(key)
        if value is not None and value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"DeepSpeed config {key}={value!r} must be a number or \"auto\"")


def deepspeed_key_table() -> str:
    """docs/design.md's table of every DeepSpeed config key: mapped, ignored with a warning, or
    refused."""
    rows = ["| DeepSpeed key | on hf_zeropp |", "|---|---|"]
    rows += [f"| `{key}` | {fate} |" for key, fate in _key_fates()]
    rows.append("| any other key | refused: named, with the keys hf_zeropp maps |")
    return "\n".join(rows)


def _key_fates() -> list[tuple[str, str]]:
    rows = [(f"zero_optimization.{key}", f"mapped: `{option}`") for key, option in MAPPED.items()]
    rows += [(f"zero_optimization.{key}", f"mapped at stage 3: `{option}` (absent: DeepSpeed's default "
                                          f"{_power_of_ten(default)}); ignored with a warning at stages 0-2")
             for key, (option, default) in STAGE3_MAPPED.items()]
    rows += [(f"zero_optimization.{key}.device", "cpu: mapped to `cpu_offload` (FSDP2 CPUOffloadPolicy); nvme: "
                                                "refused") for key in OFFLOAD]
    rows += [(f"zero_optimization.{key}.ratio", "1.0 only (partial offload refused)") for key in OFFLOAD]
    rows += [(f"zero_optimization.{key}.{name}", "ignored with a warning (DeepSpeed's offload engine)")
             for key in OFFLOAD for name in sorted(OFFLOAD_TUNING)]
    rows += [(f"zero_optimization.{key}", "ignored with a warning (DeepSpeed's buffers)")
             for key in sorted(TUNING_ONLY)]
    rows += [("bf16.enabled / fp16.enabled", "mapped: `mixed_precision` (\"auto\": the Trainer's / Accelerator's)"),
             ("communication_data_type", "mapped: `reduce_dtype`")]
    rows += [(key, "training loop: applied as DeepSpeed does (hf_zeropp.interop.deepspeed.training)")
             for key in TRAINING_LOOP if key != "bf16"]
    rows += [(key, f"ignored with a warning unless {value!r} (hf_zeropp averages once, in fp32)")
             for key, value in AVERAGING.items()]
    rows += [(key, "ignored with a warning (DeepSpeed's logging, profiling or checkpoint engine)")
             for key in sorted(ENGINE_ONLY)]
    rows += [(key, f"refused unless enabled: false ({why})") for key, why in REFUSED_WHEN_ENABLED.items()]
    return rows


def _power_of_ten(value: int) -> str:
    """1000000000 as DeepSpeed's docs write it: 1e9."""
    mantissa, exponent = f"{value:.0e}".split("e+")
    return f"{mantissa}e{int(exponent)}"
