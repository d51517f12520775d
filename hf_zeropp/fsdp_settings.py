"""Accelerate's FSDP settings and the Trainer's ``fsdp`` / ``fsdp_config`` as hf_zeropp options.

hf_zeropp is FSDP2 underneath, so an FSDP user's settings keep their meaning on it instead of being refused: the
wrap policy becomes the FSDP units (``wrap_modules``), the resharding or sharding strategy the ZeRO stage (or hybrid
sharding), offload ``cpu_offload``, activation checkpointing ``activation_checkpointing``, CPU-RAM-efficient loading
the per-rank slice loading of ``--load_in_slices``, and the state dict type the checkpoints. The hf_zeropp config
(``zeropp:``) adds ZeRO++'s techniques on top; without one, the settings run as ``zero3`` (plain FSDP2).

Every key falls in one table: :data:`MAPPED` (what it becomes), :data:`IGNORED` (FSDP2 or hf_zeropp already does what
it asks, or it tunes FSDP1 only: it is said once, as a warning on rank 0, and recorded in
``comm_stats(model)["implementations"]``), or refused (:data:`REFUSED_VALUES`, :data:`REFUSED_KEYS`, unknown keys: a
``ValueError`` naming the key and the alternative, raised where the settings are read, before any collective).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any

from .config import ZeroPPConfig

# carry the settings from ``hf-zeropp launch`` to its workers (JSON of :class:`FsdpSettings`)
SETTINGS_VARIABLE = "HF_ZEROPP_FSDP_SETTINGS"
# set by ``hf-zeropp launch`` for its workers: how the user named the hf_zeropp config ("" = not at all), so that a
# Trainer's ``--fsdp`` is checked against what the user said rather than against the launcher's resolved defaults
CONFIG_GIVEN_VARIABLE = "HF_ZEROPP_CONFIG_GIVEN"

# Accelerate's names (FSDP_SHARDING_STRATEGY, in ShardingStrategy's numbering from 1): the ZeRO stage and, for the
# hybrid strategies, sharding inside each node only
SHARDING_STRATEGIES = {"FULL_SHARD": (3, "world"), "SHARD_GRAD_OP": (2, "world"), "NO_SHARD": (0, "world"),
                       "HYBRID_SHARD": (3, "node"), "HYBRID_SHARD_ZERO2": (2, "node")}
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")  # StateDictType's numbering from 1
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_TRUE, _FALSE = ("true", "yes", "y", "t", "on", "1"), ("false", "no", "n", "f", "off", "0")

# What each key becomes (keys as Accelerate's fsdp_config writes them without the ``fsdp_`` prefix; the Trainer's
# fsdp_config uses the same names, with ``cpu_offload`` for ``offload_params``). README and docs/design.md list them.
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


@dataclass(frozen=True)
class _Integration:
    """How one integration names and defaults its FSDP settings."""

    where: str  # how messages name the settings
    prefix: str  # how messages name a key (the YAML's fsdp_ prefix)
    keys: tuple[str, ...]
    offload_key: str
    version: int
    auto_wrap_policy: str
    cpu_ram_efficient_loading: bool
    state_dict_type: dict[int, str]  # by version

    def name(self, key: str) -> str:
        return self.prefix + key


ACCELERATE = _Integration("the Accelerate config's fsdp_config", "fsdp_", ACCELERATE_KEYS, "offload_params", 1,
                          "NO_WRAP", True, {1: "FULL_STATE_DICT", 2: "SHARDED_STATE_DICT"})
TRAINER = _Integration("TrainingArguments' fsdp and fsdp_config", "", TRAINER_KEYS, "cpu_offload", 2,
                       "TRANSFORMER_BASED_WRAP", False, {1: "FULL_STATE_DICT", 2: "FULL_STATE_DICT"})


@dataclass(frozen=True)
class FsdpSettings:
    """FSDP settings read as hf_zeropp options.

    ``options`` are what the settings say explicitly (a ``zeropp:`` config that says otherwise is an error);
    ``implied`` what an integration's defaults imply (applied unless the hf_zeropp config sets the option);
    ``stated_by`` names, per option, the setting it came from; ``warnings`` maps ``key=value`` to what runs instead.
    """

    where: str
    options: dict[str, Any] = field(default_factory=dict)
    implied: dict[str, Any] = field(default_factory=dict)
    stated_by: dict[str, str] = field(default_factory=dict)
    load_in_slices: bool = False
    state_dict_type: str = "SHARDED_STATE_DICT"
    warnings: dict[str, str] = field(default_factory=dict)

    def apply(self, config: ZeroPPConfig, given: str | None) -> ZeroPPConfig:
        """``config`` (the hf_zeropp config resolved without these settings) with them applied. ``given`` says how
        the user named that config (e.g. ``"zeropp: 'zeropp'"``), or is None when they named none, so that ``config``
        is the defaults (zero3). A named config states its stage and every option it sets away from the default;
        where the FSDP settings say otherwise, the error names both."""
        changes = {}
        for name, value in self.options.items():
            current = getattr(config, name)
            stated = given is not None and (name == "stage" or current != _default(name))
            if stated and current != value:
                raise ValueError(f"{self.stated_by[name]} in {self.where} means {name}={value!r}, but {given} sets "
                                 f"{name}={current!r}; change one of them so that they agree")
            changes[name] = value
        for name, value in self.implied.items():
            if getattr(config, name) == _default(name):
                changes[name] = value
        try:
            return dataclasses.replace(config, **changes)
        except (TypeError, ValueError) as error:
            settings = ", ".join(dict.fromkeys(self.stated_by[name] for name in self.options))
            raise ValueError(f"{settings or 'the FSDP settings'} in {self.where} with {given or 'zero3'}: "
                             f"{' '.join(str(error).split())}") from None

    def describe(self, given: str | None) -> str:
        """What rank 0's start line says about the settings: how they run, and on which config."""
        units = self.options.get("wrap_modules", self.implied.get("wrap_modules"))
        stage = self.options.get("stage")
        parts = [f"units {', '.join(units)}" if units else
                 "no layer is a unit (NO_WRAP)" if units == [] else "units from the model's _no_split_modules"]
        if stage is not None:
            parts.append(f"stage {stage}" + (" hybrid (sharded in the node)" if self.options.get("shard_group") ==
                                              "node" else ""))
        parts += [label for option, label in (("cpu_offload", "CPU offload"),
                                              ("activation_checkpointing", "activation checkpointing"))
                  if self.options.get(option)]
        if self.load_in_slices:
            parts.append("from_pretrained in per-rank slices")
        parts.append(f"{self.state_dict_type} as hf_zeropp's checkpoints")
        base = f"on {given}" if given else "no hf_zeropp config named: zero3 with these settings"
        return f"FSDP settings from {self.where} kept ({'; '.join(parts)}), {base}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FsdpSettings:
        return cls(**json.loads(text))


