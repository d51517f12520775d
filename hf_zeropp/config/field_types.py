"""Checking and parsing values against a dataclass field's type annotation (``int | None``, ``Literal[8, 4]``,
``list[str]``, ...), and the fields grouped by subject: what :class:`hf_zeropp.ZeroPPConfig` validates every option
with, how it reads ``ZEROPP_<OPTION>`` variables and sectioned config files, and how its option table is written.
Each field's ``metadata`` holds its ``subject`` and ``doc``."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


def union_args(hint: Any) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has a type ``hint`` allows (a ``Literal``'s values are checked by :func:`_outside_literal`)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arg) for arg in typing.get_args(hint))
    if origin is Literal:
        return any(matches(value, type(arg)) for arg in typing.get_args(hint))
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


def outside_literal(value: Any, hint: Any) -> bool:
    """Whether ``hint`` holds a ``Literal`` and ``value`` is none of its values nor of the annotation's other types."""
    args = union_args(hint)
    if not any(typing.get_origin(arg) is Literal for arg in args):
        return False
    for arg in args:
        if typing.get_origin(arg) is Literal:
            if any(type(value) is type(allowed) and value == allowed for allowed in typing.get_args(arg)):
                return False
        elif matches(value, arg):
            return False
    return True


def allowed_values(hint: Any, labels: dict[Any, str]) -> str:
    """The values ``hint`` allows, in words: ``0 (data parallel), 1, 2 or 3``, ``one of ('no', 'bf16', 'fp16')``,
    ``8, 4 or None``, ``an integer or 'node'``."""
    items = []
    for arg in union_args(hint):
        if typing.get_origin(arg) is Literal:
            values = typing.get_args(arg)
            if len(values) > 1 and all(isinstance(v, str) for v in values):
                items.append(f"one of {values!r}")
            else:
                items += [labels.get(v, repr(v)) for v in values]
        elif arg is type(None):
            items.append("None")
        elif arg is int:
            items.append("an integer")
        else:
            items.append(describe(arg))
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list:
        return f"a list of {describe(args[0])}"
    if typing.get_origin(hint) is Literal:
        return " or ".join(dict.fromkeys(type(a).__name__ for a in args))
    if args:
        return " or ".join(dict.fromkeys(describe(a) for a in args))
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def parse_env(key: str, raw: str, hint: Any) -> Any:
    text = raw.strip()
    if text.lower() in ("none", "null", "") and matches(None, hint):
        return None
    if matches(True, hint):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={raw!r} is not a boolean; use true or false")
    if matches(0.5, hint):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}={raw!r} is not a number") from None
    if matches(1, hint):
        try:
            return int(text)
        except ValueError:
            if matches(text, hint):
                return text
            raise ValueError(f"{key}={raw!r} is not an integer") from None
    if matches([], hint):
        return [part.strip() for part in text.split(",") if part.strip()]
    return text


def _subjects(config_class: type) -> dict[str, str]:
    return {f.name: f.metadata["subject"] for f in dataclasses.fields(config_class) if "subject" in f.metadata}


def flatten_sections(values: dict[str, Any], config_class: type, sections: dict[str, str]) -> dict[str, Any]:
    """Options grouped under section keys (``gradients: {quantized_gradients: true}``; ``sections`` maps each key to
    its subject) as flat keys; flat keys pass as they are. An option under another subject's key is an error."""
    subjects = _subjects(config_class)
    flat: dict[str, Any] = {}
    for key, value in values.items():
        grouped = value if key in sections else {key: value}
        if not isinstance(grouped, dict):
            raise TypeError(f"section {key}: must hold a mapping of options, got {value!r}")
        for name, option in grouped.items():
            if key in sections and subjects.get(name, sections[key]) != sections[key]:
                home = next(section for section, subject in sections.items() if subject == subjects[name])
                raise ValueError(f"{name} belongs under {home}:, not under {key}:; move it there")
            if name in flat:
                raise ValueError(f"{name} is given twice (flat and in a section, or in two sections); keep one")
            flat[name] = option
    return flat


def grouped_table(config_class: type, sections: dict[str, str]) -> str:
    """A markdown table of the fields: a row per subject (with its section key), then each field's default and doc."""
    lines = ["| option | default | meaning |", "|---|---|---|"]
    subject = None
    for f in dataclasses.fields(config_class):
        if "subject" not in f.metadata:
            continue
        if f.metadata["subject"] != subject:
            subject = f.metadata["subject"]
            section = next(key for key, value in sections.items() if value == subject)
            lines.append(f"| **{subject}** (`{section}:`) | | |")
        lines.append(f"| `{f.name}` | {render_default(f.default)} | {f.metadata['doc']} |")
    return "\n".join(lines)


def render_default(value: Any) -> str:
    """A default as the README writes it: strings in double quotes, everything else as Python prints it."""
    return f'"{value}"' if isinstance(value, str) else repr(value)
