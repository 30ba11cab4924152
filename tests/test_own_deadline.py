"""tests/own_deadline.py: a wait with its own deadline leaves no hang report in the log,
while pytest's ``faulthandler_timeout`` still reports a test that runs past it elsewhere."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BODY = '''
import time
from tests.own_deadline import own_deadline

def test_waits_under_its_own_deadline(pytestconfig):
    with own_deadline(pytestconfig):
        time.sleep(3)

def test_then_hangs_past_the_timeout():
    time.sleep(3)
'''


def test_only_the_wait_without_its_own_deadline_is_reported(tmp_path: Path) -> None:
    (tmp_path / "test_waits.py").write_text(textwrap.dedent(BODY))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "faulthandler_timeout=1",
         "--rootdir", str(tmp_path), str(tmp_path / "test_waits.py")],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert out.count("Timeout (0:00:01)!") == 1, out
    dump = out[out.index("Timeout (0:00:01)!"):]
    assert "test_then_hangs_past_the_timeout" in dump and "test_waits_under_its_own_deadline" not in dump, out
