"""The rules between hf_zeropp's options: which values and combinations ``ZeroPPConfig`` refuses, each with an error
that names the options, the reason and the fix. Checked when a config is built, before any process group exists;
the checks against a launch (world size, ranks per node) are :meth:`hf_zeropp.comm.topology.Topology.from_config`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from ..kernels.reference import MAX_HADAMARD, is_rotation_size

# Block sizes are kept to multiples of 8 so that every block starts 8-element aligned for vectorized kernels.
BLOCK_ALIGNMENT = 8
# ``*_until`` field -> the technique it switches off (set_techniques' keyword)
SCHEDULED_TECHNIQUES = {"quantized_weights_until": "quantized_weights", "hpz_until": "hpz",
                        "quantized_gradients_until": "quantized_gradients"}
# stage 3's memory knobs (DeepSpeed's stage3_* keys): off at 0 (prefetch_bucket_size: None)
STAGE3_KNOBS = ("max_live_parameters", "max_reuse_distance", "persistence_threshold", "prefetch_bucket_size")
# what ``shard_group: auto`` carries into the configuration it chooses (every other option comes from that preset)
AUTO_KEEPS = ("mixed_precision", "reduce_dtype", "wrap_modules", "activation_checkpointing", "cpu_offload",
              "generation_gather", "node_size", "kernel_backend", "block_size", "seed", "deepspeed_training")


def check_option_rules(config: Any) -> None:
    """Every rule below, in the order a user meets them."""
    _check_values(config)
    _check_gradient_hadamard(config)
    _check_error_feedback(config)
    _check_bit_allocation(config)
    _check_stage_supports_options(config)
    _check_weight_deltas(config)
    _check_hybrid(config)


def _check_values(config: Any) -> None:
    """Sizes, counts and fractions in range."""
    for name in ("block_size", "gradient_block_size"):
        value = getattr(config, name)
        if value is not None and (value < BLOCK_ALIGNMENT or value % BLOCK_ALIGNMENT):
            raise ValueError(
                f"{name}={value} must be a positive multiple of {BLOCK_ALIGNMENT} (the kernels' alignment), "
                f"e.g. {max(BLOCK_ALIGNMENT, -(-value // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT)}"
            )
    if config.qgz_pipeline_stages < 1:
        raise ValueError(f"qgz_pipeline_stages={config.qgz_pipeline_stages} must be >= 1")
    if config.node_size is not None and config.node_size < 1:
        raise ValueError(f"node_size={config.node_size} must be >= 1 (or None to detect it from the launch)")
    if isinstance(config.hpz_partition_size, int) and config.hpz_partition_size < 1:
        raise ValueError(f"hpz_partition_size={config.hpz_partition_size} must be >= 1 (1 turns hpZ off)")
    for name in STAGE3_KNOBS:
        value = getattr(config, name)
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{name}={value} must be >= 0 (a number of elements)")
    for name in SCHEDULED_TECHNIQUES:
        value = getattr(config, name)
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"{name}={value} must be a fraction of max_steps in (0, 1], e.g. 0.5")


def _check_hybrid(config: Any) -> None:
    on = [name for name, value in (("quantized_weights", config.quantized_weights),
                                   ("hpz_partition_size", config.hpz_partition_size != 1),
                                   ("quantized_gradients", config.quantized_gradients),
                                   ("hybrid_gradient_bits", config.hybrid_gradient_bits is not None)) if value]
    if config.shard_group == "auto" and (on or config.stage != 3):
        raise ValueError(f"shard_group='auto' (preset auto) chooses stage 3 and the techniques itself, but "
                         f"{', '.join(on) or f'stage={config.stage}'} is set; remove it, or name a preset instead")
    dropped = [f.name for f in fields(config) if f.name not in (*AUTO_KEEPS, "shard_group")
               and getattr(config, f.name) != default(f)] if config.shard_group == "auto" else []
    if dropped:
        raise ValueError(f"shard_group='auto' (preset auto) sets the techniques' options with the configuration "
                         f"it chooses, but {', '.join(dropped)} is set; remove it, or name a preset instead")
    if config.shard_group == "world" and "hybrid_gradient_bits" in on:
        raise ValueError(f"hybrid_gradient_bits={config.hybrid_gradient_bits} quantizes hybrid sharding's all-reduce,"
                         f" but shard_group='world'; set shard_group: node (preset hybrid-q) or remove it")
    zero_pp = [name for name in on if name != "hybrid_gradient_bits"]
    if config.shard_group == "node" and (zero_pp or config.stage == 0):
        raise ValueError(f"shard_group='node' (hybrid sharding) with {', '.join(zero_pp) or 'stage=0'}: no weights "
                         f"cross nodes under hybrid sharding, and gradients cross them in its all-reduce (quantize "
                         f"it with hybrid_gradient_bits); turn it off, or use shard_group: world (ZeRO++)")
    if config.shard_group == "node" and config.gradient_bit_allocation:
        raise ValueError("shard_group='node' (hybrid sharding) with gradient_bit_allocation: it acts on qgZ's "
                         "two-hop all-to-all, which hybrid sharding does not run; its quantized all-reduce "
                         "(hybrid_gradient_bits) takes gradient_hadamard, stochastic_rounding and "
                         "gradient_error_feedback. Turn it off, or use shard_group: world with quantized_gradients "
                         "(ZeRO++)")
    if config.shard_group == "node" and config.gradient_error_feedback and config.hybrid_gradient_bits is None:
        raise ValueError("shard_group='node' with gradient_error_feedback but no hybrid_gradient_bits: error "
                         "feedback compensates the quantization of the cross-node all-reduce, which runs in full "
                         "precision here; set hybrid_gradient_bits: 4 (preset hybrid-q) or turn it off")


def _check_weight_deltas(config: Any) -> None:
    if config.weight_deltas and not config.quantized_weights:
        raise ValueError("weight_deltas sends qwZ's forward gather as differences, but quantized_weights is off; set "
                         "quantized_weights: true (preset zeropp-deltas) or remove weight_deltas")


def _check_gradient_hadamard(config: Any) -> None:
    size = config.gradient_hadamard
    if not is_rotation_size(size):
        raise ValueError(f"gradient_hadamard={size} must be 0 (off) or a power of two up to {MAX_HADAMARD}; "
                         f"32-128 spreads outliers best, e.g. 64")
    block = config.gradient_block_size or config.block_size
    if size and block % size:
        name = "gradient_block_size" if config.gradient_block_size else "block_size"
        raise ValueError(f"{name}={block} is not a multiple of gradient_hadamard={size}: a rotation group may "
                         f"not straddle two quantization blocks; use {name}={-(-block // size) * size}")


def _check_error_feedback(config: Any) -> None:
    if not 0.0 <= config.gradient_error_feedback_decay < 1.0:
        raise ValueError(f"gradient_error_feedback_decay={config.gradient_error_feedback_decay} must be in [0, 1) "
                         f"(0 = plain error feedback; LoCo-style averaging uses e.g. 0.5)")
    if config.gradient_error_feedback_reset < 0:
        raise ValueError(f"gradient_error_feedback_reset={config.gradient_error_feedback_reset} must be >= 0 "
                         f"(0 = never reset)")
    tuning = {name: getattr(config, name) for name in ("gradient_error_feedback_decay",
                                                     "gradient_error_feedback_reset") if getattr(config, name)}
    if tuning and not config.gradient_error_feedback:
        raise ValueError(f"{', '.join(f'{k}={v}' for k, v in tuning.items())} tune error feedback, which is off; "
                         f"set gradient_error_feedback: true (or remove them)")


def _check_bit_allocation(config: Any) -> None:
    floor = config.gradient_bit_allocation_floor
    if floor and not config.gradient_bit_allocation:
        raise ValueError(f"gradient_bit_allocation_floor={floor} bounds per-block widths, which are off; set "
                         f"gradient_bit_allocation: true (or remove it)")
    if floor and not 2 <= floor <= config.gradient_bits:
        raise ValueError(f"gradient_bit_allocation_floor={floor} must be 0 (no floor) or a width from 2 to "
                         f"gradient_bits={config.gradient_bits}: a floor above the average width cannot fit in "
                         f"the fixed format's bytes; e.g. 2")


def _check_stage_supports_options(config: Any) -> None:
    hpz_on = config.hpz_partition_size != 1
    wanted = {
        "cpu_offload": (config.cpu_offload, (1, 2, 3)),
        "quantized_weights": (config.quantized_weights, (1, 2, 3)),
        "hpz_partition_size": (hpz_on, (3,)),
        "quantized_gradients": (config.quantized_gradients, (1, 2, 3)),
        "quantized_nontrainable_weights": (config.quantized_nontrainable_weights, (1, 2, 3)),
    }
    wanted.update({name: (getattr(config, name) not in (0, None), (3,)) for name in STAGE3_KNOBS})
    for name, (on, stages) in wanted.items():
        why = ("hpZ keeps a secondary shard of weights that only stage 3 reshards" if name == "hpz_partition_size"
               else "stages 1 and 2 keep every unit's weights gathered from forward to backward already"
               if name in STAGE3_KNOBS
               else "stage 0 keeps full replicas, with no shards to offload" if name == "cpu_offload"
               else "stage 0 is plain data parallel with no sharded collectives to change")
        if on and config.stage not in stages:
            raise ValueError(f"{name} needs stage {' or '.join(map(str, stages))}, but stage={config.stage}: {why}; "
                             f"set stage=3 or turn {name} off")


def default(option: dataclasses.Field) -> Any:
    """A field's default value (its factory's, for a mutable one)."""
    return option.default_factory() if option.default_factory is not dataclasses.MISSING else option.default
