"""What each FSDP setting becomes on hf_zeropp, key by key (Accelerate's ``fsdp_config`` / ``--fsdp_*`` and the
Trainer's ``fsdp`` / ``fsdp_config``): mapped, ignored with a warning, or refused, with the reason each time.
:mod:`hf_zeropp.config.fsdp_settings` reads the settings by these tables; docs/design.md prints
:func:`key_table`."""

from __future__ import annotations

# Accelerate's names (FSDP_SHARDING_STRATEGY, in ShardingStrategy's numbering from 1): the ZeRO stage and, for the
# hybrid strategies, sharding inside each node only
SHARDING_STRATEGIES = {"FULL_SHARD": (3, "world"), "SHARD_GRAD_OP": (2, "world"), "NO_SHARD": (0, "world"),
                       "HYBRID_SHARD": (3, "node"), "HYBRID_SHARD_ZERO2": (2, "node")}
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")  # StateDictType's numbering from 1
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "y", "t", "on", "1"), ("false", "no", "n", "f", "off", "0")

# What each key becomes (keys as Accelerate's fsdp_config writes them without the ``fsdp_`` prefix; the Trainer's
# fsdp_config uses the same names, with ``cpu_offload`` for ``offload_params``). docs/design.md lists them.
MAPPED = {
    "version": "1: fsdp_reshard_after_forward is read as FSDP1 reads it (a sharding strategy), 2: as a bool; both run "
               "on FSDP2",
    "reshard_after_forward": "the stage: true / FULL_SHARD -> 3, false / SHARD_GRAD_OP -> 2, NO_SHARD -> 0, "
                             "HYBRID_SHARD -> 3 and HYBRID_SHARD_ZERO2 -> 2 with shard_group: node (hybrid)",
    "sharding_strategy": "as reshard_after_forward (read for FSDP2 too); both given must agree",
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP -> wrap_modules: the listed classes, else the model's "
                        "_no_split_modules; NO_WRAP (Accelerate's default) -> wrap_modules: [] (no layer is a unit)",
    "transformer_layer_cls_to_wrap": "wrap_modules",
    "offload_params": "cpu_offload",
    "cpu_offload": "cpu_offload (the Trainer's name)",
    "activation_checkpointing": "activation_checkpointing",
    "cpu_ram_efficient_loading": "--load_in_slices (Accelerate's default true): from_pretrained builds the model on "
                                 "the meta device and each rank reads its own slices",
    "state_dict_type": "SHARDED_STATE_DICT (Accelerate's FSDP2 default) and FULL_STATE_DICT (FSDP1's and the "
                       "Trainer's): hf_zeropp's checkpoints, sharded DCP (save_state: zeropp_model_<i>/) beside "
                       "consolidated safetensors (save_model, the Trainer's checkpoints), with a warning naming how "
                       "the folder differs from FSDP's (FULL_STATE_DICT: the optimizer stays sharded)",
}
# Keys FSDP2 or hf_zeropp already honours whatever their value, or that tune FSDP1 only: warned once, and recorded.
IGNORED = {
    "sync_module_states": "hf_zeropp compares the ranks' weights when it shards and gives every rank rank 0's where "
                          "they differ, whatever this says",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "forward_prefetch": "hf_zeropp starts each unit's forward gather while the unit before it computes, and FSDP2's "
                        "streams overlap gathers on GPUs, whatever this says",
    "backward_prefetch": "FSDP2 prefetches one unit ahead in backward (BACKWARD_PRE's order), whatever this says",
    "limit_all_gathers": "an FSDP1 rate limit; FSDP2 bounds the gathers in flight itself",
    "min_num_params": "only SIZE_BASED_WRAP reads it, and the wrap policy is another",
}
# Values that cannot be honoured: the error's reason and alternative.
REFUSED_VALUES = {
    ("auto_wrap_policy", "SIZE_BASED_WRAP"): "hf_zeropp's units are layer classes, not parameter counts; use "
                                             "TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap naming "
                                             "the layer class",
    ("state_dict_type", "LOCAL_STATE_DICT"): "FSDP2 has no local state dict; use SHARDED_STATE_DICT (sharded DCP "
                                             "checkpoints)",
    ("activation_checkpointing_offload", True): "hf_zeropp recomputes activations (activation_checkpointing) but does "
                                                "not offload them; set it to false",
}
# How a checkpoint folder differs from what Accelerate's FSDP writes for each state dict type (said once as a warning):
# hf_zeropp keeps its own format, sharded DCP beside consolidated safetensors, resumable on any world size
CHECKPOINT_DIFFERENCES = {
    "FULL_STATE_DICT": "save_state writes sharded DCP checkpoints (zeropp_model_<i>/: model and optimizer, resumable "
                       "on any world size by load_state) instead of rank 0's pytorch_model_fsdp.bin and optimizer.bin, "
                       "and the Trainer's checkpoints hold the consolidated model.safetensors with the optimizer "
                       "sharded (zeropp_optimizer/) instead of optimizer.bin; save_model and get_state_dict give the "
                       "consolidated weights, as under FSDP",
    "SHARDED_STATE_DICT": "save_state writes the model and optimizer shards in zeropp_model_<i>/ (resumable on any "
                          "world size by load_state) instead of pytorch_model_fsdp_<i>/ and optimizer_<i>/, and the "
                          "Trainer's checkpoints hold the optimizer shards in zeropp_optimizer/ beside the "
                          "consolidated model.safetensors (written by every rank in slices), which FSDP's do not "
                          "hold; save_model writes the consolidated weights (FSDP's writes none under this type)",
}
# Keys refused whenever they ask for something: the reason and alternative.
REFUSED_KEYS = {
    "ignored_modules": "hf_zeropp shards every parameter of the model; remove it",
    "xla": "XLA's FSDP runs on TPUs, which hf_zeropp does not; launch without hf_zeropp",
    "xla_fsdp_v2": "XLA's FSDP runs on TPUs, which hf_zeropp does not; launch without hf_zeropp",
    "xla_fsdp_grad_ckpt": "XLA's FSDP runs on TPUs, which hf_zeropp does not; use activation_checkpointing",
    "xla_fsdp_settings": "XLA's FSDP runs on TPUs, which hf_zeropp does not; launch without hf_zeropp",
}
# The keys each integration reads (Accelerate: the YAML's fsdp_config and the ``--fsdp_*`` launch options; the
# Trainer: TrainingArguments.fsdp_config), without the ``fsdp_`` prefix either accepts.
ACCELERATE_KEYS = ("version", "reshard_after_forward", "sharding_strategy", "offload_params", "auto_wrap_policy",
                   "transformer_layer_cls_to_wrap", "min_num_params", "backward_prefetch", "forward_prefetch",
                   "state_dict_type", "use_orig_params", "cpu_ram_efficient_loading", "sync_module_states",
                   "activation_checkpointing", "activation_checkpointing_offload", "ignored_modules")
