"""The versions hf_zeropp was last tested with (``locked-versions.txt`` beside this file, which
``scripts/setup.sh`` installs exactly), and which installed ones are newer.

hf_zeropp reaches into the internals of the packages named in :data:`WATCHED` (this package's other modules list
each internal), which ship every few weeks; a release newer than the lock has not been through the test suite.
``hf-zeropp env`` and the launcher's start line say so in one line, so a report of a break names the version."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

LOCK = Path(__file__).with_name("locked-versions.txt")
WATCHED = ("torch", "transformers", "accelerate", "datasets", "safetensors", "peft", "trl", "kernels",
           "huggingface_hub")


def locked() -> dict[str, str]:
    """Package name (normalised) -> the locked version."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        name, separator, version = line.partition("==")
        if separator and not line.startswith("#"):
            pins[_normalised(name)] = version.strip()
    return pins


def untested() -> list[str]:
    """``"transformers 5.26.0"`` for each watched package installed at a version newer than the lock."""
    pins, newer = locked(), []
    for package in WATCHED:
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        pin = pins.get(_normalised(package))
        try:
            if pin is not None and Version(installed).release > Version(pin).release:
                newer.append(f"{package} {installed}")
        except InvalidVersion:
            continue
    return newer


def untested_line() -> str | None:
    """The one line that flags untested versions, or None when every watched package is at most the lock's."""
    newer = untested()
    if not newer:
        return None
    return (f"untested: {', '.join(newer)} (newer than the versions hf_zeropp's tests passed with, "
            f"{LOCK.name}; report a failure with this line)")


def _normalised(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")