def from_accelerate(settings: dict[str, Any], mixed_precision: str | None = None) -> FsdpSettings:
    """Accelerate's FSDP settings: the YAML's ``fsdp_config`` with the ``--fsdp_*`` options given on top, keys with or
    without the ``fsdp_`` prefix (Accelerate takes both). ``mixed_precision`` is the launch's, when it sets one."""
    values = _without_prefix(settings, ACCELERATE)
    return _read(values, ACCELERATE, mixed_precision)


def from_training_arguments(fsdp: Any, fsdp_config: dict[str, Any] | str | None,
                            mixed_precision: str | None = None) -> FsdpSettings:
    """TrainingArguments' ``fsdp`` (True, or the legacy words such as ``"full_shard auto_wrap"``) and
    ``fsdp_config`` (a dict, JSON text as the command line gives it, or a JSON file's path), as the Trainer reads
    them."""
    if isinstance(fsdp_config, str):
        try:
            if fsdp_config.lstrip().startswith("{"):
                fsdp_config = json.loads(fsdp_config)
            else:
                with open(fsdp_config, encoding="utf-8") as file:
                    fsdp_config = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"fsdp_config={fsdp_config!r} is neither a JSON object nor a readable JSON file "
                             f"({error})") from None
    values = _without_prefix(fsdp_config or {}, TRAINER)
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    from_words = {}  # keys the words set, named as the user wrote them
    for word in words:
        word = str(word).lower()
        if word not in TRAINER_WORDS:
            raise ValueError(f"fsdp={fsdp!r}: {word!r} is not an FSDP option; use {', '.join(TRAINER_WORDS)}, or "
                             f"fsdp=True with fsdp_config")
        key = "cpu_offload" if word == "offload" else None if word == "auto_wrap" else "reshard_after_forward"
        if key is not None and key not in values:  # fsdp_config's own value wins, as in the Trainer
            values[key] = True if key == "cpu_offload" else word.upper()
            from_words[key] = f"fsdp={fsdp!r}"
    return _read(values, TRAINER, mixed_precision, from_words)


def key_table() -> str:
    """The README's and docs/design.md's table of every FSDP setting: mapped, ignored with a warning, or refused."""
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


_remembered: list[FsdpSettings] = []


def remember(settings: FsdpSettings) -> None:
    """Record the FSDP settings this process runs under (the launcher's, or a TrainingArguments' taken by
    :func:`hf_zeropp.trainer.take_fsdp_config`), so that every model sharded afterwards records what they changed in
    its ``comm_stats``. The latest settings count."""
    _remembered[:] = [settings]


