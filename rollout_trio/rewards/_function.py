"""``RewardFunction``: a reward computed off the event loop, with a timeout that holds."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import pickle
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import trio

from .._workflow import import_from_string
from ._errors import RewardTimeoutError, RewardWorkerError
from ._pool import ProcessPool

__all__ = ["RewardFunction"]

logger = logging.getLogger("rollout_trio.rewards")

Isolation = Literal["thread", "process"]


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
            (it cannot be stopped, and holds its limiter slot until it returns).
            ``"process"``: a pool of worker processes; a worker that runs past the
            timeout is killed and replaced. ``fn`` and its arguments must be picklable,
            and the pool lives inside ``async with reward:``.
        max_workers: concurrent calls (threads or processes); default half the CPUs.
        retries: extra attempts after a timeout, a crashed worker or an exception.
        timeout_reward: returned when the last attempt times out; None (the default)
            raises :class:`RewardTimeoutError` instead, which rejects the task.

    Raises (from a call, after the last attempt):
        RewardTimeoutError: every attempt timed out and ``timeout_reward`` is None.
        RewardWorkerError: the worker process died (crash, signal, ``os._exit``).
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
            if getattr(fn, "__module__", None) == "__main__":
                raise TypeError(
                    f"fn: {fn!r} is defined in __main__, which a worker process cannot import; "
                    "for isolation='process' define it in a module (or pass an import string)"
                )
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
        self._pool = ProcessPool(self.max_workers) if isolation == "process" else None
        self._resolved: Callable[..., Any] | None = None

    def __repr__(self) -> str:
        name = self.fn if isinstance(self.fn, str) else getattr(self.fn, "__qualname__", repr(self.fn))
        return f"RewardFunction({name}, isolation={self.isolation!r}, timeout={self.timeout})"

    @property
    def worker_pids(self) -> set[int]:
        """Process ids of the live worker processes (empty for thread isolation)."""
        return self._pool.pids if self._pool is not None else set()

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
        for attempt in range(1, attempts + 1):
            last = attempt == attempts
            try:
                return await self._attempt(args, kwargs)
            except RewardTimeoutError as exc:
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
            return self._unwrap(await self._pool.call(pickle.dumps((self.fn, args, kwargs)), self.timeout))
        fn = self._function()
        with trio.move_on_after(self.timeout) as scope:
            if inspect.iscoroutinefunction(fn):
                async with self._limiter:
                    return await fn(*args, **kwargs)
            return await trio.to_thread.run_sync(
                functools.partial(fn, *args, **kwargs), limiter=self._limiter, abandon_on_cancel=True
            )
        assert scope.cancelled_caught
        raise RewardTimeoutError(f"no result within {self.timeout} s (the thread was abandoned)")

    @staticmethod
    def _unwrap(reply: Any) -> Any:
        if reply[0] == "ok":
            return reply[1]
        _, exc, text = reply
        if isinstance(exc, BaseException):
            exc.add_note(f"raised in the reward worker process:\n{text}")
            raise exc
        raise RewardWorkerError(f"the reward worker failed:\n{text}")


