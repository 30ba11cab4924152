"""``rollout_stream``: every item of a (possibly endless) source once, with bounded memory.

The stream keeps at most ``window`` of its tasks outstanding (queued, running, or ended and
not handed out) and hands out each ended task's outcome in the order the tasks end. Its
tasks belong to its own owner (kind ``"stream"``), so nothing else takes them and they
never count against ``queue_size``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from ._store import AcceptFn, Owner, Task, TaskOutcome

if TYPE_CHECKING:
    from .._workflow import RolloutWorkflow
    from ._consumers import ConsumerCalls

__all__ = ["RolloutStream"]

_DONE = object()


class RolloutStream:
    """The outcomes of one :meth:`~rollout_trio.executor.RolloutExecutor.rollout_stream` call.

    An async context manager (leaving it cancels what is unfinished) and an async iterator
    of :class:`~rollout_trio.executor.TaskOutcome`.
    """

    def __init__(
        self, ex: ConsumerCalls, data: Iterable[Any] | AsyncIterable[Any], workflow: RolloutWorkflow, *,
        is_eval: bool, should_accept_fn: AcceptFn | None, window: int,
    ) -> None:  # fmt: skip
        self._ex = ex
        self._data = data
        self._workflow = workflow
        self._is_eval = is_eval
        self._should_accept_fn = should_accept_fn
        self._window = window
        self._owner = Owner("stream")
        self._tasks: dict[int, Task] = {}  # outstanding, by id
        self._it: Any = None
        self._read_all = False
        self._closed = False
        self._in_memory = isinstance(data, (list, tuple, range))
        self._limiter = trio.CapacityLimiter(1)

    async def __aenter__(self) -> RolloutStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel the unfinished tasks; accepted training results go to the common pool."""
        if self._closed:
            return
        self._closed = True
        ex = self._ex
        if self._tasks:
            ex._abandon(self._owner, list(self._tasks.values()))
        close = getattr(self._it, "aclose", None)
        if close is not None:
            with trio.move_on_after(5) as scope:
                scope.shield = True
                await close()
        await trio.lowlevel.checkpoint()

    def __aiter__(self) -> RolloutStream:
        return self

    async def _next_item(self) -> Any:
        if self._it is None:
            self._it = aiter(self._data) if isinstance(self._data, AsyncIterable) else iter(self._data)
        if isinstance(self._data, AsyncIterable):
            try:
                return await anext(self._it)
            except StopAsyncIteration:
                return _DONE
        if self._in_memory:
            await trio.lowlevel.checkpoint()
            return next(self._it, _DONE)
        return await trio.to_thread.run_sync(next, self._it, _DONE, limiter=self._limiter)

    async def _fill(self) -> None:
        ex = self._ex
        while not self._read_all and len(self._tasks) < self._window:
            item = await self._next_item()
            ex._check()
            if item is _DONE:
                self._read_all = True
                return
            task = ex._enqueue(
                item, self._workflow, self._owner, is_eval=self._is_eval, should_accept_fn=self._should_accept_fn,
                callback=None,
            )  # fmt: skip
            self._tasks[task.task_id] = task

    async def __anext__(self) -> TaskOutcome:
        ex = self._ex
        ex._check()
        if self._closed:
            raise StopAsyncIteration
        owner = self._owner
        with ex._watch.call("rollout_stream", owner, ex._park) as wait:
            while True:
                await self._fill()
                ex._sweep_stale()
                if owner.finished:
                    task = next(iter(owner.finished.values()))  # the oldest ended
                    return self._hand_out(task)
                if self._read_all and not owner.unfinished:
                    self._closed = True
                    raise StopAsyncIteration
                await wait.park()

    def _hand_out(self, task: Task) -> TaskOutcome:
        """Take one ended task (no checkpoint: the outcome leaves in this step)."""
        ex = self._ex
        del self._tasks[task.task_id]
        status, reason = task.status, task.reason
        dropped = task.dropped
        data, task.data = task.data, None
        result = ex._take(task)
        ex._notify()
        assert status is not None
        if status == "accepted" and result is None:  # dropped as stale before it was handed out
            status, reason = "rejected", dropped or "stale"
        return TaskOutcome(task.task_id, status, reason, result, data)

    def outstanding(self) -> Iterator[Task]:
        """The stream's tasks not yet handed out (for tests and statistics)."""
        return iter(self._tasks.values())
