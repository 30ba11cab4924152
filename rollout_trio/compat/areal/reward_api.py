"""``areal.api.reward_api``: ``AsyncRewardWrapper`` over our :class:`~rollout_trio.RewardFunction`.

Built only on ``RewardFunction``'s public constructor, ``async with`` and call. AReaL's
wrapper is built in a workflow's ``__init__``, outside any run; ours starts its worker
processes lazily in whichever Trio run first awaits it (a system task of that run owns
them, so they close when that run ends) and again in a later run. Under asyncio (an
agent's child process) it uses a ``concurrent.futures`` process pool of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any

import sniffio
import trio

from ...rewards import RewardFunction

__all__ = ["AsyncRewardWrapper"]


def _call_in_worker(hook: dict[str, Any] | None, fn_bytes: bytes, *args: Any, **kwargs: Any) -> Any:
    # A function from a module served by the hook (an AReaL workflow file) unpickles only
    # once the worker has the same hook.
    if hook is not None:
        from . import _hook

        _hook.install(**hook)
    return pickle.loads(fn_bytes)(*args, **kwargs)


class _Owner:
    """The pool of one run: started by a system task, which closes it when the run ends."""

    def __init__(self, reward: RewardFunction) -> None:
        self.reward = reward
        self.ready = trio.Event()
        self.error: BaseException | None = None

    async def own(self) -> None:
        try:
            async with self.reward:
                self.ready.set()
                await trio.sleep_forever()
        except trio.Cancelled:
            raise
        except BaseException as exc:  # a system task must not raise: the callers do
            self.error = exc
            self.ready.set()


class AsyncRewardWrapper:
    """``await wrapper(*args, **kwargs)`` runs ``reward_fn`` in a worker process.

    Args:
        reward_fn: a picklable (module-level) function; ``signal.alarm`` works in it.
        timeout_seconds: seconds one attempt may take; a worker past it is killed and
            the call raises :class:`~rollout_trio.RewardTimeoutError` (AReaL returns 0).
        max_workers: worker processes (default: half the CPUs).
        max_retries: extra attempts after a failure (AReaL's default, 3).

    Raises:
        TypeError: ``reward_fn`` cannot be pickled.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        timeout_seconds: float = 15,
        max_workers: int | None = None,
        max_retries: int = 3,
    ) -> None:
        try:
            self._fn_bytes = pickle.dumps(reward_fn)
        except Exception as exc:
            raise TypeError(f"reward_fn: must be picklable (a module-level function), got {reward_fn!r}: {exc}") from None
        self.reward_fn = reward_fn
        self.timeout_seconds = float(timeout_seconds)
        self.max_workers = max_workers
        self.max_retries = max_retries
        self._reset()

    def _reset(self) -> None:
        self._runvar: trio.lowlevel.RunVar[_Owner] = trio.lowlevel.RunVar(f"AsyncRewardWrapper-{id(self)}")
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_runvar"], state["_executor"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def _target(self) -> Callable[..., Any]:
        from . import _hook

        return functools.partial(_call_in_worker, _hook.current_options(), self._fn_bytes)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if sniffio.current_async_library() == "asyncio":
            return await self._asyncio_call(args, kwargs)
        try:
            owner = self._runvar.get()
        except LookupError:
            reward = RewardFunction(
                self._target(), timeout=self.timeout_seconds, isolation="process",
                max_workers=self.max_workers, retries=self.max_retries,
            )  # fmt: skip
            owner = _Owner(reward)
            self._runvar.set(owner)
            trio.lowlevel.spawn_system_task(owner.own, name=f"{self!r} worker pool")
        with trio.fail_after(60 + self.timeout_seconds):  # what it waits for: the worker processes to start
            await owner.ready.wait()
        if owner.error is not None:
            raise RuntimeError(f"{self!r}: the reward worker processes did not start") from owner.error
        return await owner.reward(*args, **kwargs)

    async def _asyncio_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._executor is None:
            self._executor = concurrent.futures.ProcessPoolExecutor(
                self.max_workers, mp_context=multiprocessing.get_context("spawn")
            )
        loop = asyncio.get_running_loop()
        call = functools.partial(self._target(), *args, **kwargs)
        for attempt in range(self.max_retries + 1):
            try:
                return await asyncio.wait_for(loop.run_in_executor(self._executor, call), self.timeout_seconds)
            except Exception:
                if attempt == self.max_retries:
                    raise
        raise AssertionError("unreachable")

    def __repr__(self) -> str:
        return f"AsyncRewardWrapper({getattr(self.reward_fn, '__qualname__', self.reward_fn)!r})"