def remembered() -> FsdpSettings | None:
    return _remembered[0] if _remembered else None


def zeropp_given(environ: dict[str, str]) -> str | None:
    """How the user named the hf_zeropp config in ``environ``: what ``hf-zeropp launch`` recorded for its workers,
    else ``ZEROPP_CONFIG`` or ``ZEROPP_<OPTION>`` variables (``ZEROPP_NODE_SIZE`` describes the launch, not the
    config); None when nothing names one."""
    if CONFIG_GIVEN_VARIABLE in environ:
        return environ[CONFIG_GIVEN_VARIABLE] or None
    names = sorted(name for name in environ if name.startswith("ZEROPP_") and name != "ZEROPP_NODE_SIZE")
    return f"{', '.join(names)} in the environment" if names else None


# ---------------------------------------------------------------- reading


def _without_prefix(settings: dict[str, Any], integration: _Integration) -> dict[str, Any]:
    if not isinstance(settings, dict):
        raise ValueError(f"{integration.where} must be a mapping of FSDP settings, got {settings!r}")
    values: dict[str, Any] = {}
    for key, value in settings.items():
        name = key.removeprefix("fsdp_")
        if name not in integration.keys:
            raise ValueError(f"{integration.where} key {key!r} is not an FSDP setting hf_zeropp knows; use "
                             f"{', '.join(integration.name(k) for k in integration.keys)}")
        if name in values and values[name] != value:
            raise ValueError(f"{integration.where} sets {name!r} twice, with and without the fsdp_ prefix "
                             f"({values[name]!r}, {value!r}); keep one")
        values[name] = value
    return values


def _read(values: dict[str, Any], integration: _Integration, mixed_precision: str | None,
          shown: dict[str, str] | None = None) -> FsdpSettings:
    """The settings ``values`` (keys without prefix) of ``integration``; ``shown`` names the keys the user did not
    write as such (the Trainer's ``fsdp`` words)."""
    name = integration.name
    shown = shown or {}
    for key, value in values.items():
        if key in REFUSED_KEYS and value not in (None, False, "", [], {}, "false", "False"):
            raise ValueError(f"{name(key)}={value!r} in {integration.where}: {REFUSED_KEYS[key]}")
    version = _version(values, integration)
    options: dict[str, Any] = {}
    implied: dict[str, Any] = {}
    stated_by: dict[str, str] = {}
    warnings: dict[str, str] = {}

    def state(option: str, value: Any, *keys: str) -> None:
        options[option] = value
        stated_by[option] = " and ".join(dict.fromkeys(shown.get(k, f"{name(k)}={values[k]!r}") for k in keys))

    strategies = {key: _strategy(key, values[key], integration)
                  for key in ("sharding_strategy", "reshard_after_forward") if key in values}
    if len({stage for stage, _ in strategies.values()}) > 1 or len({g for _, g in strategies.values() if g}) > 1:
        raise ValueError(f"{name('sharding_strategy')}={values['sharding_strategy']!r} and "
                         f"{name('reshard_after_forward')}={values['reshard_after_forward']!r} in {integration.where} "
                         f"disagree; keep one of them")
    for key, (stage, shard_group) in strategies.items():
        state("stage", stage, *strategies)
        if shard_group:
            state("shard_group", shard_group, key)

    policy = str(values.get("auto_wrap_policy", integration.auto_wrap_policy)).upper()
    if policy not in WRAP_POLICIES:
        raise ValueError(f"{name('auto_wrap_policy')}={values['auto_wrap_policy']!r} in {integration.where} is not a "
                         f"wrap policy; use {', '.join(WRAP_POLICIES)}")
    _refuse_value(integration, "auto_wrap_policy", policy)
    classes = _classes(values.get("transformer_layer_cls_to_wrap"), integration)
    if classes is not None and policy != "TRANSFORMER_BASED_WRAP":
        raise ValueError(f"{name('transformer_layer_cls_to_wrap')}={values['transformer_layer_cls_to_wrap']!r} in "
                         f"{integration.where} names the units of TRANSFORMER_BASED_WRAP, but the wrap policy is "
                         f"{policy} (Accelerate would ignore the classes); set {name('auto_wrap_policy')}: "
                         f"TRANSFORMER_BASED_WRAP, or remove them")
    if classes is not None:
        state("wrap_modules", classes, "transformer_layer_cls_to_wrap")
    elif policy == "NO_WRAP" and "auto_wrap_policy" in values:
        state("wrap_modules", [], "auto_wrap_policy")
    elif policy == "NO_WRAP":
        implied["wrap_modules"] = []
        stated_by["wrap_modules"] = f"{name('auto_wrap_policy')} left out (NO_WRAP)"

    for option, key in (("cpu_offload", integration.offload_key), ("activation_checkpointing",
                                                                     "activation_checkpointing")):
        if key in values:
            state(option, _bool(key, values[key], integration), key)
    if _bool("activation_checkpointing_offload", values.get("activation_checkpointing_offload", False), integration):
        _refuse_value(integration, "activation_checkpointing_offload", True)
    load_in_slices = _bool("cpu_ram_efficient_loading",
                           values.get("cpu_ram_efficient_loading", integration.cpu_ram_efficient_loading), integration)

    state_dict_type = _named("state_dict_type", values.get("state_dict_type", integration.state_dict_type[version]),
                             STATE_DICT_TYPES, integration)
    _refuse_value(integration, "state_dict_type", state_dict_type)
    warnings[f"{name('state_dict_type')}={state_dict_type}"] = CHECKPOINT_DIFFERENCES[state_dict_type]
    if "backward_prefetch" in values:
        _named("backward_prefetch", values["backward_prefetch"], BACKWARD_PREFETCH, integration)
    for key in IGNORED:  # SIZE_BASED_WRAP, the one policy that reads min_num_params, was refused above
        if key in values:
            warnings[f"{name(key)}={values[key]!r}"] = f"ignored: {IGNORED[key]}"
    if mixed_precision in ("bf16", "fp16"):
        warnings[f"mixed_precision={mixed_precision}"] = (
            f"Accelerate's FSDP2 plugin reduces gradients in {mixed_precision} and returns the outputs in "
            f"{mixed_precision}; hf_zeropp computes in {mixed_precision} and reduces gradients in reduce_dtype (fp32 "
            f"unless the hf_zeropp config sets reduce_dtype: {mixed_precision})")
    return FsdpSettings(integration.where, options, implied, stated_by, load_in_slices, state_dict_type, warnings)


