"""ZeroPPConfig: every knob of hf_zeropp, validated in one place.

Checks that need no process group run when the config is built (each field against its type here, the rules
between options in :mod:`hf_zeropp.config.config_rules`); checks against the launch (world size, ranks per node) run in
:meth:`hf_zeropp.comm.topology.Topology.from_config` — still before any collective — so that a bad configuration fails
on every rank with the same message instead of hanging a job.

Every field carries its documentation (``field(metadata={"doc": ...})``), the subject it belongs to, and, for an
enumeration, a ``typing.Literal`` annotation that :meth:`ZeroPPConfig._check_fields` checks generically. The
README's option table is :func:`option_table` (tests/config/test_config.py keeps the two equal).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import yaml

from .config_rules import SCHEDULED_TECHNIQUES, check_option_rules
from ..interop.deepspeed.config import check_training_sections, options_from_deepspeed
from .field_types import (allowed_values, describe, flatten_sections, grouped_table, matches, outside_literal,
                          parse_env)
from .presets import PRESETS



# The subjects the options are grouped by, in the order of the fields (and of the README's option table).
SHARDING = "sharding"
QWZ = "qwZ: quantized weights"
HPZ = "hpZ: hierarchical weight partition"
HYBRID = "hybrid sharding: sharded in the node, replicated across nodes"
QGZ = "qgZ: quantized gradients"
ACCURACY = "qgZ accuracy options (the `zeropp-accurate` preset)"
EXPERIMENTAL = "qgZ experimental options (measured in docs/accuracy.md; in no preset)"
LAUNCH = "launch"
KERNELS = "kernels"
SCHEDULE = "schedules (Trainer integration only)"
TRAINING = "training loop of a DeepSpeed config (Trainer and Accelerator integrations)"
# A config file may group its options under these section keys (flat keys work as well).
SECTIONS = {"sharding": SHARDING, "weights": QWZ, "hpz": HPZ, "hybrid": HYBRID, "gradients": QGZ, "accuracy": ACCURACY,
            "experimental": EXPERIMENTAL, "launch": LAUNCH, "kernels": KERNELS, "schedules": SCHEDULE,
            "training": TRAINING}




def _option(default: Any, subject: str, doc: str, *, invalid: str = "is invalid; use {allowed}",
            labels: dict[Any, str] | None = None) -> Any:
    """A config field: its default, the subject it belongs to, its documentation (the README's option table), and
    for an enumeration (a ``Literal`` annotation) how a value outside it is reported: ``invalid`` is formatted with
    ``allowed``, the annotation's values (a value's entry in ``labels`` stands for it)."""
    return field(default=default, metadata={"doc": doc, "subject": subject, "invalid": invalid,
                                            "labels": labels or {}})


_UNSUPPORTED = "is not supported; use {allowed}"


@dataclass
class ZeroPPConfig:
    """How a model is sharded and how its collectives communicate.

    ``hpz_partition_size`` may be given as ``"node"`` (the ranks of one node) and is resolved against the launch by
    :meth:`hf_zeropp.comm.topology.Topology.from_config`. ``node_size=None`` takes the launcher's ranks per node (or the
    ranks' host names); set it to emulate several nodes on one machine. ``dataclasses.fields(ZeroPPConfig)`` carry
    each option's documentation in ``metadata["doc"]``.
    """

    # ---------------------------------------------------------------- sharding
    stage: Literal[0, 1, 2, 3] = _option(
        3, SHARDING, "0 = plain data parallel (baseline), 1, 2, 3", labels={0: "0 (data parallel)"})
    mixed_precision: Literal["no", "bf16", "fp16"] = _option(
        "no", SHARDING, '"no", "bf16", "fp16": compute dtype; master weights and optimizer state stay fp32')
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = _option("fp32", SHARDING, "gradient reduction dtype")
    wrap_modules: list[str] | None = _option(
        None, SHARDING, "class names of the FSDP units (None = the model's `_no_split_modules`)")
    activation_checkpointing: bool = _option(False, SHARDING, "recompute each transformer block in backward")
    cpu_offload: bool = _option(
        False, SHARDING, "FSDP2's CPUOffloadPolicy: sharded parameters, their gradients and the optimizer state live "
                         "in CPU memory (pinned on GPUs) and the optimizer steps there; each unit's shard is copied "
                         "to the device for its all-gather (stages 1-3; DeepSpeed's offload_optimizer/offload_param)")
    generation_gather: Literal["per_call", "per_token"] = _option(
        "per_call", SHARDING, '`generate()` gathers the weights once per call and frees them after it (each rank '
                              'then holds one full copy in the compute dtype), or `"per_token"`: once per forward, '
                              'as FSDP does (for models too large to hold gathered)')
    # ---------------------------------------------------------------- sharding: stage 3's memory knobs
    max_live_parameters: int | None = _option(
        None, SHARDING, "stage 3: elements of gathered weights that may be live at once (the root's included): the "
                      "units nearest the loss keep theirs from forward to backward first (FSDP2 "
                      "reshard_after_forward=False per unit), the rest reshard, and gathers start ahead of use only "
                      "as far as the rest of the budget allows (0: none ahead). None = no budget: every unit "
                      "reshards, gathers start ahead as prefetch_bucket_size says (DeepSpeed's "
                      "stage3_max_live_parameters)")
    max_reuse_distance: int = _option(
        0, SHARDING, "stage 3: a unit stays gathered only if fewer elements than this are gathered between its forward "
                   "and its backward (DeepSpeed's stage3_max_reuse_distance; 0 = none)")
    persistence_threshold: int | Literal["auto"] = _option(
        0, SHARDING, 'stage 3: parameters of at most this many elements are never sharded: replicated, gradients '
                   'all-reduced in one fp32 collective per backward; "auto" = 10 x the model\'s hidden size, as '
                   'Transformers fills it (DeepSpeed\'s stage3_param_persistence_threshold; 0 = off)',
        invalid="must be {allowed}")
    prefetch_bucket_size: int | Literal["auto"] | None = _option(
        None, SHARDING, 'stage 3: elements of the following units whose gathers start ahead of use, in forward and '
                      'backward (at least one unit); "auto" = 0.9 x hidden size squared, as Transformers fills it; '
                      "None = FSDP2's one unit ahead (DeepSpeed's stage3_prefetch_bucket_size)",
        invalid="must be {allowed}")
    # ---------------------------------------------------------------- qwZ
    quantized_weights: bool = _option(
        False, QWZ, "qwZ: block-quantized forward all-gather (stages 1–3)")
    weight_bits: Literal[8, 4] = _option(8, QWZ, "qwZ width (8 or 4)", invalid=_UNSUPPORTED)
    block_size: int = _option(256, QWZ, "elements per quantization block (one fp32 scale each) for weights")
    weight_full_precision_1d: bool = _option(
        True, QWZ, "qwZ: 1-D parameters gathered in the compute dtype; False quantizes them with the matrices")
    weight_deltas: bool = _option(
        False, QWZ, "qwZ sends, after one full-precision gather, the `weight_bits`-wide difference between this step's "
                    "weights and the copy every node keeps (one cross-node gather among the ranks of equal local "
                    "index, then one inside the node; about 1/node_size of the weights per rank, kept between steps)")
    quantized_nontrainable_weights: bool = _option(
        False, QWZ, "frozen weights stored as INT8 (LoRA / RLHF)")
    # ---------------------------------------------------------------- hpZ
    hpz_partition_size: int | Literal["node"] = _option(
        1, HPZ, 'hpZ: secondary shard over this many ranks (`"node"` = ranks per node; 1 = off; stage 3)',
        invalid="must be {allowed}")
    quantize_hpz_gather: bool = _option(False, HPZ, "also quantize the node-local hpZ all-gather in backward")
    # ---------------------------------------------------------------- hybrid sharding
    shard_group: Literal["world", "node", "auto"] = _option(
        "world", HYBRID, '`"node"`: parameters, gradients and optimizer states sharded over the ranks of each node and '
                         'replicated across nodes (HSDP, MiCS): no weights cross nodes, only one gradient all-reduce '
                         'per step; `"world"`: over all ranks (ZeRO); `"auto"` (preset auto): probe the links at '
                         'start and choose zero3, zeropp, hybrid or hybrid-q, and INT4 or INT8 gradients')
    hybrid_gradient_bits: Literal[8, 4] | None = _option(
        None, HYBRID, "block-quantize the cross-node gradient all-reduce to this width (a reduce-scatter and an "
                      "all-gather among the ranks of equal local index, overlapping the rest of the backward); "
                      "None = full precision (FSDP2's HSDP all-reduce)", invalid=_UNSUPPORTED)
    # ---------------------------------------------------------------- qgZ
    quantized_gradients: bool = _option(
        False, QGZ, "qgZ: 2-hop quantized all-to-all instead of the gradient reduce-scatter (stages 1–3)")
    gradient_bits: Literal[8, 4] = _option(4, QGZ, "qgZ width of the inter-node hop", invalid=_UNSUPPORTED)
    gradient_block_size: int | None = _option(None, QGZ, "block size for gradients (None = `block_size`)")
    gradient_full_precision_1d: bool = _option(
        True, QGZ, "qgZ and hybrid-q: 1-D parameters (biases, norm gains) reduced in the reduce dtype (qgZ, as "
                   "DeepSpeed's does) or fp32 (hybrid-q); False quantizes them with the matrices")
    qgz_pipeline_stages: int = _option(
        1, QGZ, "qgZ pipeline stages (ZeRO++ Alg. 2): intra- and inter-node hops overlap")
    # ---------------------------------------------------------------- qgZ accuracy options
    gradient_hadamard: int = _option(
        0, ACCURACY, "qgZ: Hadamard rotation group (0 = off; a power of two ≤ 128 dividing the gradient block size)")
    gradient_intra_bits: Literal[8, 4] | None = _option(
        None, ACCURACY, "qgZ width of the intra-node hop (None = `gradient_bits`)", invalid=_UNSUPPORTED)
    gradient_full_precision_local: bool = _option(
        False, ACCURACY,
        "qgZ: at each hop a rank adds its own contribution (the rows it sends itself) in fp32 instead of quantized: "
        "the same bytes on every link, and a hop among P peers drops 1/P of its error variance (much at 2 nodes, "
        "little at many)")
    # ---------------------------------------------------------------- qgZ experimental options
    stochastic_rounding: bool = _option(False, EXPERIMENTAL, "unbiased, seeded stochastic rounding in qgZ")
    seed: int = _option(0, EXPERIMENTAL, "seed of stochastic rounding")
    gradient_error_feedback: bool = _option(
        False, EXPERIMENTAL,
        "error feedback on the quantization that crosses nodes: qgZ's inter-node requantization, or both hops of "
        "hybrid-q's all-reduce (8-bit residual, about `numel / node_size` bytes per rank)")
    gradient_error_feedback_decay: float = _option(
        0.0, EXPERIMENTAL,
        "LoCo-style error feedback: the residual is a moving average, decay x the previous residual + (1 - decay) x "
        "this step's dropped error (0 = plain error feedback; in [0, 1))")
    gradient_error_feedback_reset: int = _option(
        0, EXPERIMENTAL, "error feedback: drop every residual after this many reductions of its unit (0 = never)")
    gradient_bit_allocation: bool = _option(
        False, EXPERIMENTAL,
        "qgZ: the inter-node hop gives each block a width from 0 to 8 bits by its scale (more bits to larger "
        "blocks), averaging `gradient_bits` in the same bytes: least L2 error, not least Adam update error (it raised "
        "one measured case's loss); compiled kernels on CPU and CUDA, plain torch elsewhere (said when sharding)")
    gradient_bit_allocation_floor: int = _option(
        0, EXPERIMENTAL,
        "with `gradient_bit_allocation`: no nonzero block gets fewer bits than this (0 = no floor; 2 to "
        "`gradient_bits`); 2 forbids sending a nonzero block as zeros (on the measured Llama case that ended the "
        "starvation of small blocks, not the loss cost), `gradient_bits` moves only the bits of all-zero blocks")
    # ---------------------------------------------------------------- launch
    node_size: int | None = _option(
        None, LAUNCH, 'ranks per node; None = from the launch (docs/design.md, "Engine rules"). Set it to emulate nodes')
    # ---------------------------------------------------------------- kernels
    kernel_backend: Literal["reference", "cpp", "cuda"] | None = _option(
        None, KERNELS, 'force "reference", "cpp" or "cuda" kernels')
    # ---------------------------------------------------------------- schedules
    quantized_weights_until: float | None = _option(
        None, SCHEDULE, "switch qwZ off once this fraction of `max_steps` is done (None = never). Applied by the "
                        "Trainer integration only: `shard_model` and `hf_zeropp.Accelerator` refuse a config that "
                        "sets it (call `hf_zeropp.set_techniques` yourself instead)")
    hpz_until: float | None = _option(
        None, SCHEDULE, "as `quantized_weights_until`, for hpZ")
    quantized_gradients_until: float | None = _option(
        None, SCHEDULE, 'as `quantized_weights_until`, for qgZ (0.5 = the paper\'s "qgZ for the first 50 % of '
                        'training")')
    # ---------------------------------------------------------------- training loop
    deepspeed_training: dict | None = _option(
        None, TRAINING, "a DeepSpeed config's optimizer, scheduler, gradient_clipping, gradient_accumulation_steps, "
                        "train_batch_size, train_micro_batch_size_per_gpu and fp16 loss-scale sections, applied as "
                        "DeepSpeed applies them (\"auto\" filled as Transformers / Accelerate fill it); set by reading a "
                        "DeepSpeed config. `shard_model` refuses one holding an optimizer, scheduler or clipping")
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._check_fields()
        if self.extra:
            raise ValueError(f"unknown hf_zeropp option(s) {sorted(self.extra)}; valid options: {_field_names()}")
        self._check_enumerations()
        check_option_rules(self)
        if self.deepspeed_training is not None:
            check_training_sections(self.deepspeed_training)

    def _check_fields(self) -> None:
        """Every field's value against its annotation's type (an integer where a float is expected becomes one)."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if hints[f.name] in (float, float | None) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, f.name, value)
            if not matches(value, hints[f.name]):
                raise TypeError(
                    f"{f.name}={value!r} has type {type(value).__name__}; expected {describe(hints[f.name])}"
                )

    def _check_enumerations(self) -> None:
        """Every field annotated with a ``Literal``: its value is one of the literal's (or of the other types the
        annotation allows); the error names the field, the value and the allowed values."""
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            hint = hints[f.name]
            value = getattr(self, f.name)
            if outside_literal(value, hint):
                allowed = allowed_values(hint, f.metadata.get("labels", {}))
                raise ValueError(f"{f.name}={value!r} " + f.metadata["invalid"].format(allowed=allowed))

    # ---------------------------------------------------------------- schedules

    def schedule(self) -> dict[str, float]:
        """The ``*_until`` fields that are set: ``{field: fraction of max_steps}``."""
        return {name: getattr(self, name) for name in SCHEDULED_TECHNIQUES if getattr(self, name) is not None}

    def refuse_schedule(self, entry_point: str) -> None:
        """Raise if a ``*_until`` field is set: only the Trainer integration knows how far training is, so any other
        entry point (``entry_point``, e.g. ``"shard_model"``) would silently never apply the schedule."""
        if not (schedule := self.schedule()):
            return
        names = ", ".join(f"{name}={value}" for name, value in schedule.items())
        calls = "; ".join(f"hf_zeropp.set_techniques(model, {SCHEDULED_TECHNIQUES[name]}=False) once {value:.0%} of "
                          f"the steps are done" for name, value in schedule.items())
        raise ValueError(
            f"{names}: schedules are applied only by the Trainer integration (ZeroPPTrainer / ZeroPPTrainerMixin, "
            f"which knows the training progress); {entry_point} cannot tell how far training is and would ignore "
            f"it. Train with the Trainer integration, or remove it from the config and call {calls}"
        )

    # ---------------------------------------------------------------- constructors

    @classmethod
    def coerce(cls, value: ZeroPPConfig | str | os.PathLike | dict | None, *, argument: str = "config"
               ) -> ZeroPPConfig:
        """A config from any of the forms hf_zeropp's entry points accept: a ZeroPPConfig, a preset name, a
        YAML/JSON path (hf_zeropp or DeepSpeed format), a dict (hf_zeropp keys, ``{"preset": name, ...}`` or a
        DeepSpeed config) or the same as JSON text, or None (``ZEROPP_CONFIG`` / ``ZEROPP_*`` environment).
        ``argument`` names the value in errors (the entry point's parameter).

        ``ZEROPP_NODE_SIZE``, when set, overrides the node size of any of them: node emulation is a property of the
        launch, not of the recipe.
        """
        if value is None:
            return cls.from_env()
        if isinstance(value, ZeroPPConfig):
            config = value
        elif isinstance(value, dict):
            config = cls.from_dict(value)
        elif isinstance(value, str) and value.lstrip().startswith("{"):
            config = cls.from_dict(_json_object(value, argument))
        elif isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if text in PRESETS:
                config = cls.preset(text)
            elif not Path(text).exists() and "/" not in text and not text.endswith((".yaml", ".yml", ".json")):
                raise ValueError(f"{argument}={text!r} is neither a preset ({sorted(PRESETS)}) nor an existing "
                                 f"config file")
            else:
                config = cls.from_file(text)
        else:
            raise TypeError(f"{argument} must be a ZeroPPConfig, preset name, path, dict or None; got "
                            f"{type(value).__name__}")
        node_size = os.environ.get("ZEROPP_NODE_SIZE")
        if node_size:
            if not node_size.strip().isdigit():
                raise ValueError(f"ZEROPP_NODE_SIZE={node_size!r} is not a positive integer (ranks per node)")
            config = dataclasses.replace(config, node_size=int(node_size))
        return config

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ZeroPPConfig:
        """A named configuration: ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``zeropp`` (qwZ+hpZ+qgZ),
        ``zeropp-accurate`` (zeropp with Hadamard-rotated qgZ blocks, an 8-bit intra-node hop and own rows in fp32),
        ``zeropp-lora``, ``zeropp-deltas`` (qwZ by INT4 weight differences), ``zeropp-qwz``, ``zeropp-hpz``,
        ``zeropp-qgz``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ZeroPPConfig:
        """From hf_zeropp keys (flat, or grouped under the :data:`SECTIONS` keys), a ``{"preset": name,
        ...overrides}`` dict, or a DeepSpeed config."""
        if not isinstance(values, dict):
            raise TypeError(f"a ZeroPPConfig needs a mapping, got {type(values).__name__}")
        if "zero_optimization" in values:
            return cls.from_deepspeed(values)
        values = flatten_sections(values, ZeroPPConfig, SECTIONS)
        if "preset" in values:
            return cls.preset(values.pop("preset"), **values)
        known = set(_field_names())
        extra = {k: v for k, v in values.items() if k not in known}
        return cls(**{k: v for k, v in values.items() if k in known}, extra=extra)

    @classmethod
    def from_deepspeed(cls, ds_config: dict[str, Any]) -> ZeroPPConfig:
        """Map a DeepSpeed config's ZeRO(++) keys
        (:func:`hf_zeropp.interop.deepspeed.config.options_from_deepspeed`)."""
        return cls(**options_from_deepspeed(ds_config))

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
        """``ZEROPP_CONFIG`` (a file, a preset name or a JSON object of options, as ``hf-zeropp launch`` passes the
        resolved config to its workers), then one ``ZEROPP_<OPTION>`` variable per option on top."""
        environ = dict(os.environ if environ is None else environ)
        source = environ.get("ZEROPP_CONFIG")
        if source is None:
            base: dict[str, Any] = {}
        elif source in PRESETS:
            base = {"preset": source}
        elif source.lstrip().startswith("{"):
            base = _json_object(source, "ZEROPP_CONFIG")
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
            overrides[name] = parse_env(key, raw, hints[name])
        return cls.from_dict({**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values.pop("extra")
        return values



def _json_object(text: str, argument: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{argument}={text!r} is not valid JSON ({error}); give a preset, a config file or a JSON "
                         f"object of options") from None


def _field_names() -> list[str]:
    return [f.name for f in fields(ZeroPPConfig) if f.name != "extra"]


def option_table() -> str:
    """The README's option table (markdown): a row per subject with its section key, then each option's default
    and doc."""
    return grouped_table(ZeroPPConfig, SECTIONS)
