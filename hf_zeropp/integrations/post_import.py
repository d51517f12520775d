"""Run a function on a module right after it is first imported, before the importer gets it.

The drop-in changes names in transformers' Trainer, argument parser and training arguments. Importing those modules
up front costs each rank about 3 CPU seconds, which a script that only uses ``accelerate`` never pays under stock
``accelerate launch``. A finder first on ``sys.meta_path`` lets the import system find the module as usual, and
wraps its loader so that the function runs once the module's code has run: every later lookup of the names, from
the script or from a library subclassing them (TRL's trainers), sees the change.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def after_import(name: str, function: Callable[[ModuleType], None]) -> None:
    """Call ``function(module)`` once module ``name`` is imported: now, where it already is."""
    module = sys.modules.get(name)
    if module is not None:
        function(module)
        return
    _pending.setdefault(name, []).append(function)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def forget_pending() -> None:
    """Drop the calls still waiting for their modules."""
    _pending.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name not in _pending:
            return None
        for finder in sys.meta_path:  # the import system's own search, without this finder
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CallingAfter(spec.loader, name)
                return spec
        return None


class _CallingAfter(importlib.abc.Loader):
    """The module's own loader, then the waiting calls: taken when the module runs, not when it is found, since
    ``importlib.util.find_spec`` finds without importing."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for function in _pending.pop(self._name, []):
            function(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package...: the module's own loader
        return getattr(self._loader, name)


_FINDER = _Finder()
