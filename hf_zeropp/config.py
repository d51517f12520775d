"""ZeroPPConfig: every knob of hf_zeropp, validated in one place.

Checks that need no process group run when the config is built; checks against the launch (world size, ranks
per node) run in :meth:`ZeroPPConfig.resolve` — still before any collective — so that a bad configuration fails
on every rank with the same message instead of hanging a job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .kernels.reference import MAX_HADAMARD, is_rotation_size
from .launcher import detect_node_size

STAGES = (0, 1, 2, 3)
BITS = (4, 8)
MIXED_PRECISION = ("no", "bf16", "fp16")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
KERNEL_BACKENDS = ("reference", "cpp", "cuda")
# Block sizes are kept to multiples of 8 so that every block starts 8-element aligned for vectorized kernels.
BLOCK_ALIGNMENT = 8

# DeepSpeed zero_optimization keys hf_zeropp maps onto its own fields.
_DEEPSPEED_MAPPED = {
    "stage": "stage",
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_gradients": "quantized_gradients",
    "zero_quantized_nontrainable_weights": "quantized_nontrainable_weights",
}
# DeepSpeed keys that only tune DeepSpeed's own buffers and scheduling; FSDP2 has its own, so they are ignored.
_DEEPSPEED_TUNING_ONLY = {
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", "memory_efficient_linear",
    "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
}
# Top-level DeepSpeed keys that belong to the training loop (Trainer/Accelerate own them), not to sharding.
_DEEPSPEED_TRAINER_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
    "communication_data_type", "prescale_gradients", "gradient_predivide_factor", "flops_profiler",
    "activation_checkpointing", "tensorboard", "wandb", "csv_monitor", "amp", "zero_force_ds_cpu_optimizer",
}

PRESETS: dict[str, dict[str, Any]] = {
    "ddp": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True},
    # ZeRO++ with the qgZ option that measured best on the mini Table 5 study (README, "Beyond ZeRO++"): a
    # 64-element Hadamard rotation of the gradient blocks. Same bytes as zeropp.
    "zeropp-accurate": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node",
                        "quantized_gradients": True, "gradient_hadamard": 64},
    "zeropp-lora": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True,
                    "quantized_nontrainable_weights": True},
    "zeropp-qwz": {"stage": 3, "quantized_weights": True},
    "zeropp-hpz": {"stage": 3, "hpz_partition_size": "node"},
    "zeropp-qgz": {"stage": 3, "quantized_gradients": True},
}


@dataclass
class ZeroPPConfig:
    """How a model is sharded and how its collectives communicate.

    ``hpz_partition_size`` may be given as ``"node"`` (the ranks of one node) and is resolved at
    :meth:`resolve`. ``node_size=None`` takes the launcher's ranks per node (or the ranks' host names); set it to
    emulate several nodes on one machine.
    """

    stage: int = 3
    quantized_weights: bool = False
    hpz_partition_size: int | str = 1
    quantized_gradients: bool = False
    quantized_nontrainable_weights: bool = False
    weight_bits: int = 8
    gradient_bits: int = 4
    gradient_intra_bits: int | None = None
    block_size: int = 256
    gradient_block_size: int | None = None
    gradient_hadamard: int = 0
    gradient_error_feedback: bool = False
    gradient_full_precision_1d: bool = True
    weight_full_precision_1d: bool = True
    quantize_hpz_gather: bool = False
    qgz_pipeline_stages: int = 1
    stochastic_rounding: bool = False
    node_size: int | None = None
    mixed_precision: str = "no"
    reduce_dtype: str = "fp32"
    activation_checkpointing: bool = False
    wrap_modules: list[str] | None = None
    kernel_backend: str | None = None
    seed: int = 0
    quantized_weights_until: float | None = None
    hpz_until: float | None = None
    quantized_gradients_until: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.extra:
            raise ValueError(f"unknown hf_zeropp option(s) {sorted(self.extra)}; valid options: {_field_names()}")
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage} is invalid; use 0 (data parallel), 1, 2 or 3")
        for name in ("weight_bits", "gradient_bits"):
            if getattr(self, name) not in BITS:
                raise ValueError(f"{name}={getattr(self, name)} is not supported; use 8 or 4")
        if self.gradient_intra_bits is not None and self.gradient_intra_bits not in BITS:
            raise ValueError(f"gradient_intra_bits={self.gradient_intra_bits} is not supported; use 8, 4 or None")
        for name in ("block_size", "gradient_block_size"):
            value = getattr(self, name)
            if value is not None and (value < BLOCK_ALIGNMENT or value % BLOCK_ALIGNMENT):
                raise ValueError(
                    f"{name}={value} must be a positive multiple of {BLOCK_ALIGNMENT} (the kernels' alignment), "
                    f"e.g. {max(BLOCK_ALIGNMENT, -(-value // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT)}"
                )
        self._check_gradient_hadamard()
        if self.qgz_pipeline_stages < 1:
            raise ValueError(f"qgz_pipeline_stages={self.qgz_pipeline_stages} must be >= 1")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} is invalid; use one of {MIXED_PRECISION}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype={self.reduce_dtype!r} is invalid; use one of {REDUCE_DTYPES}")
        if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend={self.kernel_backend!r} is invalid; use one of {KERNEL_BACKENDS} or None")
        if self.node_size is not None and self.node_size < 1:
            raise ValueError(f"node_size={self.node_size} must be >= 1 (or None to detect it from the launch)")
        if isinstance(self.hpz_partition_size, str) and self.hpz_partition_size != "node":
            raise ValueError(f"hpz_partition_size={self.hpz_partition_size!r} must be an integer or 'node'")
        if isinstance(self.hpz_partition_size, int) and self.hpz_partition_size < 1:
            raise ValueError(f"hpz_partition_size={self.hpz_partition_size} must be >= 1 (1 turns hpZ off)")
        for name in ("quantized_weights_until", "hpz_until", "quantized_gradients_until"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be a fraction of max_steps in (0, 1], e.g. 0.5")
        self._check_stage_supports_options()

    def _check_gradient_hadamard(self) -> None:
        size = self.gradient_hadamard
        if not is_rotation_size(size):
            raise ValueError(f"gradient_hadamard={size} must be 0 (off) or a power of two up to {MAX_HADAMARD}; "
                             f"32-128 spreads outliers best, e.g. 64")
        block = self.gradient_block_size or self.block_size
        if size and block % size:
            name = "gradient_block_size" if self.gradient_block_size else "block_size"
            raise ValueError(f"{name}={block} is not a multiple of gradient_hadamard={size}: a rotation group may "
                             f"not straddle two quantization blocks; use {name}={-(-block // size) * size}")

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if hints[f.name] == float | None and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, f.name, value)
            if not _matches(value, hints[f.name]):
                raise TypeError(
                    f"{f.name}={value!r} has type {type(value).__name__}; expected {_describe(hints[f.name])}"
                )

    def _check_stage_supports_options(self) -> None:
        hpz_on = self.hpz_partition_size != 1
        wanted = {
            "quantized_weights": (self.quantized_weights, (1, 2, 3)),
            "hpz_partition_size": (hpz_on, (3,)),
            "quantized_gradients": (self.quantized_gradients, (1, 2, 3)),
            "quantized_nontrainable_weights": (self.quantized_nontrainable_weights, (1, 2, 3)),
        }
        for name, (on, stages) in wanted.items():
            if on and self.stage not in stages:
                raise ValueError(
                    f"{name} needs stage {' or '.join(map(str, stages))}, but stage={self.stage}: "
                    f"{'hpZ keeps a secondary shard of weights that only stage 3 reshards' if name == 'hpz_partition_size' else 'stage 0 is plain data parallel with no sharded collectives to change'}; "
                    f"set stage=3 or turn {name} off"
                )

    # ---------------------------------------------------------------- constructors

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ZeroPPConfig:
        """A named configuration: ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``zeropp`` (qwZ+hpZ+qgZ),
        ``zeropp-accurate`` (zeropp with Hadamard-rotated qgZ blocks), ``zeropp-lora``, ``zeropp-qwz``,
        ``zeropp-hpz``, ``zeropp-qgz``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZeroPPConfig:
        """From hf_zeropp keys, a ``{"preset": name, ...overrides}`` dict, or a DeepSpeed config."""
        if not isinstance(values, dict):
            raise TypeError(f"a ZeroPPConfig needs a mapping, got {type(values).__name__}")
        if "zero_optimization" in values:
            return cls.from_deepspeed(values)
        values = dict(values)
        if "preset" in values:
            return cls.preset(values.pop("preset"), **values)
        known = set(_field_names())
        extra = {k: v for k, v in values.items() if k not in known}
        return cls(**{k: v for k, v in values.items() if k in known}, extra=extra)

    @classmethod
    def from_deepspeed(cls, ds_config: dict[str, Any]) -> ZeroPPConfig:
        """Map a DeepSpeed config's ZeRO(++) keys; DeepSpeed-only tuning keys are ignored with a warning, and keys
        whose meaning hf_zeropp cannot honour raise."""
        zero = ds_config.get("zero_optimization") or {}
        if not isinstance(zero, dict):
            raise TypeError(f"zero_optimization must be a mapping, got {type(zero).__name__}")
        values: dict[str, Any] = {}
        ignored = []
        for key, value in zero.items():
            if key in _DEEPSPEED_MAPPED:
                values[_DEEPSPEED_MAPPED[key]] = value
            elif key in ("offload_optimizer", "offload_param"):
                device = (value or {}).get("device", "none") if isinstance(value, dict) else value
                if device not in (None, "none"):
                    raise ValueError(
                        f"zero_optimization.{key}.device={device!r} (CPU/NVMe offload) is not supported by hf_zeropp; "
                        f"remove {key} from the DeepSpeed config"
                    )
            elif key in _DEEPSPEED_TUNING_ONLY:
                ignored.append(key)
            else:
                raise ValueError(
                    f"zero_optimization.{key} has no hf_zeropp equivalent; remove it (mapped keys: "
                    f"{sorted(_DEEPSPEED_MAPPED)})"
                )
        enabled = [p for p in ("bf16", "fp16")
                   if isinstance(ds_config.get(p), dict) and ds_config[p].get("enabled") in (True, "auto")]
        if len(enabled) > 1:
            raise ValueError("the DeepSpeed config enables both bf16 and fp16; enable one of them")
        if enabled:
            values["mixed_precision"] = enabled[0]
        for key in ds_config:
            if key not in ("zero_optimization", "bf16", "fp16") and key not in _DEEPSPEED_TRAINER_KEYS:
                raise ValueError(f"DeepSpeed config key {key!r} cannot be mapped to hf_zeropp; remove it")
        if values.get("hpz_partition_size") == 1:
            values.pop("hpz_partition_size")
        if ignored:
            warnings.warn(f"hf_zeropp ignores DeepSpeed-only tuning keys {sorted(ignored)}", stacklevel=2)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ZeroPPConfig:
        """YAML or JSON, either hf_zeropp keys (optionally under a top-level ``zeropp:``) or a DeepSpeed config."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"hf_zeropp config file {str(path)!r} does not exist; check the path")
        text = path.read_text()
        try:
            values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as error:
            raise ValueError(f"cannot parse hf_zeropp config {str(path)!r}: {error}") from error
        if isinstance(values, dict) and set(values) == {"zeropp"}:
            values = values["zeropp"]
        if not isinstance(values, dict):
            raise ValueError(f"hf_zeropp config {str(path)!r} must hold a mapping of options, got {values!r}")
        return cls.from_dict(values)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ZeroPPConfig:
        """``ZEROPP_CONFIG`` (a file or preset name), then one ``ZEROPP_<OPTION>`` variable per option on top."""
        environ = dict(os.environ if environ is None else environ)
        source = environ.get("ZEROPP_CONFIG")
        if source is None:
            base: dict[str, Any] = {}
        elif source in PRESETS:
            base = {"preset": source}
        else:
            base = dataclasses.asdict(cls.from_file(source))
            base.pop("extra")
        hints = typing.get_type_hints(cls)
        names = set(_field_names())
        overrides = {}
        for key, raw in environ.items():
            if not key.startswith("ZEROPP_") or key == "ZEROPP_CONFIG":
                continue
            name = key[len("ZEROPP_"):].lower()
            if name not in names:
                raise ValueError(f"environment variable {key} is not an hf_zeropp option; valid: "
                                 f"{['ZEROPP_' + n.upper() for n in sorted(names)]}")
            overrides[name] = _parse_env(key, raw, hints[name])
        return cls.from_dict({**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values.pop("extra")
        return values

    # ---------------------------------------------------------------- launch-dependent checks

    def resolve(self, world_size: int, local_world_size: int | None = None) -> ResolvedConfig:
        """Check the config against the launch and fill in ``node_size`` and ``hpz_partition_size``.

        The node size is, in order: ``node_size`` of this config (``ZEROPP_NODE_SIZE``), ``local_world_size`` if
        given, the launcher's variables (``LOCAL_WORLD_SIZE``, SLURM, Open MPI, MPICH, MVAPICH), or the ranks' host
        names (a collective; see :mod:`hf_zeropp.launcher`)."""
        if self.node_size is not None:
            node_size, source = self.node_size, "node_size in the hf_zeropp config"
        elif local_world_size is not None:
            node_size, source = local_world_size, "given"
        else:
            node_size, source = detect_node_size(world_size)
        if node_size > world_size or world_size % node_size:
            raise ValueError(
                f"node_size={node_size} does not divide the world size {world_size} (node size from {source}); set "
                f"node_size to the number of ranks per node (a divisor of {world_size})"
            )
        hpz = node_size if self.hpz_partition_size == "node" else int(self.hpz_partition_size)
        if hpz > world_size or world_size % hpz:
            raise ValueError(
                f"hpz_partition_size={hpz} must divide the world size {world_size}; use the number of ranks per "
                f"node ({node_size}) or a divisor of it"
            )
        if hpz > 1 and node_size % hpz:
            raise ValueError(
                f"hpz_partition_size={hpz} does not fit in a node of {node_size} ranks: its backward all-gather "
                f"would cross nodes; use {node_size} ('node') or a divisor of it"
            )
        return ResolvedConfig(self, world_size=world_size, node_size=node_size, hpz_size=hpz,
                              node_size_source=source)


@dataclass(frozen=True)
class ResolvedConfig:
    """A config checked against a launch: sizes are concrete integers."""

    config: ZeroPPConfig
    world_size: int
    node_size: int
    hpz_size: int
    node_size_source: str = "given"

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size


def _field_names() -> list[str]:
    return [f.name for f in fields(ZeroPPConfig) if f.name != "extra"]


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, float)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(args[0])}"
    if args:
        return " or ".join(_describe(a) for a in args)
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _parse_env(key: str, raw: str, hint: Any) -> Any:
    text = raw.strip()
    if text.lower() in ("none", "null", "") and _matches(None, hint):
        return None
    if _matches(True, hint):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={raw!r} is not a boolean; use true or false")
    if _matches(0.5, hint):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not a number") from None
    if _matches(1, hint):
        try:
            return int(text)
        except ValueError:
            if _matches(text, hint):
                return text
            raise ValueError(f"{key}={raw!r} is not an integer") from None
    if _matches([], hint):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text
