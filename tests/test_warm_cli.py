"""The warm CLI (tests/warm_cli.py) starts processes the tests cannot tell from fresh ones.

Each check runs the same program both ways, with ``subprocess.Popen`` and with ``WarmPopen``,
and compares what the program saw and how it ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from . import warm_cli
from .warm_cli import WarmPopen

PROBE = """
import json, os, signal, sys
PROBE_MARK = 1  # found through sys.modules["__main__"] (pickle, attrs and dataclasses look there)
print(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("WARM_PROBE"), "path": sys.path,
    "own_session": os.getsid(0) == os.getpid(), "sigint": str(signal.getsignal(signal.SIGINT)),
    "sigterm": str(signal.getsignal(signal.SIGTERM)), "stdin": sys.stdin.read(), "main": __name__,
    "stdout_line_buffered": sys.stdout.line_buffering, "main_module_is_ours": getattr(sys.modules["__main__"], "PROBE_MARK", None) == 1,
}))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", ["0", "3"])
@pytest.mark.parametrize("new_session", [False, True])
def test_a_warm_process_sees_its_argv_env_cwd_stdin_session_and_signals_as_a_fresh_one(tmp_path, status, new_session):
    """argv, environment, working directory, stdin, session, signal dispositions and exit
    status are the ones the caller gave, as with a fresh interpreter."""
    seen = []
    for popen in (subprocess.Popen, WarmPopen):
        with popen(
            [sys.executable, "-c", PROBE, status, "two words"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=dict(os.environ, WARM_PROBE=popen.__name__),
            start_new_session=new_session,
        ) as proc:
            out, err = proc.communicate("what the test wrote", timeout=120)
        assert proc.returncode == int(status), err
        said = json.loads(out)
        assert said.pop("env") == popen.__name__
        seen.append(said)
    fresh, warm = seen
    assert warm == fresh
    assert fresh["cwd"] == str(tmp_path) and fresh["own_session"] is new_session and fresh["main_module_is_ours"]


def test_a_warm_module_and_script_run_as_main_with_their_argv(tmp_path):
    """``-m MODULE`` and ``SCRIPT.py`` run as ``__main__``, with sys.path[0] where CPython puts it."""
    script = tmp_path / "probe_script.py"
    script.write_text(PROBE)
    (tmp_path / "probe_module.py").write_text(PROBE)
    for argv in ([str(script), "0", "x"], ["-m", "probe_module", "0", "x"]):
        fresh, warm = (
            run([sys.executable, *argv], input="", capture_output=True, text=True, cwd=tmp_path, timeout=120)
            for run in (subprocess.run, warm_cli.run)
        )
        assert warm.returncode == fresh.returncode == 0, (fresh.stderr, warm.stderr)
        assert json.loads(warm.stdout) == json.loads(fresh.stdout), argv
        assert json.loads(fresh.stdout)["main"] == "__main__" and json.loads(fresh.stdout)["main_module_is_ours"]


WAIT_FOR_SIGNAL = """
import sys, time
print("ready", flush=True)
print("buffered, never flushed")
time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_a_warm_process_as_it_ends_a_fresh_one(signum):
    """An uncaught Ctrl-C and a SIGTERM end both the same way: the same status, the same
    unflushed output lost or kept, a KeyboardInterrupt's traceback on stderr."""
    ended = []
    for popen in (subprocess.Popen, WarmPopen):
        with popen([sys.executable, "-c", WAIT_FOR_SIGNAL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            proc.send_signal(signum)
            out, err = proc.communicate(timeout=120)
        ended.append((proc.returncode, out, "KeyboardInterrupt" in err))
    assert ended[1] == ended[0]
    assert ended[0][0] == -signum


def test_a_warm_popen_waits_with_a_deadline_and_polls():
    """``wait(timeout)`` raises TimeoutExpired while the child runs; ``poll`` then says it ended."""
    with WarmPopen([sys.executable, "-c", WAIT_FOR_SIGNAL], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
        assert proc.poll() is None
        proc.kill()
        assert proc.wait(timeout=120) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL


def test_what_a_warm_popen_cannot_start_is_refused_by_name():
    with pytest.raises(ValueError, match="WarmPopen runs"):
        WarmPopen(["rollout-trio", "run"])
    with pytest.raises(ValueError, match="WarmPopen runs"):
        WarmPopen([sys.executable, "-c", "pass"], preexec_fn=lambda: None)
