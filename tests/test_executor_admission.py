"""The executor's gates and stall watch, one part at a time (found by mutation testing).

``Admission`` decides which queued task starts; ``CallWait`` is how a consumer call
waits and when it says it has stalled; ``ExecutorStalled`` is what a call raises after
too many tasks in a row end without a trajectory. The executor tests reach them through
whole calls; these pin each rule and each message a user reads, whole.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from rollout_trio.executor import ExecutorStalled
from rollout_trio.executor._admission import Admission
from rollout_trio.executor._liveness import StallWatch
from rollout_trio.executor._staleness import RolloutStat, StalenessManager
from rollout_trio.executor._store import Owner, Task


class Version:
    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version


def admission(*, concurrency: int = 8, batch: int = 2, staleness: int = 0, queue_size: int = 4) -> Admission:
    return Admission(StalenessManager(Version(), concurrency, batch, staleness), queue_size)


_order = iter(range(10**9))


def task(owner: Owner, *, is_eval: bool = False) -> Task:
    n = next(_order)
    return Task(n, None, None, None, is_eval, None, owner, n)  # type: ignore[arg-type]


def test_queueing_and_unqueueing_count_training_tasks_only() -> None:
    adm = admission()
    train, ev = task(Owner("common")), task(Owner("common"), is_eval=True)
    adm.queue(train)
    adm.queue(ev)
    assert adm.staleness.get_stats() == RolloutStat(enqueued=1)
    assert (adm.queued, adm.queued_training) == (2, 1)
    adm.unqueue(ev)
    assert adm.staleness.get_stats() == RolloutStat(enqueued=1)
    adm.unqueue(train)
    assert adm.staleness.get_stats() == RolloutStat(enqueued=0)
    assert adm.queued == 0


def test_drain_takes_every_queue_oldest_first_and_uncounts_them() -> None:
    adm = admission()
    batch = Owner("batch")
    tasks = [task(batch), task(Owner("common"), is_eval=True), task(Owner("common")), task(batch, is_eval=True)]
    for t in tasks:
        adm.queue(t)
    assert adm.drain() == tasks
    assert adm.queued == 0 and adm.staleness.get_stats() == RolloutStat(enqueued=0)


def test_evaluation_starts_first_then_the_oldest_training_task() -> None:
    adm = admission()
    common, batch = Owner("common"), Owner("batch")
    old_train, new_train, ev = task(common), task(batch), task(common, is_eval=True)
    for t in (old_train, new_train, ev):
        adm.queue(t)
    assert [adm.next_task() for _ in range(4)] == [ev, old_train, new_train, None]


def test_start_and_end_move_the_running_counts_and_the_budget() -> None:
    adm = admission()
    common, batch = Owner("common"), Owner("batch")
    a, b, c = task(common), task(batch), task(common, is_eval=True)
    for t in (a, b, c):
        adm.queue(t)
        adm.started(adm.next_task() or t)
    assert adm.running == {a, b, c} and adm.running_common == 2
    assert adm.staleness.get_stats() == RolloutStat(enqueued=0, running=2)
    adm.ended(a, accepted=True)
    adm.ended(b, accepted=False)
    adm.ended(c, accepted=True)
    assert adm.running == set() and adm.running_common == 0
    assert adm.staleness.get_stats() == RolloutStat(enqueued=0, running=0, accepted=1, rejected=1)


def test_concurrency_bounds_starts_and_a_pause_stops_them() -> None:
    adm = admission(concurrency=1, staleness=10)
    owner = Owner("batch")
    first, second = task(owner), task(owner)
    adm.queue(first)
    adm.queue(second)
    adm.started(adm.next_task() or first)
    assert adm.next_task() is None  # one running: the limit
    adm.ended(first, accepted=True)
    adm.paused = True
    assert adm.next_task() is None
    adm.paused = False
    assert adm.next_task() is second


def test_a_zero_concurrency_limit_still_runs_one_task() -> None:
    adm = admission(concurrency=0, staleness=10)
    t = task(Owner("batch"))
    adm.queue(t)
    assert adm.next_task() is t


def test_the_common_pool_waits_for_room_while_a_calls_own_tasks_start() -> None:
    adm = admission(queue_size=2, staleness=10)
    common, batch = Owner("common"), Owner("batch")
    pool_task, own_task = task(common), task(batch)
    adm.queue(pool_task)
    adm.queue(own_task)
    adm.pool_buffered = 2  # two results wait for wait(): the pool is full
    assert adm.next_task() is own_task
    assert adm.next_task() is None
    adm.pool_buffered = 1
    assert adm.next_task() is pool_task


def test_an_evaluation_task_of_the_common_pool_waits_for_pool_room_too() -> None:
    adm = admission(queue_size=1)
    ev = task(Owner("common"), is_eval=True)
    adm.queue(ev)
    adm.pool_buffered = 1
    assert adm.next_task() is None and not adm.starved()
    adm.pool_buffered = 0
    assert adm.next_task() is ev


def test_training_waits_on_the_budget_and_is_starved_only_then() -> None:
    adm = admission(batch=1, staleness=0)  # budget: (0 + 0 + 1) * 1 = one training start
    owner = Owner("batch")
    first, second = task(owner), task(owner)
    assert not adm.starved()  # nothing queued
    adm.queue(first)
    adm.queue(second)
    assert adm.budget_left() == 1 and adm.budget_for_new() == -1
    adm.started(adm.next_task() or first)
    assert adm.next_task() is None and adm.starved()
    adm.paused = True
    assert not adm.starved()  # a pause holds it back, not the budget
    adm.paused = False
    ev = task(owner, is_eval=True)
    adm.queue(ev)
    assert adm.next_task() is ev  # evaluation is not held by the budget
    adm.staleness.version_provider.version = 1  # type: ignore[attr-defined]
    assert adm.next_task() is second and not adm.starved()


def test_the_budget_ignores_concurrency() -> None:
    adm = admission(concurrency=1, batch=4, staleness=1)
    t = task(Owner("batch"))
    adm.queue(t)
    adm.started(adm.next_task() or t)
    assert adm.staleness.get_capacity() == 0  # concurrency is full
    assert adm.budget_left() == (1 + 0 + 1) * 4 - 1


def test_waiting_on_says_the_executor_is_paused() -> None:
    adm = admission()
    adm.queue(task(Owner("batch")))
    adm.paused = True
    assert adm.waiting_on(0) == "the executor is paused (resume() starts work again)"


def test_waiting_on_names_the_spent_budget_with_its_numbers() -> None:
    adm = admission(batch=2, staleness=1, queue_size=4)
    owner = Owner("batch")
    for _ in range(5):
        adm.queue(task(owner))
    for _ in range(4):
        t = adm.next_task()
        assert t is not None
        adm.started(t)
    assert adm.waiting_on(0) == (
        "4 running, 1 queued, the staleness budget is spent "
        "((max_head_offpolicyness 1 + version 0 + 1) * consumer_batch_size 2 - accepted 0 - running 4"
        " - queued ahead 1 <= 0: a version bump opens it)"
    )


def test_waiting_on_names_a_full_common_pool() -> None:
    adm = admission(queue_size=3, staleness=10)
    common = Owner("common")
    running = task(common)
    adm.queue(running)
    adm.started(adm.next_task() or running)
    adm.queue(task(common, is_eval=True))
    adm.pool_buffered = 2
    assert adm.waiting_on(0) == (
        "1 running, 1 queued, the common pool is full "
        "(2 results wait for wait() + 1 running >= queue_size 3)"
    )


def test_waiting_on_with_room_everywhere_counts_only() -> None:
    adm = admission(queue_size=3, staleness=10)
    assert adm.waiting_on(0) == "0 running"
    adm.queue(task(Owner("common")))
    assert adm.waiting_on(0) == "0 running, 1 queued"
    adm.pool_buffered = 3  # now the queued pool task has no room
    assert adm.waiting_on(5) == (
        "0 running, 1 queued, the common pool is full (3 results wait for wait() + 0 running >= queue_size 3)"
    )


def test_waiting_on_names_no_budget_while_one_start_is_left() -> None:
    adm = admission(concurrency=1, batch=2, staleness=0)  # budget: 2 starts
    owner = Owner("batch")
    first = task(owner)
    adm.queue(first)
    adm.started(adm.next_task() or first)
    adm.queue(task(owner))
    assert adm.budget_left() == 1
    assert adm.waiting_on(0) == "1 running, 1 queued"  # concurrency holds it, not the budget


def test_waiting_on_a_call_with_a_spent_budget_and_nothing_training_queued_names_no_budget() -> None:
    adm = admission(batch=1, staleness=0)
    t = task(Owner("batch"))
    adm.queue(t)
    adm.started(adm.next_task() or t)
    adm.queue(task(Owner("batch"), is_eval=True))
    assert adm.budget_left() == 0
    assert adm.waiting_on(0) == "1 running, 1 queued"


# --------------------------------------------------------------------------- ExecutorStalled


def test_executor_stalled_names_the_call_the_count_and_the_reasons_most_first() -> None:
    err = ExecutorStalled("rollout_batch", 5, {"returned_none": 2, "workflow_exception": 3})
    assert str(err) == (
        "rollout_batch: 5 tasks in a row ended without a trajectory (workflow_exception 3, returned_none 2); "
        "max_consecutive_rejections stops it here: fix the workflow or its filter, "
        "or raise max_consecutive_rejections (None: never stop)"
    )
    assert (err.call, err.count, err.reasons) == ("rollout_batch", 5, {"returned_none": 2, "workflow_exception": 3})


# --------------------------------------------------------------------------- CallWait


class Watch:
    """A StallWatch whose observers record what they are told."""

    def __init__(self, limit: float | None, rejections: int | None = None) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.watch = StallWatch(
            limit,
            rejections,
            describe=lambda: "what holds it",
            on_stall=lambda call, on, waited: self.events.append(("stall", call, on, waited)),
            on_unstall=lambda call: self.events.append(("unstall", call)),
        )


async def test_check_rejections_raises_at_the_limit_and_gives_the_next_call_a_fresh_allowance() -> None:
    w = Watch(None, rejections=2)
    owner = Owner("batch")

    async def park() -> None:  # never reached
        raise AssertionError

    with w.watch.call("wait", owner, park) as call:
        owner.record("rejected", "returned_none")
        call.check_rejections()  # one in a row: below the limit
        owner.record("failed", "workflow_exception")
        with pytest.raises(ExecutorStalled) as info:
            call.check_rejections()
    assert (info.value.count, info.value.reasons) == (2, {"returned_none": 1, "workflow_exception": 1})
    assert owner.unaccepted_run == 0 and not owner.unaccepted_reasons
    owner.record("rejected", "returned_none")
    with w.watch.call("wait", owner, park) as call:
        call.check_rejections()  # one of a fresh two


async def test_a_call_warns_once_after_the_limit_without_progress_across_several_parks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Wake-ups without progress do not restart the clock: the warning comes 10 s after
    the last progress although no single park lasted 10 s; later parks do not repeat it."""
    w = Watch(10.0)
    owner = Owner("batch")

    async def park() -> None:
        await trio.sleep(6)

    start = trio.current_time()
    with w.watch.call("wait", owner, park) as call:
        owner.ended += 1  # progress before the first park
        for _ in range(4):
            await call.park()
        assert w.events == [("stall", "wait", "what holds it", 10.0)]
        assert w.watch.stalled == {"wait": 1} and call.stalled
        owner.ended += 1  # progress clears it at the next park
        await call.park()
        assert w.events[1:] == [("unstall", "wait")] and w.watch.stalled == {}
    assert trio.current_time() - start == 10 + 6 + 6 + 6


