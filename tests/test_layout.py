"""The package's layering: what ``import rollout_trio`` loads, and who imports whom."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rollout_trio"
#: The synchronous contract layer: assembly, normalization, padding, the result types.
PURE = ["_assemble", "_check", "_interaction", "_normalize", "_padding", "_rollout_group", "_trajectory"]


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


@pytest.mark.parametrize("statement", ["import rollout_trio", "import rollout_trio.workflows"])
def test_importing_the_package_loads_no_engine(statement: str) -> None:
    mods = loaded_after(statement)
    assert "rollout_trio" in mods
    loaded = sorted(m for m in mods if m.startswith("rollout_trio.engines") or m == "transformers")
    assert loaded == []


def _runtime_imports(path: Path) -> tuple[set[str], list[str]]:
    """Module-level package imports (not under TYPE_CHECKING), and imports inside functions."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    local: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            func = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.ImportFrom) and child.level == 1 and child.module:
                (local.append(child.module) if in_function else top.add(child.module.split(".")[0]))
            elif isinstance(child, ast.Import) and not in_function:
                top.update(a.name.split(".")[0] for a in child.names)
            visit(child, func)

    visit(tree, False)
    return top, local


@pytest.mark.parametrize("name", PURE)
def test_contract_modules_are_free_of_trio_and_of_lazy_imports(name: str) -> None:
    top, local = _runtime_imports(PACKAGE / f"{name}.py")
    assert "trio" not in top
    assert local == []  # a function-local import is how an import cycle hides


def test_top_level_modules_import_each_other_without_cycles() -> None:
    graph = {}
    for path in PACKAGE.glob("*.py"):
        top, _ = _runtime_imports(path)
        graph[path.stem] = {m for m in top if (PACKAGE / f"{m}.py").exists()}
    done: set[str] = set()

    def walk(node: str, stack: list[str]) -> None:
        assert node not in stack, f"import cycle: {' -> '.join([*stack, node])}"
        if node in done:
            return
        for dep in graph.get(node, ()):
            walk(dep, [*stack, node])
        done.add(node)

    for node in graph:
        walk(node, [])


# -- issue 16 item 8: the InferenceEngine protocol's home pulls in no concrete engine -----


def test_the_protocols_home_loads_no_concrete_engine() -> None:
    mods = loaded_after("from rollout_trio.engines import InferenceEngine")
    assert sorted(m for m in mods if m.startswith("rollout_trio.engines")) == [
        "rollout_trio.engines",
        "rollout_trio.engines._protocol",
    ]


def _static_import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, TYPE_CHECKING imports included (as a
    type checker sees them); ``from pkg import name`` depends on ``pkg`` and on
    ``pkg.name`` when that is a module."""
    root = PACKAGE.parent
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                deps.update(t for t in [target, *(f"{target}.{a.name}" for a in node.names)] if t in modules)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
        graph[name] = deps - {name}
    return graph


def test_no_import_cycle_runs_through_the_engines() -> None:
    """It used to: engines -> _replay -> executor -> ... -> engines (and _local through the
    package root), a circle of 18 modules as a type checker sees them."""
    graph = _static_import_graph()

    def reaches(start: str, goal: str) -> list[str] | None:
        stack, seen = [[start]], {start}
        while stack:
            path = stack.pop()
            for dep in graph[path[-1]]:
                if dep == goal:
                    return [*path, dep]
                if dep not in seen:
                    seen.add(dep)
                    stack.append([*path, dep])
        return None

    for name in sorted(graph):
        if name.startswith("rollout_trio.engines"):
            cycle = reaches(name, name)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


# -- issue 34 (Design): the engines never import from the executor --------------------


def test_no_engine_module_imports_the_executor() -> None:
    """It used to: engines/_replay imported executor._dump (under TYPE_CHECKING and in
    ``from_dump``); the engines are reached by the executor, never the other way."""
    graph = _static_import_graph()
    offenders = {
        name: sorted(d for d in deps if d == "rollout_trio.executor" or d.startswith("rollout_trio.executor."))
        for name, deps in graph.items()
        if name.startswith("rollout_trio.engines")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_remote_engine_modules_stay_small() -> None:
    """``engines/_remote.py`` was 1,046 lines; it splits along the trust rules (issue 34)."""
    for name in ["_remote", "_remote_fleet", "_remote_segments", "_remote_service", "_version_policy", "_remote_http"]:
        lines = (PACKAGE / "engines" / f"{name}.py").read_text().count("\n")
        assert lines <= 500, f"engines/{name}.py has {lines} lines"
