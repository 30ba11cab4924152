"""`rollout-trio fleet` as a real subprocess, read line by line with deadlines (issue 16).

Tests synchronise on what the command prints (``worker i: URL (pid P)``, ``router: URL
(...)``, its stderr notices), never on sleeps. Every process a fleet started is known by
pid, so a test can kill one, and :meth:`FleetProcess.stop` checks none survives.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORKER = re.compile(r"^worker (\d+): (http://\S+) \(pid (\d+), (\S+) on (\S+)\)$")  # dtype, device
_ROUTER = re.compile(r"^router: (http://\S+) \(pid (\d+), (\d+) workers, metrics (\S+?), (?:api key in \S+|no api key)\)$")
#: the tiny model loads in seconds, but CI machines are shared: startup gets a wide deadline
STARTUP_DEADLINE = 100.0


class Lines:
    """A text stream's lines, read by a thread, so a test can wait for one with a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        for line in self.stream:
            self.seen.append(line.rstrip("\n"))
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def expect(self, pattern: str, timeout: float = STARTUP_DEADLINE) -> re.Match[str]:
        """The next line matching ``pattern``; fails after ``timeout`` seconds or at EOF."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)  # EOF stays EOF for the next caller
                raise AssertionError(f"the stream ended before a line matching {pattern!r}; last: {self.seen[-5:]}")
            if found := re.search(pattern, line):
                return found
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s; last: {self.seen[-5:]}")

    def tail(self, n: int = 8, timeout: float = 5.0) -> list[str]:
        """The last ``n`` lines, after waiting up to ``timeout`` s for EOF (so a dead process's last words are in)."""
        self._thread.join(timeout)
        return self.seen[-n:]

    def close(self, timeout: float = 10.0) -> None:
        """Wait for EOF (the process ended) and close the stream."""
        self._thread.join(timeout)
        self.stream.close()


def descendants_of(token: str) -> list[int]:
    """Pids of live processes whose environment holds ``FLEET_TEST_TOKEN=token`` (a fleet's
    children inherit it, so none escapes the check even if its pid was never printed)."""
    found = []
    needle = f"FLEET_TEST_TOKEN={token}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:  # gone, or not ours
            continue
        if needle in environ and state != b"Z":
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts: nobody reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class FleetProcess:
    """``python -m rollout_trio fleet ARGS`` with its stdout and stderr read by threads."""

    def __init__(self, *args: str, keyed: bool = False) -> None:
        self.token = uuid.uuid4().hex
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", FLEET_TEST_TOKEN=self.token)
        env.pop("ROLLOUT_TRIO_API_KEY", None)
        if not keyed:  # tests talk to the workers without a key unless they ask for one
            args = ("--no-api-key", *args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_trio", "fleet", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out, self.err = Lines(self.proc.stdout), Lines(self.proc.stderr)
        self.stdout, self.stderr = self.out.seen, self.err.seen
        self.workers: list[tuple[str, int]] = []  # (url, pid) by worker index
        self.router = ""
        self.router_pid = 0

    def expect(self, pattern: str, *, stream: str = "out", timeout: float = STARTUP_DEADLINE) -> re.Match[str]:
        """The next line of the fleet's ``stream`` ("out" or "err") matching ``pattern``."""
        return (self.out if stream == "out" else self.err).expect(pattern, timeout)

    def wait_ready(self, workers: int) -> None:
        """Read the worker lines and the router line (the command's 'ready' signal)."""
        for _ in range(workers):
            found = _WORKER.match(self.expect(_WORKER.pattern).group(0))
            assert found is not None
            self.workers.append((found[2], int(found[3])))
        router = self.expect(_ROUTER.pattern)
        self.router, self.router_pid = router[1], int(router[2])
        assert int(router[3]) == workers

    def survivors(self) -> list[int]:
        """Live processes of this fleet: those holding its token (sglang-router rewrites its
        own environment when it renames itself, so its printed pid is checked too)."""
        return sorted({*descendants_of(self.token), *(pid for pid in self.pids if alive(pid))})

    @property
    def pids(self) -> list[int]:
        return [pid for _, pid in self.workers] + ([self.router_pid] if self.router_pid else [])

    def wait(self, timeout: float = 60.0) -> int:
        """The exit status, once the process ended and everything it printed was read."""
        status = self.proc.wait(timeout)
        for lines in (self.out, self.err):
            lines._thread.join(timeout)
        return status

    def stop(self) -> None:
        """SIGTERM the fleet (it stops its children), SIGKILL whatever is left after a deadline."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.survivors():  # never leave a child behind, even when a test failed
            os.kill(pid, signal.SIGKILL)
        self.out.close()
        self.err.close()


@contextmanager
def fleet(*args: str, workers: int = 2, keyed: bool = False) -> Iterator[FleetProcess]:
    """A ready fleet of ``workers`` tiny-model workers for the duration of the block
    (``keyed``: with the fleet's api key, else ``--no-api-key``)."""
    process = FleetProcess("--workers", str(workers), *args, keyed=keyed)
    try:
        process.wait_ready(workers)
        yield process
    finally:
        process.stop()
        print("\n".join(["the fleet's stderr:", *process.stderr]), file=sys.stderr)  # shown if a test failed


def worker_stats(url: str) -> dict[str, object]:
    """A worker's ``GET /stats`` (in-flight, finished and aborted request ids)."""
    return httpx.get(url + "/stats", timeout=10).json()  # type: ignore[no-any-return]