async def test_the_clock_starts_when_the_call_starts_and_the_warning_is_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A call that has not progressed since it started warns ``stall_warning_s`` after
    its start, not after its first park, and logs what it waits on."""
    await trio.sleep(100)  # the clock is far from 0
    w = Watch(10.0)

    async def park() -> None:
        await trio.sleep_forever()

    with w.watch.call("rollout_batch", Owner("batch"), park) as call:
        await trio.sleep(4)  # work before the first park
        started_parking = trio.current_time()
        with caplog.at_level("WARNING", logger="rollout_trio.executor"):
            await call.park()
        assert trio.current_time() - started_parking == 6
    assert w.events == [("stall", "rollout_batch", "what holds it", 10.0), ("unstall", "rollout_batch")]
    assert [r.getMessage() for r in caplog.records] == [
        "rollout_batch has waited 10 s without progress: what holds it"
    ]


async def test_two_stalled_calls_of_one_name_are_counted_and_cleared_one_by_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    w = Watch(1.0)

    async def park() -> None:
        await trio.sleep_forever()

    a, b = Owner("batch"), Owner("batch")
    with w.watch.call("rollout_batch", a, park) as first:
        with w.watch.call("rollout_batch", b, park) as second:
            await first.park()
            await second.park()
            assert w.watch.stalled == {"rollout_batch": 2}
        assert w.watch.stalled == {"rollout_batch": 1} and not second.stalled and first.stalled
    assert w.watch.stalled == {}
    assert [e[0] for e in w.events] == ["stall", "stall", "unstall", "unstall"]


async def test_without_a_limit_a_call_parks_bare_and_never_warns(autojump_clock: trio.testing.MockClock) -> None:
    w = Watch(None)
    parks = 0

    async def park() -> None:
        nonlocal parks
        parks += 1
        await trio.sleep(1000)

    with w.watch.call("wait", Owner("batch"), park) as call:
        await call.park()
        await call.park()
    assert parks == 2 and w.events == []
