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

from .._isolation import LIMITS, IsolatedWorkers, WorkerDied, WorkerResourceError, WorkerTimedOut
from .._workflow import import_from_string
from ._errors import RewardResourceError, RewardTimeoutError, RewardWorkerError

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
            ``"process"``: a pool of worker processes, started at ``async with reward:``
            (or on the first call, see :meth:`aclose`), each importing ``fn`` once and
            forking a fresh child per call. At the timeout the child is killed with every
            process it started (``setsid`` ones too, on Linux), and the next call runs at
            once. Values cross as JSON-like data (None, bool, int, float, str, list, tuple
            (returned as a list), str-keyed dict), never as pickles unless
            ``trust_worker_pickles``. ``fn`` and its arguments must be picklable (functions
            from a script's ``__main__`` work, as with multiprocessing's spawn: guard the
            script's entry point with ``if __name__ == "__main__"``). State ``fn`` builds at
            import time is shared by every call; state a call builds dies with it.
        max_workers: concurrent calls (threads or processes); default half the CPUs.
        retries: extra attempts after a timeout, a crashed worker or an exception.
        timeout_reward: returned when the last attempt times out; None (the default)
            raises :class:`RewardTimeoutError` instead, which rejects the task.
        trust_worker_pickles: process isolation: values and exceptions cross as pickles
            and are unpickled in this process. Only for a verifier you trust: unpickling
            runs code the worker chose. Default False: JSON-like values only.
        limits: process isolation: per-call resource limits (``resource.setrlimit`` in
            the call's process): ``{"address_space": bytes, "cpu_seconds": s,
            "open_files": n}``; exceeding one raises :class:`RewardResourceError`.
        max_reply_bytes: process isolation: the largest encoded value a call may return.

    Raises:
        ValueError: (constructing) an argument breaks its rule, named in the message.
        TypeError: (constructing) ``fn`` is not a callable, or cannot run in a process.
        RewardTimeoutError: (a call, as each below: after its last attempt) every attempt timed out and ``timeout_reward`` is None.
        RewardWorkerError: the call's process died (crash, signal, ``os._exit``), its
            reply was unreadable, forged, too large or not JSON-like, it raised a
            BaseException (``SystemExit``, ``KeyboardInterrupt``: the task fails, never the
            run) or an exception that is not a built-in one (the message keeps the
            original traceback).
        RewardResourceError: the call exceeded one of its ``limits``.
        Exception: whatever ``fn`` raised (from a process: built-in exceptions, or any
            with ``trust_worker_pickles``, with the traceback as a note).
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
        trust_worker_pickles: bool = False,
        limits: dict[str, int] | None = None,
        max_reply_bytes: int = 16 * 1024 * 1024,
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
        for name, value in (limits or {}).items():
            if name not in LIMITS:
                raise ValueError(f"limits: unknown limit {name!r}; known: {', '.join(LIMITS)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits[{name!r}]: must be an int >= 1, got {value!r}")
        if isinstance(max_reply_bytes, bool) or not isinstance(max_reply_bytes, int) or max_reply_bytes < 1:
            raise ValueError(f"max_reply_bytes: must be an int >= 1, got {max_reply_bytes!r}")
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
        self.trust_worker_pickles = trust_worker_pickles
        self._limiters: tuple[object, trio.CapacityLimiter] | None = None  # made in the run that uses it
        self._pool = (
            IsolatedWorkers(
                fn, self.max_workers, what="reward worker process", trust_pickles=trust_worker_pickles,
                limits=limits, max_reply_bytes=max_reply_bytes,
            )  # fmt: skip
            if isolation == "process"
            else None
        )
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

    @property
    def _limiter(self) -> trio.CapacityLimiter:
        token = trio.lowlevel.current_trio_token()
        if self._limiters is None or self._limiters[0] is not token:
            self._limiters = (token, trio.CapacityLimiter(self.max_workers))
        return self._limiters[1]

    async def __aenter__(self) -> RewardFunction:
        """Start the worker processes (process isolation) and wait until they are ready."""
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the worker processes now (the first call does it otherwise); no-op for threads.

        Raises:
            RewardWorkerError: a worker could not start (its message says why).
            RuntimeError: :meth:`aclose` was called.
        """
        if self._pool is not None:
            try:
                await self._pool.start()
            except WorkerDied as exc:
                raise RewardWorkerError(str(exc)) from None

    async def aclose(self) -> None:
        """Kill the worker processes and everything they started; later calls raise RuntimeError.

        A pool started by a call (not by ``async with``) lives until this is awaited, or
        until this process exits (the workers see their pipes close and exit with all
        they started).
        """
        if self._pool is not None:
            await self._pool.aclose()

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
            payload = pickle.dumps((args, kwargs))
            try:
                return await self._pool.run(payload, self.timeout)
            except WorkerTimedOut as exc:
                raise RewardTimeoutError(str(exc)) from None
            except WorkerResourceError as exc:
                raise RewardResourceError(str(exc)) from None
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
            except Exception:
                raise
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: the task fails, not the run
                raise RewardWorkerError(f"the reward raised {type(exc).__name__}({exc}); the call fails, the run goes on") from None
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
