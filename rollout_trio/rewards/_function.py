"""``RewardFunction``: a reward computed off the event loop, with a timeout that holds."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import pickle
import threading
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import attrs
import trio

from .._isolation import IsolatedWorkers, WorkerDied, WorkerTimedOut, unpickle_reply
from .._workflow import import_from_string
from ._errors import RewardTimeoutError, RewardWorkerError

__all__ = ["RewardFunction", "RewardStatistics", "RewardThreadsExhaustedWarning"]

logger = logging.getLogger("rollout_trio.rewards")

Isolation = Literal["thread", "process"]


class RewardThreadsExhaustedWarning(RuntimeWarning):
    """Thread-isolated reward calls timed out without running: every thread is held by a hung call."""


@attrs.frozen
class RewardStatistics:
    """Counters of one :class:`RewardFunction`.

    Attributes:
        calls: calls made (each counts once, whatever its retries).
        timeouts: attempts that ran past the timeout.
        not_started: attempts that timed out before they ran (thread isolation: every
            thread was held by a hung call); their ``timeout_reward`` is not a verdict.
        hung_threads: abandoned threads still running now (they hold their slots).
    """

    calls: int
    timeouts: int
    not_started: int
    hung_threads: int


def _default_workers() -> int:
    return max(1, (os.cpu_count() or 2) // 2)


class RewardFunction:
    """Calls ``fn(*args, **kwargs)`` without blocking the event loop: ``await reward(...)``.

    Args:
        fn: the reward function, or an import string ``"pkg.module.name"``. An ``async
            def`` function is awaited directly (thread isolation only).
        timeout: seconds one attempt may take.
        isolation: ``"thread"`` (default): a worker thread behind a
            :class:`trio.CapacityLimiter`; a thread that runs past the timeout is abandoned
            (it cannot be stopped, and holds its limiter slot until it returns). Once
            ``max_workers`` calls hang, later ones time out without running: each such
            attempt is counted (:attr:`statistics` ``.not_started``), logged as an error
            and warned (:class:`RewardThreadsExhaustedWarning`, once). A verifier that may
            hang belongs in ``"process"``.
            ``"process"``: a pool of worker processes (trio-parallel); a worker that runs
            past the timeout is killed with its whole process group (whatever it started)
            and replaced. ``fn`` and its arguments must be picklable (functions from a
            script's ``__main__`` work, as with multiprocessing's spawn: guard the script's
            entry point with ``if __name__ == "__main__"``), and the pool lives inside
            ``async with reward:``.
        max_workers: concurrent calls (threads or processes); default half the CPUs.
        retries: extra attempts after a timeout, a crashed worker or an exception.
        timeout_reward: returned when the last attempt times out; None (the default)
            raises :class:`RewardTimeoutError` instead, which rejects the task.

    Raises (from a call, after the last attempt):
        RewardTimeoutError: every attempt timed out and ``timeout_reward`` is None.
        RewardWorkerError: the worker process died (crash, signal, ``os._exit``), its
            reply was unreadable or forged, or ``fn``'s value or exception cannot be
            unpickled in this process (the message keeps the original traceback).
        Exception: whatever ``fn`` raised (from a process: with its traceback as a note).
    """

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        *,
        timeout: float = 15.0,
        isolation: Isolation = "thread",
        max_workers: int | None = None,
        retries: int = 0,
        timeout_reward: float | None = None,
    ) -> None:
        if not (isinstance(fn, str) or callable(fn)):
            raise TypeError(f"fn: must be a callable or an import string, got {type(fn).__name__}")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation: must be 'thread' or 'process', got {isolation!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout: must be a number of seconds > 0, got {timeout!r}")
        if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1):
            raise ValueError(f"max_workers: must be an int >= 1, got {max_workers!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries: must be an int >= 0, got {retries!r}")
        if isolation == "process":
            if not isinstance(fn, str) and inspect.iscoroutinefunction(fn):
                raise TypeError("fn: an async function cannot run in a worker process; use isolation='thread'")
            try:
                pickle.dumps(fn)
            except Exception as exc:
                raise TypeError(
                    f"fn: must be picklable for isolation='process' (a module-level function), got {fn!r}: {exc}"
                ) from None
        self.fn = fn
        self.timeout = float(timeout)
        self.isolation = isolation
        self.max_workers = max_workers or _default_workers()
        self.retries = retries
        self.timeout_reward = timeout_reward
        self._limiter = trio.CapacityLimiter(self.max_workers)
        self._pool = IsolatedWorkers(self.max_workers, what="reward worker process") if isolation == "process" else None
        self._resolved: Callable[..., Any] | None = None
        self._lock = threading.Lock()  # the counters are touched by abandoned threads too
        self._calls = self._timeouts = self._not_started = self._hung = 0
        self._warned = False

    def __repr__(self) -> str:
        name = self.fn if isinstance(self.fn, str) else getattr(self.fn, "__qualname__", repr(self.fn))
        return f"RewardFunction({name}, isolation={self.isolation!r}, timeout={self.timeout})"

    @property
    def worker_pids(self) -> set[int]:
        """Process ids of the live worker processes (empty for thread isolation)."""
        return self._pool.pids if self._pool is not None else set()

    @property
    def statistics(self) -> RewardStatistics:
        """Counters since construction (see :class:`RewardStatistics`)."""
        with self._lock:
            return RewardStatistics(self._calls, self._timeouts, self._not_started, self._hung)

    async def __aenter__(self) -> RewardFunction:
        if self._pool is not None:
            await self._pool.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pool is not None:
            await self._pool.__aexit__(exc_type, exc, tb)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        attempts = self.retries + 1
        with self._lock:
            self._calls += 1
        for attempt in range(1, attempts + 1):
            last = attempt == attempts
            try:
                return await self._attempt(args, kwargs)
            except RewardTimeoutError as exc:
                with self._lock:
                    self._timeouts += 1
                if not last:
                    logger.warning("%r: attempt %d/%d timed out (%s); retrying", self, attempt, attempts, exc)
                    continue
                if self.timeout_reward is not None:
                    logger.warning("%r: timed out on every attempt; returning timeout_reward=%r", self, self.timeout_reward)
                    return self.timeout_reward
                raise RewardTimeoutError(f"{self!r}: timed out after {self.timeout} s on all {attempts} attempt(s)") from exc
            except Exception as exc:
                if last:
                    raise
                logger.warning("%r: attempt %d/%d failed (%s: %s); retrying", self, attempt, attempts, type(exc).__name__, exc)
        raise AssertionError("unreachable")

    def _function(self) -> Callable[..., Any]:
        if self._resolved is None:
            self._resolved = import_from_string(self.fn) if isinstance(self.fn, str) else self.fn
        return self._resolved

    async def _attempt(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._pool is not None:
            payload = pickle.dumps((self.fn, args, kwargs))
            try:
                status, body, text = await self._pool.run(payload, self.timeout)
                return unpickle_reply(status, body, text, "reward worker process")
            except WorkerTimedOut as exc:
                raise RewardTimeoutError(str(exc)) from None
            except WorkerDied as exc:
                raise RewardWorkerError(str(exc)) from None
        fn = self._function()
        if inspect.iscoroutinefunction(fn):
            with trio.move_on_after(self.timeout):
                async with self._limiter:
                    return await fn(*args, **kwargs)
            raise RewardTimeoutError(f"no result within {self.timeout} s")
        state = {"started": False, "finished": False, "abandoned": False}

        def run() -> Any:
            with self._lock:
                state["started"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    state["finished"] = True
                    self._hung -= state["abandoned"]

        with trio.move_on_after(self.timeout):
            return await trio.to_thread.run_sync(run, limiter=self._limiter, abandon_on_cancel=True)
        with self._lock:
            if state["started"] and not state["finished"]:
                state["abandoned"] = True
                self._hung += 1
        if state["started"]:
            raise RewardTimeoutError(f"no result within {self.timeout} s (the thread was abandoned)")
        self._report_not_started()
        raise RewardTimeoutError(
            f"did not run within {self.timeout} s: all {self.max_workers} reward threads are held by hung calls"
        )

    def _report_not_started(self) -> None:
        with self._lock:
            self._not_started += 1
            hung, first = self._hung, not self._warned
            self._warned = True
        msg = (
            f"{self!r}: a call timed out without running: all {self.max_workers} threads are held by "
            f"{hung} hung call(s) that cannot be stopped; "
            + ("every later reward is timeout_reward=" + repr(self.timeout_reward) if self.timeout_reward is not None
               else "every later reward fails")
            + " until they return. Use isolation='process' for a verifier that may hang."
        )  # fmt: skip
        logger.error(msg)
        if first:
            warnings.warn(msg, RewardThreadsExhaustedWarning, stacklevel=4)
