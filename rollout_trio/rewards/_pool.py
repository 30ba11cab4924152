"""A pool of reward worker processes that can be killed: the only cure for a hung verifier.

Each worker serves one call at a time over pipes (see ``_worker_main.py``). A call that
runs past its timeout, or is cancelled, kills its worker; a worker that dies is reaped.
Either way the next call starts a fresh one, so the pool never runs short.
"""

from __future__ import annotations

import logging
import pickle
import signal
import struct
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

import trio

from ._errors import RewardTimeoutError, RewardWorkerError

__all__ = ["ProcessPool"]

logger = logging.getLogger("rollout_trio.rewards")

_HEADER = struct.Struct(">Q")
_WORKER_MAIN = str(Path(__file__).with_name("_worker_main.py"))
_SPAWN_TIMEOUT = 60.0  # seconds a worker may take to start
_REAP_TIMEOUT = 5.0  # seconds to wait for a killed worker's exit status


class _Worker:
    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin = proc.stdin
        self.stdout = proc.stdout
        self._buffer = bytearray()

    async def send(self, data: bytes) -> None:
        await self.stdin.send_all(_HEADER.pack(len(data)) + data)

    async def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = await self.stdout.receive_some(max(65536, n - len(self._buffer)))
            if not chunk:
                raise EOFError
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def receive(self) -> Any:
        (size,) = _HEADER.unpack(await self._read_exact(_HEADER.size))
        return pickle.loads(await self._read_exact(size))

    async def kill(self) -> None:
        """Kill the process and wait (bounded) for it to be reaped."""
        with trio.CancelScope(shield=True), trio.move_on_after(_REAP_TIMEOUT):
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
            await self.stdin.aclose()
            await self.stdout.aclose()

    async def died(self) -> RewardWorkerError:
        await self.kill()
        code = self.proc.returncode
        how = f"exit status {code}"
        if code is not None and code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        return RewardWorkerError(f"reward worker process {self.proc.pid} died ({how}) before answering")


class ProcessPool:
    """Up to ``max_workers`` worker processes; ``async with`` owns them all."""

    def __init__(self, max_workers: int) -> None:
        self.max_workers = max_workers
        self._limiter = trio.CapacityLimiter(max_workers)
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self._open = False
        self._closed = False

    @property
    def pids(self) -> set[int]:
        """The process ids of the live workers."""
        return {w.proc.pid for w in self._live}

    async def __aenter__(self) -> ProcessPool:
        if self._open or self._closed:
            raise RuntimeError("a ProcessPool can be entered once")
        self._open = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closed = True
        workers, self._idle = list(self._live), []
        for w in workers:
            await w.kill()
        self._live.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the reward worker pool has been shut down (its `async with` block ended)")
        if not self._open:
            raise RuntimeError("the reward worker pool is not running: use it inside `async with`")

    async def _spawn(self) -> _Worker:
        proc = await trio.lowlevel.open_process(
            [sys.executable, _WORKER_MAIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        worker = _Worker(proc)
        self._live.add(worker)
        ok = False
        try:
            with trio.fail_after(_SPAWN_TIMEOUT):
                await worker.send(pickle.dumps(list(sys.path)))
                status, _ = await worker.receive()
            ok = status == "ready"
        except (EOFError, trio.BrokenResourceError):
            raise await worker.died() from None
        finally:
            if not ok:
                self._live.discard(worker)
                await worker.kill()
        return worker

    async def call(self, payload: bytes, timeout: float) -> Any:
        """Send one pickled call to a worker and return its reply.

        Raises:
            RewardTimeoutError: no reply within ``timeout`` s (the worker was killed).
            RewardWorkerError: the worker died before replying.
        """
        self._check_open()
        async with self._limiter:
            self._check_open()
            worker = self._idle.pop() if self._idle else await self._spawn()
            healthy = False
            try:
                with trio.move_on_after(timeout) as scope:
                    await worker.send(payload)
                    reply = await worker.receive()
                    healthy = True
                if scope.cancelled_caught:
                    raise RewardTimeoutError(f"no reply within {timeout} s; worker process {worker.proc.pid} was killed")
                return reply
            except (EOFError, trio.BrokenResourceError):
                self._live.discard(worker)
                raise await worker.died() from None
            finally:
                if healthy and not self._closed:
                    self._idle.append(worker)
                elif worker in self._live:
                    self._live.discard(worker)
                    await worker.kill()
