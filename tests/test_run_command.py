"""`rollout-trio run` on the executor: streaming lines, Ctrl-C, per-episode timeouts, dumps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_trio.executor import read_dump

from . import warm_cli
from .process_helpers import reaped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m rollout_trio run ARGS``, forked from the warm CLI (tests/warm_cli.py)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return warm_cli.run(
        [sys.executable, "-m", "rollout_trio", "run", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_ctrl_c_prints_what_finished_and_exits_130() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with reaped(warm_cli.WarmPopen(
        [sys.executable, "-m", "rollout_trio", "run", "--groups", "100000", "--group-size", "2", "--concurrency", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )) as proc:  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("group  question")
        first = proc.stdout.readline()  # a group streamed out as soon as it finished
        assert "rewards [" in first or "dropped" in first, first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: stopping new work" in err and "Traceback" not in err
    assert "not finished" in out and "group statistics" in out
    kept = int(out.split(" groups kept")[0].split()[-1])
    assert 1 <= kept < 100000


def test_sigterm_keeps_the_buffered_summary_and_exits_143() -> None:
    """stdout is a pipe here, so it is block-buffered: a run killed by SIGTERM's default
    action would lose the summary (issue 32 item 5). It stops as on Ctrl-C instead."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    with reaped(warm_cli.WarmPopen(
        [sys.executable, "-m", "rollout_trio", "run", "--groups", "100000", "--group-size", "2", "--concurrency", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )) as proc:  # fmt: skip
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("group  question")  # group lines are flushed as they come
        assert "rewards [" in (first := proc.stdout.readline()) or "dropped" in first, first
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "terminated: stopping new work and aborting episodes in flight", err
    assert "not finished" in out and "group statistics" in out and " episodes in " in out, out


@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["ctrl-c-default", "ctrl-c-ignored"])
def test_sigterm_while_starting_is_one_line_and_143(sigint: signal.Handlers) -> None:
    """Also when started with Ctrl-C ignored (`rollout-trio run &` in a script): SIGTERM,
    which the command turns into Ctrl-C, did nothing then (it exited 0 after its run)."""
    status, err = _signal_once_importing(re.compile(r"\| +torch\.\w+$"), signal.SIGTERM, sigint=sigint)
    assert status == 143
    said = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert said == ["rollout-trio run: terminated while starting; nothing ran"], said


def test_episode_timeout_counts_groups_as_failed_not_fatal() -> None:
    proc = run_cli("--groups", "3", "--group-size", "2", "--episode-timeout", "0.001")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("failed (timeout)") == 3
    assert "0 groups kept, 0 dropped, 3 failed" in proc.stdout


def test_dump_writes_every_row(tmp_path: Path) -> None:
    proc = run_cli("--groups", "3", "--group-size", "2", "--dump", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    records = read_dump(tmp_path / "run" / "seed0")
    assert len(records) == 6 and all(r.accepted for r in records)
    assert sorted({r.task_id for r in records}) == [0, 1, 2]


def test_bad_numbers_are_usage_errors() -> None:
    for args in (["--episode-timeout", "0"], ["--max-head-offpolicyness", "-1"], ["--consumer-batch-size", "0"]):
        proc = run_cli(*args)
        assert proc.returncode == 2 and "must be" in proc.stderr, args


def _interrupt_once_importing(marker: re.Pattern[str]) -> tuple[int, str]:
    return _signal_once_importing(marker, signal.SIGINT)


def _signal_once_importing(
    marker: re.Pattern[str], signum: int, sigint: signal.Handlers = signal.SIG_DFL
) -> tuple[int, str]:
    """Start ``rollout-trio run`` (Ctrl-C's disposition ``sigint``), send ``signum`` once
    ``-X importtime`` shows ``marker`` imported."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPROFILEIMPORTTIME="1")
    with reaped(subprocess.Popen(
        [sys.executable, "-m", "rollout_trio", "run", "--groups", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )) as proc:  # fmt: skip
        assert proc.stderr is not None
        seen = []
        while not (seen and marker.search(seen[-1])):
            line = proc.stderr.readline()
            assert line, f"exited before {marker.pattern} was imported: {''.join(seen[-5:])}"
            seen.append(line)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + err


@pytest.mark.parametrize(
    "marker",
    # trio part-way in: the command's module loads (its parser needs trio's types); then torch part-way in
    [r"\| +trio\._\w+$", r"\| +torch\.\w+$"],
    ids=["loading-the-command", "loading-torch"],
)
def test_ctrl_c_while_starting_is_one_line_and_130(marker: str) -> None:
    status, err = _interrupt_once_importing(re.compile(marker))
    assert status == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    said = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert said == ["rollout-trio run: interrupted while starting; nothing ran"], said


def test_progress_bar_on_request(tmp_path: Path) -> None:
    shown = run_cli("--groups", "3", "--group-size", "2", "--progress")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"\d+/3 \[", shown.stderr) and "group/s" in shown.stderr, shown.stderr
    assert len(re.findall(r"^ +\d+  What is", shown.stdout, re.M)) == 3, shown.stdout  # every group's line still there
    hidden = run_cli("--groups", "3", "--group-size", "2", "--no-progress")
    assert hidden.returncode == 0 and "group/s" not in hidden.stderr, hidden.stderr


def test_loading_a_checkpoint_shows_no_transformers_progress_bar(tmp_path: Path) -> None:
    from rollout_trio.models import tiny_model

    model, tokenizer = tiny_model()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    proc = run_cli("--model", str(tmp_path), "--groups", "1", "--group-size", "1")
    assert proc.returncode == 0, proc.stderr
    assert "Loading weights" not in proc.stderr and "it/s]" not in proc.stderr, proc.stderr


def test_dumping_twice_into_one_directory_says_so_once(tmp_path: Path) -> None:
    first = run_cli("--groups", "2", "--group-size", "2", "--dump", str(tmp_path))
    assert first.returncode == 0 and "already holds" not in first.stderr, first.stderr
    second = run_cli("--groups", "2", "--group-size", "2", "--dump", str(tmp_path))
    assert second.returncode == 0, second.stderr
    trial = tmp_path.resolve() / "run" / "seed0"
    assert second.stderr.splitlines() == [
        f"rollout-trio run: warning: trajectory dump directory {trial} already holds 2 dumped files; new lines are appended"
    ]
    assert len(read_dump(trial)) == 8  # both runs' rows: appended, not refused
