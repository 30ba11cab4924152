"""``prepare_batch``'s data source: cycled pass after pass, read off the Trio thread.

A synchronous source (a generator, a ``torch`` DataLoader whose iteration collates, a
sampler's ``set_epoch``) may block, so every call into it runs in a worker thread behind
a one-thread limiter (a list, tuple or range is read inline: it cannot block). Items are read into the feed's own buffer *by the
thread*, so a ``prepare_batch`` call cancelled while the thread reads loses nothing: the
next call finds the items there.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

import trio

from .._workflow import RolloutWorkflow
from ._store import AcceptFn, Callback, Owner, Task

__all__ = ["END", "Feed", "PrepareFeed", "same_source"]

END = object()  # a source read once (cycle=False) has no more items


def same_source(a: Any, b: Any) -> bool:
    """The same object, or equal plain sequences (``range(8)`` written twice is one source)."""
    return a is b or (type(a) is type(b) and isinstance(a, (range, list, tuple)) and a == b)


class Feed:
    """The items of one source, in order, across passes (epochs)."""

    def __init__(self, source: Any, *, cycle: bool, chunk: int = 64) -> None:
        if not isinstance(source, (Iterable, AsyncIterable)):
            raise TypeError(f"prepare_batch: source must be an iterable or async iterable, got {type(source).__name__}")
        self.source: Any = source
        self.cycle = cycle
        self.is_async = isinstance(source, AsyncIterable)
        self.batched = isinstance(getattr(source, "batch_size", None), int)
        # A list, tuple or range cannot block: read inline (no thread hop per item).
        self.in_memory = isinstance(source, (list, tuple, range))
        self.exhausted = False
        self.epoch = 0
        self._chunk = chunk
        self._it: Any = None
        self._yielded = False
        self._items: collections.deque[Any] = collections.deque()
        self._limiter = trio.CapacityLimiter(1)  # one reader: iterators are not thread-safe

    async def aclose(self) -> None:
        """Close an unfinished async iterator of the source (its ``finally`` blocks run now)."""
        it, self._it = self._it, None
        close = getattr(it, "aclose", None)
        if self.is_async and close is not None:
            with trio.move_on_after(5) as scope:
                scope.shield = True
                await close()

    async def next_item(self) -> Any:
        """The next item, or :data:`END` when a read-once source is used up."""
        while not self._items:
            if self.exhausted:
                return END
            if self.is_async:
                await self._read_async()
            elif self.in_memory:
                self._read_sync()
                await trio.lowlevel.checkpoint()
            else:
                await trio.to_thread.run_sync(self._read_sync, limiter=self._limiter)
        return self._items.popleft()

    def next_nowait(self) -> Any:
        """For an in-memory source (which cannot block): the next item at once, or
        :data:`END` when a read-once source is used up."""
        assert self.in_memory
        while not self._items:
            if self.exhausted:
                return END
            self._read_sync()
        return self._items.popleft()

    def _end_of_pass(self) -> None:
        """Called (in the reading thread for sync sources) when a pass ends."""
        self._it = None
        if not self._yielded:
            raise ValueError("prepare_batch: the data source yielded nothing in a full pass")
        if not self.cycle:
            self.exhausted = True
            return
        self.epoch += 1
        set_epoch = getattr(getattr(self.source, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)

    def _keep(self, element: Any) -> None:
        self._yielded = True
        if self.batched:
            self._items.extend(element)
        else:
            self._items.append(element)

    def _read_sync(self) -> None:
        """Read up to one chunk of elements into the buffer (runs in a worker thread)."""
        for _ in range(self._chunk):
            if self._it is None:
                self._it = iter(self.source)
                self._yielded = False
            try:
                element = next(self._it)
            except StopIteration:
                self._end_of_pass()
                return
            self._keep(element)
            if self._items:
                return  # one element is enough to go on; the rest are read on demand

    async def _read_async(self) -> None:
        if self._it is None:
            self._it = aiter(self.source)
            self._yielded = False
        try:
            element = await anext(self._it)
        except StopAsyncIteration:
            self._end_of_pass()
            return
        self._keep(element)


class PrepareFeed:
    """``prepare_batch``'s source, workflow and the untaken tasks made from it (submission order)."""

    def __init__(
        self, items: Feed, workflow_arg: Any, workflow: RolloutWorkflow, should_accept_fn: AcceptFn | None,
        callback: Callback | None,
    ) -> None:  # fmt: skip
        self.items = items
        self.workflow_arg = workflow_arg
        self.workflow = workflow
        self.should_accept_fn = should_accept_fn
        self.callback = callback
        self.owner = Owner("feed")
        self.tasks: list[Task] = []

    def choose(self, batch_size: int, dynamic_bs: bool, strict: bool, key: Callable[[Task], int]) -> list[Task] | None:
        """The tasks the next batch takes (accepted and result-less alike), or None if not ready."""
        if strict:
            candidates = self.tasks  # submission order; stop at the oldest unfinished task
        else:
            candidates = sorted(self.owner.finished.values(), key=key)
        chosen: list[Task] = []
        kept = 0
        for task in candidates:
            if task.status is None:
                break
            chosen.append(task)
            kept += task.deliverable
            if (len(chosen) if dynamic_bs else kept) >= batch_size:
                return chosen
        if self.items.exhausted and not self.owner.unfinished:
            return list(self.tasks)  # a read-once source is used up: what is left
        return None
