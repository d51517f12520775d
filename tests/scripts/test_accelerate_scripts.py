"""The lane of Accelerate's own test scripts (scripts/accelerate_scripts.py, which scripts/test_accelerate_scripts.sh
runs beside the suite): the scripts it leaves out and the checks it skips by name are ones the installed Accelerate
ships, and docs/design.md gives each with its reason. The launches themselves run in the lane, not here."""

from __future__ import annotations

import importlib.util

from paths import ROOT


def _lane():
    spec = importlib.util.spec_from_file_location("accelerate_scripts", ROOT / "scripts" / "accelerate_scripts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_left_out_and_check_skipped_is_in_the_installed_accelerate():
    lane = _lane()
    found = set(lane.found_scripts())
    assert not [script for script in [*lane.OUT, *lane.SKIPPED, *lane.TWO_PROCESSES] if script not in found]
    for script, checks in lane.SKIPPED.items():
        source = (lane.scripts_folder() / script).read_text()
        assert all(f"def {name}(" in source for name in checks), (script, checks)
        assert script not in lane.OUT


def test_the_design_doc_names_every_script_left_out_and_check_skipped():
    lane = _lane()
    design = (ROOT / "docs" / "design.md").read_text()
    names = [*lane.OUT, *(name for checks in lane.SKIPPED.values() for name in checks)]
    assert not [name for name in names if f"`{name}`" not in design]
