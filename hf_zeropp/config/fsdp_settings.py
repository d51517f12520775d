"""Accelerate's FSDP settings and the Trainer's ``fsdp`` / ``fsdp_config`` as hf_zeropp options.

hf_zeropp is FSDP2 underneath, so an FSDP user's settings keep their meaning on it instead of being refused: the
wrap policy becomes the FSDP units (``wrap_modules``), the resharding or sharding strategy the ZeRO stage (or hybrid
sharding), offload ``cpu_offload``, activation checkpointing ``activation_checkpointing``, CPU-RAM-efficient loading
the per-rank slice loading of ``--load_in_slices``, and the state dict type the checkpoints. The hf_zeropp config
(``zeropp:``) adds ZeRO++'s techniques on top; without one, the settings run as ``zero3`` (plain FSDP2).

Every key falls in one table of :mod:`hf_zeropp.config.fsdp_keys`: mapped (what it becomes), ignored (FSDP2 or hf_zeropp
already does what it asks, or it tunes FSDP1 only: it is said once, as a warning on rank 0, and recorded in
``comm_stats(model)["implementations"]``), or refused (a value or key, and unknown keys: a ``ValueError`` naming the
key and the alternative, raised where the settings are read, before any collective).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any

from .config import ZeroPPConfig
from .fsdp_keys import (ACCELERATE_KEYS, BACKWARD_PREFETCH, CHECKPOINT_DIFFERENCES, FALSE_WORDS, IGNORED, REFUSED_KEYS,
                        REFUSED_VALUES, SHARDING_STRATEGIES, STATE_DICT_TYPES, TRAINER_KEYS, TRAINER_WORDS, TRUE_WORDS,
                        WRAP_POLICIES)

# carry the settings from ``hf-zeropp launch`` to its workers (JSON of :class:`FsdpSettings`)
SETTINGS_VARIABLE = "HF_ZEROPP_FSDP_SETTINGS"
# set by ``hf-zeropp launch`` for its workers: how the user named the hf_zeropp config ("" = not at all), so that a
# Trainer's ``--fsdp`` is checked against what the user said rather than against the launcher's resolved defaults
CONFIG_GIVEN_VARIABLE = "HF_ZEROPP_CONFIG_GIVEN"

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


_remembered: list[FsdpSettings] = []


def remember(settings: FsdpSettings) -> None:
    """Record the FSDP settings this process runs under (the launcher's, or a TrainingArguments' taken by
    :func:`hf_zeropp.integrations.trainer.take_fsdp_config`), so that every model sharded afterwards records what they
    changed in its ``comm_stats``. The latest settings count."""
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
    if isinstance(value, bool) or text.lower() in (*TRUE_WORDS, *FALSE_WORDS):
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
    if text in TRUE_WORDS or text in FALSE_WORDS:
        return text in TRUE_WORDS
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
