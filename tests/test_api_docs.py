"""The API reference builds from the docstrings with no warning (issue 32 item 4).

``python -W error docs/api/build.py OUT`` (pdoc; docs/api/build.py says why pdoc) runs in a
child process, because the build points the public names' ``__module__`` back at their
defining modules for pdoc, which this test process should not see.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import rollout_trio

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("pdoc")


@pytest.mark.slow
def test_the_api_reference_builds_with_warnings_as_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "docs" / "api" / "build.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    root_page = (tmp_path / "rollout_trio.html").read_text()
    for name in ("Trajectory", "run_group", "open_executor", "rollout_time_affine", "WorkflowContractError"):
        assert f'id="{name}"' in root_page, name
    for module in ("engines", "executor", "testing/strategies", "workflows"):
        assert (tmp_path / "rollout_trio" / f"{module}.html").is_file(), module


def _missing_sections(fn) -> list[str]:  # noqa: ANN001
    doc = inspect.getdoc(fn) or ""
    signature = inspect.signature(fn)
    missing = []
    if [p for p in signature.parameters if p not in ("self", "cls")] and "Args:" not in doc:
        missing.append("Args")
    if signature.return_annotation not in ("None", None) and not ("Returns:" in doc or "Yields:" in doc):
        missing.append("Returns")
    if "Raises:" not in doc:
        missing.append("Raises")
    return missing


#: Root functions whose docstrings still lack a section (DEVELOPERS.md: Args/Returns/Raises).
#: A ratchet: a name leaves this set once its docstring is complete, and none may join it.
#: open_executor lives in rollout_trio/executor/, which another branch is rewriting: its
#: docstring is completed there.
NOT_YET = {"open_executor"}


def test_root_functions_document_args_returns_and_raises():
    incomplete = {
        name for name in rollout_trio.__all__
        if inspect.isfunction(fn := getattr(rollout_trio, name)) and _missing_sections(fn)
    }
    assert incomplete <= NOT_YET, f"docstrings without Args/Returns/Raises: {sorted(incomplete - NOT_YET)}"
    assert NOT_YET <= incomplete, f"complete now, take them out of NOT_YET: {sorted(NOT_YET - incomplete)}"


def _missing_class_sections(cls) -> list[str]:  # noqa: ANN001
    """A class documents its constructor: Args (in its docstring or ``__init__``'s) and Raises."""
    try:
        parameters = [p for p in inspect.signature(cls).parameters if p not in ("args", "kwargs")]
    except (TypeError, ValueError):  # no signature to document
        return []
    doc = (inspect.getdoc(cls) or "") + "\n" + ((inspect.getdoc(cls.__init__) or "") if "__init__" in vars(cls) else "")
    missing = []
    if parameters and "Args:" not in doc and "Attributes:" not in doc:  # an attrs class's fields are its arguments
        missing.append("Args")
    if parameters and "Raises:" not in doc:
        missing.append("Raises")
    return missing


#: Root classes whose constructor's documentation still lacks a section; a ratchet as
#: NOT_YET. Exceptions are left out (their argument is the message). RolloutExecutor is
#: in rollout_trio/executor/ (another branch's), the agents' classes in rollout_trio/agents/.
CLASSES_NOT_YET = {"RolloutExecutor", "RolloutConfig", "SyncRolloutExecutor", "AgentRolloutWorkflow", "OpenAIEndpoint"}


def test_root_classes_document_their_constructors():
    incomplete = {
        name for name in rollout_trio.__all__
        if inspect.isclass(cls := getattr(rollout_trio, name)) and not issubclass(cls, BaseException)
        and _missing_class_sections(cls)
    }
    assert incomplete <= CLASSES_NOT_YET, f"constructors without Args/Raises: {sorted(incomplete - CLASSES_NOT_YET)}"
    assert CLASSES_NOT_YET <= incomplete, f"complete now, take them out: {sorted(CLASSES_NOT_YET - incomplete)}"