def _version(values: dict[str, Any], integration: _Integration) -> int:
    version = values.get("version", integration.version)
    if str(version) not in ("1", "2"):
        raise ValueError(f"{integration.name('version')}={version!r} in {integration.where} is not an FSDP version; "
                         f"use 1 or 2")
    return int(version)


def _strategy(key: str, value: Any, integration: _Integration) -> tuple[int, str | None]:
    """A reshard flag (stage 3 or 2, FSDP2's form) or a sharding strategy by name or number (FSDP1's form): the
    stage, and the shard group a strategy names."""
    text = str(value).strip()
    if isinstance(value, bool) or text.lower() in (*_TRUE, *_FALSE):
        return (3 if _bool(key, value, integration) else 2), None
    names = list(SHARDING_STRATEGIES)
    if text.isdigit() and 1 <= int(text) <= len(names):
        text = names[int(text) - 1]
    if text.upper() not in SHARDING_STRATEGIES:
        raise ValueError(f"{integration.name(key)}={value!r} in {integration.where} is neither true/false nor a "
                         f"sharding strategy; use true, false or one of {', '.join(names)}")
    return SHARDING_STRATEGIES[text.upper()]


def _classes(value: Any, integration: _Integration) -> list[str] | None:
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    names = [str(n).strip() for n in names or [] if str(n).strip()]
    if not names:
        raise ValueError(f"{integration.name('transformer_layer_cls_to_wrap')}={value!r} in {integration.where} "
                         f"names no layer class; give class names such as 'GPT2Block' (comma-separated or a list)")
    return names


def _bool(key: str, value: Any, integration: _Integration) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{integration.name(key)}={value!r} in {integration.where} is not a bool; use true or false")


def _named(key: str, value: Any, names: tuple[str, ...], integration: _Integration) -> str:
    """An enumeration given by name (any case) or by its number from 1, as Accelerate accepts it."""
    text = str(value).strip()
    if text.isdigit() and 1 <= int(text) <= len(names):
        return names[int(text) - 1]
    if text.upper() in names:
        return text.upper()
    raise ValueError(f"{integration.name(key)}={value!r} in {integration.where} is invalid; use one of "
                     f"{', '.join(names)}")


def _refuse_value(integration: _Integration, key: str, value: Any) -> None:
    reason = REFUSED_VALUES.get((key, value))
    if reason is not None:
        raise ValueError(f"{integration.name(key)}={value} in {integration.where}: {reason}")


def _default(name: str) -> Any:
    option = next(f for f in fields(ZeroPPConfig) if f.name == name)
    return option.default_factory() if option.default_factory is not dataclasses.MISSING else option.default


__all__ = ["FsdpSettings", "from_accelerate", "from_training_arguments", "remember", "remembered", "zeropp_given"]
