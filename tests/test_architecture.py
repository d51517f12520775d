"""The package is in wings, and its imports run one way between them: from the leaves (the kernels, the private-API
shim, the testing helpers) through DeepSpeed's and Hugging Face's formats (interop), the config, the collectives
(comm), the engine and the checkpoints to the integrations, and from there only to the package itself — no module
imports one of a higher wing, and no module imports in a cycle (top-level, function-local and type-checking imports
all count). ``import hf_zeropp`` stays lazy: it loads neither the engine's sharding nor the integrations (the Trainer,
Accelerate) until a public name needs them. Around the package, the benchmarks and experiments import hf_zeropp,
never the reverse, and nothing imports the tests."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import hf_zeropp

PACKAGE = Path(hf_zeropp.__file__).resolve().parent
ROOT = PACKAGE.parent

# lowest first: a module may import its own wing and the wings before it, never one after it
WINGS = ["kernels", "_compat", "testing", "interop", "config", "comm", "engine", "checkpoint", "integrations", ""]
# modules that sit above the wing their folder names: entry points that use everything
ENTRY_POINTS = {"__main__": "", "kernels.__main__": "", "testing.conformance": ""}
# the only modules left at the top of hf_zeropp/ (the top wing, ""): every other module lives in a wing's folder
TOP_LEVEL = {"__init__.py", "__main__.py"}


def _wing(module: str) -> str:
    return ENTRY_POINTS.get(module, module.split(".")[0])


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """hf_zeropp module -> the hf_zeropp modules it imports (names relative to the package; "" is the package)."""
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                target = ".".join([*filter(None, base), *([node.module] if node.module else [])])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_zeropp"):
                target = node.module.removeprefix("hf_zeropp").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import kernels` imports the module kernels
                candidate = f"{target}.{alias.name}".lstrip(".")
                imported.add(candidate if candidate in modules else target)
        graph[name] = imported - {name}
    return graph


def test_every_module_is_in_a_wing_and_every_wing_says_what_it_may_import():
    graph = import_graph()
    assert {_wing(m) for m in graph} <= set(WINGS), sorted(m for m in graph if _wing(m) not in WINGS)
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL, f"modules at the top of hf_zeropp/ outside any wing: {sorted(top - TOP_LEVEL)}"
    for wing in ("config", "comm", "engine", "checkpoint", "integrations", "interop", "interop/deepspeed"):
        docstring = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text())) or ""
        assert "May import" in docstring, f"hf_zeropp/{wing}/__init__.py does not say what the wing may import"
        assert not [n for n in ast.parse((PACKAGE / wing / "__init__.py").read_text()).body
                    if isinstance(n, (ast.Import, ast.ImportFrom))], f"hf_zeropp/{wing}/__init__.py imports"


def test_imports_only_go_to_the_same_or_a_lower_wing_and_never_in_a_cycle():
    rank = {wing: i for i, wing in enumerate(WINGS)}
    graph = import_graph()
    upward = [(m, d) for m, deps in graph.items() for d in deps if rank[_wing(d)] > rank[_wing(m)]]
    assert not upward, f"imports against the wings' order: {upward}"
    visiting, done = set(), set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in visiting, f"import cycle: {' -> '.join([*path, module])}"
        if module in done:
            return
        visiting.add(module)
        for dependency in sorted(graph[module]):
            visit(dependency, [*path, module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_import_hf_zeropp_and_its_core_names_load_no_integration():
    """``import hf_zeropp`` loads the failure reporter only; the engine's and the checkpoints' public names load the
    wings below them, never the integrations (the Trainer, Accelerate: about 3 s of every launcher's start)."""
    core = [n for n in hf_zeropp.__all__ if n != "__version__"
            and not hf_zeropp._MODULE_OF[n].startswith("integrations.")]
    code = f"""
import json
import sys
import hf_zeropp
first = sorted(m for m in sys.modules if m.startswith("hf_zeropp."))
for name in {core!r}:
    getattr(hf_zeropp, name)
after = sorted(m for m in sys.modules if m.startswith(("hf_zeropp.integrations", "transformers.trainer",
                                                        "accelerate.accelerator")))
print(json.dumps([first, after]))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    first, after = json.loads(run.stdout.splitlines()[-1])
    assert all(m.startswith(("hf_zeropp._compat", "hf_zeropp.engine")) for m in first), first
    assert "hf_zeropp.engine.sharding" not in first and not after, (first, after)
    assert core and set(hf_zeropp._MODULE_OF) - set(core), "the public API has core and integration names"


def _top_level_imports(path: Path) -> set[str]:
    """The first component of every absolute import in ``path`` (relative imports stay inside their package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_benchmarks_and_experiments_import_the_package_never_the_reverse_and_nothing_imports_the_tests():
    package_imports = set().union(*(_top_level_imports(p) for p in PACKAGE.rglob("*.py")))
    assert not package_imports & {"scripts", "tests", "benchmarks", "experiments"}, "hf_zeropp imports from outside"
    outside = [*(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    importing_tests = [str(p.relative_to(ROOT)) for p in outside if "tests" in _top_level_imports(p)]
    assert not importing_tests, f"modules that import the tests: {importing_tests}"
    studies = [p for folder in ("benchmarks", "experiments") for p in (ROOT / "scripts" / folder).rglob("*.py")]
    assert len(studies) >= 10
    assert any("hf_zeropp" in _top_level_imports(p) for p in studies)
    # the scripts are imported by their package names only (python -m scripts.benchmarks.cluster from the checkout)
    bare = {"benchmarks", "experiments", "train_gpt", "emulate_cluster", "fidelity", "comm_table"}
    by_bare_name = [str(p.relative_to(ROOT)) for p in outside if _top_level_imports(p) & bare]
    assert not by_bare_name, f"imports that rely on scripts/ being on the module path: {by_bare_name}"
