"""The README and docs/ as a manual that works: every relative link resolves, every file of this repository a
page names exists, and every ``--flag`` a shown command gives to one of this repository's scripts (``scripts/X.py``
or ``python -m scripts.X`` / ``-m hf_zeropp.X``) is one the script defines."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import pytest
from transformers import TrainingArguments
from paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:scripts|recipes|tests|hf_zeropp|cuda|docs)/[\w./*{},<>-]*[\w*}>])")
ARGUMENTS = r"((?:\s+(?:--?[\w-]+(?:=\S+)?|[^\s|;&>`\\-][^\s|;&>`]*))*)"
SCRIPT_CALL = re.compile(r"(scripts/[\w/-]+\.py)" + ARGUMENTS)
MODULE_CALL = re.compile(r"-m ((?:scripts|hf_zeropp)(?:\.\w+)+)" + ARGUMENTS)
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _expand(pattern: str) -> list[str]:
    """``a/{b,c}.md`` -> both; ``<name>`` and ``*`` become globs."""
    pattern = re.sub(r"<[^>]+>", "*", pattern)
    match = re.search(r"\{([^}]*)\}", pattern)
    if not match:
        return [pattern]
    return list(itertools.chain.from_iterable(
        _expand(pattern[:match.start()] + choice + pattern[match.end():]) for choice in match.group(1).split(",")))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_links_resolve(page):
    missing = [target for target in LINK.findall(page.read_text())
               if "://" not in target and not (page.parent / target).exists()]
    assert not missing, f"{_page_id(page)} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_repository_files_exist(page):
    missing = []
    for path in set(REPO_PATH.findall(page.read_text())):
        if not any(list(ROOT.glob(candidate)) for candidate in _expand(path.rstrip("."))):
            missing.append(path)
    assert not missing, f"{_page_id(page)} names files that do not exist: {sorted(missing)}"


def _source(script: Path) -> str:
    """The script's source and that of the modules it imports from its own folder (its argument helpers); for a
    package run with ``-m`` (its ``__main__.py``), every module of the package."""
    source = script.read_text()
    if script.name == "__main__.py":
        source += "".join(path.read_text() for path in sorted(script.parent.glob("*.py")) if path != script)
    for name in set(re.findall(r"^(?:from \.?|import )(\w+)", source, re.M)):
        local = script.parent / name
        for path in [local.with_suffix(".py"), *sorted(local.glob("*.py"))]:
            if path.is_file():
                source += path.read_text()
    return source


def _defined_flags(script: Path) -> set[str]:
    """Flags a script accepts, from its source: argparse options (``--no-X`` of a BooleanOptionalAction too), and for
    HfArgumentParser scripts the fields of TrainingArguments, ``zeropp`` and the script's own dataclass fields."""
    source = _source(script)
    flags = {name.replace("-", "_") for name in re.findall(r"""["']--([\w-]+)["']""", source)}
    if "BooleanOptionalAction" in source:
        flags |= {f"no_{flag}" for flag in flags}
    if "HfArgumentParser" in source or "TrainingArguments" in source:
        flags |= {f.name for f in dataclasses.fields(TrainingArguments)} | {"zeropp"}
        flags |= set(re.findall(r"^\s+(\w+):\s*[\w\[\]|. ]+=", source, re.M))
    return flags


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_shown_commands_use_flags_their_scripts_define(page):
    wrong = []
    for snippet in CODE.findall(page.read_text()):
        for line in snippet.replace("\\\n", " ").splitlines():
            command = line.split(" #")[0]  # not a shell comment's words
            calls = [(ROOT / script, script, rest) for script, rest in SCRIPT_CALL.findall(command)]
            calls += [(ROOT / (module.replace(".", "/") + ".py"), module, rest)
                      for module, rest in MODULE_CALL.findall(command)]
            for path, script, rest in calls:
                if not path.is_file() and (path.with_suffix("") / "__main__.py").is_file():
                    path = path.with_suffix("") / "__main__.py"
                if not path.is_file():
                    if "/" not in script:
                        wrong.append(f"-m {script}: no such module")
                    continue  # a missing path: test_named_repository_files_exist reports it
                defined = _defined_flags(path)
                for flag in re.findall(r"(?:^|\s)--([\w-]+)", rest):
                    if flag.replace("-", "_") not in defined:
                        wrong.append(f"{script} --{flag}")
    assert not wrong, f"{_page_id(page)} shows flags its scripts do not define: {sorted(set(wrong))}"
