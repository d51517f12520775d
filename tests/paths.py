"""Where the files the tests share lie, for a test module in any folder of tests/: the checkout's root (the working
directory of launches, recipes/, scripts/), the stock scripts the launch tests run and the committed fixtures.

The test modules sit in folders that mirror the package's wings, without ``__init__.py``: pytest imports each by its
file name (its folder first on ``sys.path``) and this folder, the conftest's, is on ``sys.path`` too, so the helpers
here (``import background``, ``from faults import ...``) import from anywhere. Test file names stay unique across the
folders (pytest refuses two of the same name)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
LAUNCH_SCRIPTS = TESTS / "launch_scripts"
DEEPSPEED_FIXTURES = TESTS / "fixtures" / "deepspeed"
