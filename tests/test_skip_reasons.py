"""A skip inside a Trio test reports its reason (pytest-trio 0.8.0 drops it; tests/skip_reasons.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''
import pytest, trio

async def test_plain():
    pytest.skip("reason one")

async def test_in_a_cancel_scope():
    with trio.fail_after(5):
        pytest.skip("reason two")

async def test_in_a_nursery():
    async with trio.open_nursery():
        pytest.skip("reason three")

async def test_two_errors_stay_a_group():
    async def fail():
        raise ValueError("a")
    async with trio.open_nursery() as n:
        n.start_soon(fail)
        n.start_soon(fail)
'''


def run_probe(tmp_path: Path, conftest: str) -> str:
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout


def test_every_skip_in_a_trio_test_reports_its_own_reason(tmp_path: Path) -> None:
    out = run_probe(tmp_path, "from tests.skip_reasons import pytest_pyfunc_call  # noqa: F401\n")
    for reason in ("reason one", "reason two", "reason three"):
        assert reason in out, out
    assert "1 failed, 3 skipped" in out, out  # a real failure is still a failure


def test_without_the_hook_the_reasons_are_lost(tmp_path: Path) -> None:
    """The defect the hook mends (if pytest-trio fixes it, this fails: drop the hook then)."""
    out = run_probe(tmp_path, "")
    assert "reason" not in out and ": Skipped" in out, out
