"""The package's imports run one way: from the leaves (kernels, node-size detection, the private-API shim) through
config, topology, the meter, the techniques and sharding to checkpoints and the integrations — no module imports one
above its layer, so there is no import cycle (top-level, function-local and type-checking imports all count). Around
the package, the benchmarks and experiments import hf_zeropp, never the reverse, and nothing imports the tests."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_zeropp

PACKAGE = Path(hf_zeropp.__file__).resolve().parent
ROOT = PACKAGE.parent

LAYERS = [
    {"kernels", "kernels.reference", "kernels.allocation", "kernels.ops", "kernels._build", "node_size", "layout",
     "config_rules", "deepspeed_config", "deepspeed_optim", "deepspeed_plugin", "deepspeed_training", "field_types",
     "fsdp_keys", "presets", "_compat", "_compat.torch_api", "_compat.transformers_api", "_compat.accelerate_api",
     "_compat.tested_versions", "hf_checkpoint", "skeleton", "failure_report", "testing", "testing.corpus",
     "testing.spawn", "testing.tiny_models", "testing.payloads", "testing.emulated_network", "testing.emulated_cluster",
     "testing.threaded_ranks"},
    {"deepspeed_files", "deepspeed_zero", "deepspeed_universal", "deepspeed_checkpoint"},
    {"config"},
    {"topology", "fsdp_settings"},
    {"comm_meter", "hpz", "qgz_payload"},
    {"hybrid"},
    {"auto"},
    {"qwz", "qgz", "frozen", "full_state", "inference", "state", "optimizer_hooks", "materialize", "auto_trial",
     "replicated"},
    {"reports", "runtime"},
    {"sharding"},
    {"checkpoint", "deepspeed_restore", "deepspeed_convert"},
    {"accelerate_integration"},
    {"trainer"},
    {"launch"},
    {"dropin"},
    {"", "__main__", "kernels.__main__", "testing.conformance"},
]


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


def test_every_module_has_a_layer():
    placed = set().union(*LAYERS)
    assert set(import_graph()) <= placed, sorted(set(import_graph()) - placed)


def test_imports_only_go_to_the_same_or_a_lower_layer_and_never_in_a_cycle():
    layer = {module: i for i, members in enumerate(LAYERS) for module in members}
    graph = import_graph()
    upward = [(m, d) for m, deps in graph.items() for d in deps if layer[d] > layer[m]]
    assert not upward, f"imports against the layering: {upward}"
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