TRAINER_KEYS = ("version", "reshard_after_forward", "cpu_offload", "auto_wrap_policy", "transformer_layer_cls_to_wrap",
                "min_num_params", "backward_prefetch", "forward_prefetch", "state_dict_type", "use_orig_params",
                "cpu_ram_efficient_loading", "sync_module_states", "activation_checkpointing", "limit_all_gathers",
                "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")
# the Trainer's ``fsdp`` words (FSDPOption): a sharding strategy, offload, or auto_wrap (its default policy anyway)
TRAINER_WORDS = (*(name.lower() for name in SHARDING_STRATEGIES), "offload", "auto_wrap")
# settings beside the FSDP keys that an FSDP launch or Trainer brings, and what becomes of them
PARALLELISM_CONFIG_REFUSED = ("FSDP2's replicate, shard, tensor and context parallel degrees are not supported by "
                              "hf_zeropp; remove it: for sharding inside each node and replicating across nodes use "
                              "fsdp_sharding_strategy: HYBRID_SHARD (or `zeropp: hybrid`)")
BESIDE_THE_KEYS = {
    "`fsdp` words (Trainer)": "mapped: full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2 as "
                              "reshard_after_forward; offload as cpu_offload; auto_wrap: the default policy",
    "`distributed_type: FSDP`, `--use_fsdp` (Accelerate)": "mapped: the launch runs on hf_zeropp (MULTI_GPU, or CPU "
                                                           "processes with gloo); no FSDP_* variable reaches a worker",
    "`parallelism_config` (Accelerate)": f"refused: {PARALLELISM_CONFIG_REFUSED}",
    "`mixed_precision` bf16/fp16 (with FSDP)": "warned: Accelerate's FSDP2 plugin reduces gradients in the compute "
                                               "dtype and returns outputs in it; hf_zeropp reduces in reduce_dtype "
                                               "(fp32 unless set)",
}


def key_table() -> str:
    """docs/design.md's table of every FSDP setting: mapped, ignored with a warning, or refused."""
    rows = ["| setting (Accelerate `fsdp_config` / `--fsdp_*`; Trainer `fsdp_config`) | on hf_zeropp |", "|---|---|"]
    for key in dict.fromkeys((*ACCELERATE_KEYS, *TRAINER_KEYS)):
        names = " / ".join([f"`fsdp_{key}`"] * (key in ACCELERATE_KEYS) + [f"`{key}`"] * (key in TRAINER_KEYS))
        refused = "; ".join(f"refused: {'true' if value is True else value} ({why})"
                            for (refused_key, value), why in REFUSED_VALUES.items() if refused_key == key)
        treatment = (f"mapped: {MAPPED[key]}" if key in MAPPED else f"ignored with a warning: {IGNORED[key]}"
                     if key in IGNORED else f"refused: {REFUSED_KEYS[key]}" if key in REFUSED_KEYS else
                     "false: nothing to do")
        rows.append(f"| {names} | {treatment}{'; ' + refused if refused else ''} |")
    rows += [f"| {setting} | {treatment} |" for setting, treatment in BESIDE_THE_KEYS.items()]
    rows.append("| any other key | refused: named with the keys hf_zeropp knows |")
    return "\n".join(rows)
