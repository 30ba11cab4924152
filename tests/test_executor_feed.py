"""``prepare_batch``'s data source, rule by rule (found by mutation testing): what a
source may be, read-once sources, epochs, data-loader batches, async sources' closing,
and one reader at a time for a blocking source.

Every call runs under a deadline, so a call that cannot finish fails instead of hanging
the suite. The clock is real where a source is read in a thread (a virtual clock would
jump past the deadline while the thread works).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import trio
import trio.testing

from rollout_trio.executor import open_executor
from rollout_trio.testing import ScriptedEngine

from .executor_helpers import echo

DEADLINE = 60.0  # real seconds: far more than any of these calls needs


def rewards(results: list[Any]) -> list[float]:
    return sorted(float(r.rewards[0]) for r in results)


async def test_a_source_that_is_not_iterable_is_refused_by_type() -> None:
    async with ScriptedEngine() as engine, open_executor(engine) as ex:
        with pytest.raises(TypeError, match=r"^prepare_batch: source must be an iterable or async iterable, got int$"):
            await ex.prepare_batch(7, echo, batch_size=1)


class EmptyAsync:
    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        raise StopAsyncIteration


@pytest.mark.parametrize("source", [[], iter(()), EmptyAsync()], ids=["list", "iterator", "async"])
async def test_a_source_yielding_nothing_in_a_pass_is_an_error(source: Any) -> None:
    async with ScriptedEngine() as engine, open_executor(engine) as ex:
        with trio.fail_after(DEADLINE), pytest.raises(
            ValueError, match=r"^prepare_batch: the data source yielded nothing in a full pass$"
        ):
            await ex.prepare_batch(source, echo, batch_size=1)


class Items:
    """A sync source that is not a list (so it is read in a thread), counting its passes."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.passes = 0

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        return iter(self.items)


class AsyncItems:
    """An async source whose iterator has no ``aclose`` (not an async generator)."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.passes = 0

    def __aiter__(self) -> AsyncIterator[int]:
        self.passes += 1
        return self._Iter(list(self.items))

    class _Iter:
        def __init__(self, items: list[int]) -> None:
            self.items = items

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> int:
            await trio.lowlevel.checkpoint()
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)


@pytest.mark.parametrize("kind", ["list", "thread", "async"])
async def test_a_read_once_source_gives_each_item_once_then_short_and_empty_batches(kind: str) -> None:
    items = [1, 2, 3, 4, 5]
    source: Any = {"list": items, "thread": Items(items), "async": AsyncItems(items)}[kind]
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        with trio.fail_after(DEADLINE):
            first = await ex.prepare_batch(source, echo, batch_size=2, cycle=False)
            second = await ex.prepare_batch(source, echo, batch_size=2, cycle=False)
            rest = await ex.prepare_batch(source, echo, batch_size=2, cycle=False)
            after = await ex.prepare_batch(source, echo, batch_size=2, cycle=False)
    assert [len(first), len(second), len(rest), len(after)] == [2, 2, 1, 0]
    assert rewards(first + second + rest) == [1.0, 2.0, 3.0, 4.0, 5.0]
    if kind != "list":
        assert source.passes == 1


async def test_a_read_once_source_returns_what_is_left_when_rejections_thin_it() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        with trio.fail_after(DEADLINE):
            batch = await ex.prepare_batch(
                Items([1, 2, 3, 4]), echo, batch_size=4, cycle=False, should_accept_fn=lambda t: float(t.rewards[0]) != 2.0
            )
    assert rewards(batch) == [1.0, 3.0, 4.0]


async def test_a_cycled_source_never_returns_a_short_batch_while_rejections_thin_it() -> None:
    """Rejected tasks are replaced from the source: each batch is full and accepted only."""
    source = Items([1, 2, 3])
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=0, consumer_batch_size=2) as ex:
        with trio.fail_after(DEADLINE):
            for step in range(3):
                batch = await ex.prepare_batch(
                    source, echo, batch_size=2, should_accept_fn=lambda t: float(t.rewards[0]) != 2.0
                )
                assert len(batch) == 2 and 2.0 not in rewards(batch)
                ex.set_version(step + 1)


async def test_every_new_pass_tells_the_sampler_its_epoch() -> None:
    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    class Loader(Items):
        def __init__(self) -> None:
            super().__init__([1, 2])
            self.sampler = Sampler()

    loader = Loader()
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=0, consumer_batch_size=2) as ex:
        with trio.fail_after(DEADLINE):
            for step in range(4):
                await ex.prepare_batch(loader, echo, batch_size=2)
                ex.set_version(step + 1)
    epochs = loader.sampler.epochs
    assert len(epochs) >= 3 and epochs == list(range(1, len(epochs) + 1))  # each pass after the first
    assert loader.passes - len(epochs) in (0, 1)  # the first pass, and maybe one under way


async def test_a_loader_with_a_batch_size_hands_out_the_items_of_each_batch() -> None:
    class Loader:
        batch_size = 2

        def __iter__(self) -> Iterator[list[int]]:
            return iter([[1, 2], [3, 4]])

    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        with trio.fail_after(DEADLINE):
            batch = await ex.prepare_batch(Loader(), echo, batch_size=4, cycle=False)
    assert rewards(batch) == [1.0, 2.0, 3.0, 4.0]  # each item a task, not each batch


async def test_closing_the_executor_closes_an_unfinished_async_source_even_when_cancelled() -> None:
    """The source's ``finally`` runs when the executor closes, shielded from the
    cancellation that closes it, and an iterator without ``aclose`` is simply left."""
    closed: list[str] = []

    async def numbers() -> AsyncIterator[int]:
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            await trio.lowlevel.checkpoint()  # a cancelled, unshielded close stops here
            closed.append("finally")

    async with ScriptedEngine() as engine:
        with trio.CancelScope() as scope:
            async with open_executor(engine) as ex:
                await ex.prepare_batch(numbers(), echo, batch_size=1)
                scope.cancel()
        async with open_executor(engine) as ex:
            await ex.prepare_batch(AsyncItems([1, 2, 3]), echo, batch_size=1)
    assert closed == ["finally"]


async def test_closing_gives_an_async_source_five_seconds(autojump_clock: trio.testing.MockClock) -> None:
    async def stubborn() -> AsyncIterator[int]:
        try:
            while True:
                yield 1
        finally:
            await trio.sleep(3600)  # a cleanup that would never finish

    async with ScriptedEngine() as engine:
        async with open_executor(engine) as ex:
            await ex.prepare_batch(stubborn(), echo, batch_size=1)
            closing = trio.current_time()
    assert trio.current_time() - closing == pytest.approx(5.0)


async def test_one_thread_reads_a_blocking_source_at_a_time() -> None:
    """Two concurrent calls read one iterator: never two threads in it at once (a
    generator raises "already executing" otherwise). The first read waits (in its thread)
    for a second reader that must not come."""
    inside = threading.Semaphore(1)
    overlaps: list[int] = []
    second_reader = threading.Event()

    class Blocking:
        def __init__(self) -> None:
            self.n = 0

        def __iter__(self) -> Iterator[int]:
            return self

        def __next__(self) -> int:
            if not inside.acquire(blocking=False):
                overlaps.append(self.n)
                second_reader.set()
                return -1
            try:
                if self.n == 0:
                    second_reader.wait(timeout=0.5)
                self.n += 1
                return self.n
            finally:
                inside.release()

    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        source = Blocking()
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(functools.partial(ex.prepare_batch, source, echo, batch_size=1))
    assert overlaps == []
