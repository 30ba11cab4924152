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
