"""What the executor's calls do over time, rule by rule (found by mutation testing of
``_executor`` and ``_consumers``): a stop on an error, an abandoned call and what it hands
on, a stale result, the stall warning's words, the progress bars, what observers and
callbacks get, and what is logged.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import trio
import trio.testing

from rollout_trio import Trajectory
from rollout_trio.executor import ExecutorFailed, open_executor
from rollout_trio.testing import ScriptedEngine

from .executor_helpers import DEADLINE, echo, small_rewards_only


# ------------------------------------------------------------------ a stop on an error


async def test_a_stop_on_an_error_is_logged_whole_and_cancels_running_tasks_at_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """``on_workflow_error="raise"``: the error is logged with its type and text, and every
    task still running is cancelled then, not when the ``async with`` block ends."""
    caplog.set_level("ERROR", logger="rollout_trio.executor")
    started, cancelled = trio.Event(), trio.Event()

    async def slow(engine: Any, data: Any) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async def boom(engine: Any, data: Any) -> None:
        await started.wait()
        raise RuntimeError("bad luck")

    async with ScriptedEngine() as engine:
        with pytest.raises(ExecutorFailed, match=r"^the executor stopped: RuntimeError: bad luck$"):
            async with open_executor(
                engine, on_workflow_error="raise", max_head_offpolicyness=10, max_concurrent_rollouts=4
            ) as ex:
                ex.submit(0, slow)
                ex.submit(1, boom)
                with trio.fail_after(DEADLINE):
                    await cancelled.wait()  # inside the block: the stop itself cancelled it
                await ex.wait(1)
    assert "Rollout executor stopped: RuntimeError: bad luck" in [r.getMessage() for r in caplog.records]


async def test_a_stop_the_body_saw_and_handled_leaves_the_block_quietly() -> None:
    """Leaving raises ``ExecutorFailed`` only for a stop the body never saw."""

    async def boom(engine: Any, data: Any) -> None:
        raise RuntimeError("bad luck")

    async with ScriptedEngine() as engine:
        async with open_executor(engine, on_workflow_error="raise") as ex:
            ex.submit(0, boom)
            with pytest.raises(ExecutorFailed):
                await ex.wait(1)
        with pytest.raises(ExecutorFailed):
            async with open_executor(engine, on_workflow_error="raise") as ex:
                ex.submit(0, boom)
                with trio.fail_after(60):
                    while ex._failure is None:
                        await trio.testing.wait_all_tasks_blocked()


# ------------------------------------------------------------------ an abandoned call, a stale result


async def test_a_result_finished_after_its_batch_was_abandoned_goes_to_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A workflow that finishes its episode through a cancellation (shielded) after its
    ``rollout_batch`` call was cancelled: its accepted trajectory is handed on to ``wait``."""
    inside, release = trio.Event(), trio.Event()

    async def stubborn(engine: Any, data: Any) -> Trajectory:
        with trio.CancelScope(shield=True):
            inside.set()
            await release.wait()
            return await echo(engine, data)

    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        with trio.CancelScope() as call:
            async with trio.open_nursery() as nursery:

                async def batch() -> None:
                    await ex.rollout_batch([7], stubborn)

                nursery.start_soon(batch)
                await inside.wait()
                call.cancel()
        release.set()
        with trio.fail_after(DEADLINE):
            (late,) = await ex.wait(1)
        assert float(late.rewards[0]) == 7.0
        assert ex.statistics().balanced()


async def test_a_batch_abandoned_as_the_executor_stops_leaves_its_queued_tasks_to_the_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The executor stopped on an error: the batch's queued tasks end as the block closes
    (reason ``closed``), not one by one as the call unwinds."""
    outcomes: list[Any] = []

    async def boom(engine: Any, data: Any) -> None:
        raise RuntimeError("bad luck")

    async with ScriptedEngine() as engine:
        with pytest.raises(ExecutorFailed):
            async with open_executor(
                engine, on_workflow_error="raise", max_concurrent_rollouts=1, max_head_offpolicyness=10
            ) as ex:
                await ex.rollout_batch([0, 1, 2], boom, callback=outcomes.append)
    assert [(o.status, o.reason) for o in outcomes] == [
        ("failed", "workflow_exception"), ("cancelled", "closed"), ("cancelled", "closed")
    ]  # fmt: skip


async def test_a_submitted_result_dropped_as_stale_frees_its_id(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=1, consumer_batch_size=2) as ex:
        tid = ex.submit(1, echo)
        await trio.sleep(1)
        ex.set_version(2)
        assert await ex.wait(1, timeout=1, raise_timeout=False) == []  # dropped as stale
        assert ex.submit(2, echo, task_id=tid) == tid  # its id is free again
        assert float((await ex.wait_for_task(tid)).rewards[0]) == 2.0  # type: ignore[union-attr]
        assert ex.statistics().stale == 1


# ------------------------------------------------------------------ the stall warning


class Fleet(ScriptedEngine):
    """A scripted engine with a fleet's ``servers`` list (what the stall warning reads)."""

    def __init__(self, ups: list[Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.servers = ups


@pytest.mark.parametrize(
    ("servers", "tail"),
    [
        ([types.SimpleNamespace(up=True), types.SimpleNamespace(up=False), types.SimpleNamespace()], ", 1 of 3 servers out of service"),
        ([types.SimpleNamespace(up=True)], ""),
        ([], ""),
        ((types.SimpleNamespace(up=False),), ""),  # not a fleet's list: not read
    ],
    ids=["one-down", "all-up", "empty", "not-a-list"],
)
async def test_the_stall_warning_names_the_servers_out_of_service(
    servers: Any, tail: str, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The warning says what holds the call back: here one task running on a slow server,
    one queued behind it, and (for a fleet) how many of its servers are down."""
    caplog.set_level("WARNING", logger="rollout_trio.executor")
    async with Fleet(servers, delay=1000) as engine, open_executor(
        engine, stall_warning_s=30.0, max_concurrent_rollouts=1, max_head_offpolicyness=10
    ) as ex:
        with trio.move_on_after(40):
            await ex.rollout_batch(range(2), echo)
    lines = [r.getMessage() for r in caplog.records if "without progress" in r.getMessage()]
    assert lines == [f"rollout_batch has waited 30 s without progress: 1 running, 1 queued{tail}"]


async def test_the_stall_warning_names_the_version_the_budget_is_judged_by(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="rollout_trio.executor")
    async with ScriptedEngine() as engine, open_executor(engine, stall_warning_s=30.0, consumer_batch_size=2) as ex:
        ex.set_version(3)
        for i in range(10):
            ex.submit(i, echo)
        with trio.move_on_after(40):
            await ex.wait(9)
    lines = [r.getMessage() for r in caplog.records if "without progress" in r.getMessage()]
    assert lines == [
        "wait has waited 30 s without progress: 0 running, 2 queued, the staleness budget is spent ((max_head_offpolicyness 0"
        " + version 3 + 1) * consumer_batch_size 2 - accepted 8 - running 0 - queued ahead 2 <= 0: a version bump opens it)"
    ]


async def test_wait_for_task_answers_through_a_run_of_rejections_and_names_itself_when_stalled(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Waiting for one task is not stopped by other tasks ending without a trajectory (that
    task's own answer may be None), and its stall warning names the call."""
    caplog.set_level("WARNING", logger="rollout_trio.executor")

    async def nothing(engine: Any, data: Any) -> None:
        return None

    async def late(engine: Any, data: Any) -> Trajectory:
        await trio.sleep(100)
        return await echo(engine, data)

    async with ScriptedEngine() as engine, open_executor(
        engine, max_consecutive_rejections=2, stall_warning_s=30.0, max_head_offpolicyness=10, max_concurrent_rollouts=8
    ) as ex:
        tid = ex.submit(4, late, workflow_kwargs=None)
        for i in range(5):
            ex.submit(i, nothing)
        with trio.fail_after(DEADLINE):
            traj = await ex.wait_for_task(tid)
    assert traj is not None and float(traj.rewards[0]) == 4.0
    lines = [r.getMessage() for r in caplog.records if "without progress" in r.getMessage()]
    assert lines == ["wait_for_task has waited 30 s without progress: 1 running"]


# ------------------------------------------------------------------ progress bars


class Bar:
    """Stands in for tqdm: records how each bar was made and the counts it was moved to."""

    made: list[Bar] = []

    def __init__(self, **kw: Any) -> None:
        self.kw, self.n, self.counts = kw, 0, []  # type: ignore[var-annotated]
        Bar.made.append(self)

    def update(self, k: int) -> None:
        self.n += k
        self.counts.append(self.n)

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


async def test_the_progress_bars_count_what_each_call_has_finished(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """``rollout_batch`` counts its finished tasks of all of them, ``prepare_batch`` its
    accepted trajectories of the batch; ``progress=None`` shows a bar only on a terminal."""
    import sys

    import tqdm

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    Bar.made.clear()
    async with ScriptedEngine(delay=1) as engine, open_executor(
        engine, max_concurrent_rollouts=1, consumer_batch_size=3, max_head_offpolicyness=10
    ) as ex:
        await ex.rollout_batch([1, 2, 3], echo)  # stderr is not a terminal here
        await ex.rollout_batch([1, 2, 3], echo, progress=False)
        assert Bar.made == []
        await ex.rollout_batch([1, 2, 3], echo, progress=True)
        await ex.prepare_batch([1, 2, 3], echo, batch_size=3, cycle=False, progress=True)
    batch, prepared = Bar.made
    common = {"file": sys.stderr, "dynamic_ncols": True, "leave": False}
    assert batch.kw == {"total": 3, "unit": "task", **common}
    assert prepared.kw == {"total": 3, "unit": "traj", **common}
    for bar in (batch, prepared):  # moved to each count as it was reached, never past it
        assert sorted(set(bar.counts)) == [0, 1, 2], bar.counts
        assert bar.counts == sorted(bar.counts)


async def test_a_terminal_gets_a_progress_bar_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    import tqdm

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(sys, "stderr", Terminal())
    Bar.made.clear()
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        await ex.rollout_batch([1], echo)
        await ex.rollout_batch([1], echo, progress=False)
    assert [bar.kw["file"] for bar in Bar.made] == [sys.stderr]


# ------------------------------------------------------------------ observers, callbacks, logs, statistics


class Everything:
    """An observer that records every argument of every event."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def task_queued(self, task_id: int, *, is_eval: bool, time: float) -> None:
        self.events.append(("queued", task_id, is_eval, time))

    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        self.events.append(("started", task_id, version, time))

    def task_finished(self, task_id: int, *, status: str, reason: str | None, result: object, time: float) -> None:
        self.events.append(("finished", task_id, status, reason, result, time))

    def task_consumed(self, task_id: int, *, version: int, lag: int, time: float) -> None:
        self.events.append(("consumed", task_id, version, lag, time))


class Failing:
    """An observer whose every method raises (each failure is logged, naming the method)."""

    def __repr__(self) -> str:
        return "<failing observer>"

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("task_"):
            raise AttributeError(name)

        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(name)

        return fail


async def test_observers_get_every_argument_of_every_event_and_a_failing_one_is_named(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The times are the clock's at each transition, ``finished`` carries the result, the
    lag of a consumed result counts versions from its own (``version 3 - 1``), a rejected
    result is never "consumed", and the callback gets the item."""
    seen, outcomes = Everything(), []
    async with ScriptedEngine(delay=1) as engine, open_executor(
        engine, observers=[seen, Failing()], max_head_offpolicyness=10, max_concurrent_rollouts=4
    ) as ex:
        t0 = trio.current_time()
        ex.set_version(1)
        tid = ex.submit(5, echo, callback=outcomes.append)
        with trio.fail_after(DEADLINE):
            await trio.sleep(1.5)  # it finished at t0 + 1 (a virtual second)
            ex.set_version(3)
            (traj,) = await ex.wait(1)
            results = await ex.rollout_batch([1, 30], echo, should_accept_fn=small_rewards_only, callback=outcomes.append)
    t1 = t0 + 1.5
    assert seen.events[:4] == [
        ("queued", tid, False, t0), ("started", tid, 1, t0), ("finished", tid, "accepted", None, traj, t0 + 1),
        ("consumed", tid, 3, 2, t1),
    ]  # fmt: skip
    kinds = [(e[0], e[1]) for e in seen.events[4:]]
    batch_ids = sorted({e[1] for e in seen.events[4:]})
    (accepted_id,) = [e[1] for e in seen.events if e[0] == "finished" and e[2] == "accepted" and e[1] != tid]
    assert [k for k in kinds if k[0] == "consumed"] == [("consumed", accepted_id)]  # the rejected one is not
    assert [e[2:4] for e in seen.events if e[0] == "consumed" and e[1] == accepted_id] == [(3, 0)]  # no lag
    assert len(results) == 1 and len(batch_ids) == 2
    assert sorted((o.status, o.data) for o in outcomes) == [("accepted", 1), ("accepted", 5), ("rejected", 30)]
    failures = {r.getMessage() for r in caplog.records if r.getMessage().startswith("Executor observer")}
    assert failures == {
        f"Executor observer <failing observer> failed in {name}."
        for name in ("task_queued", "task_started", "task_finished", "task_consumed")
    }


async def test_a_failing_callback_and_a_stale_drop_are_logged_whole(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="rollout_trio.executor")

    def broken(outcome: Any) -> None:
        raise RuntimeError("callback bug")

    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=1, consumer_batch_size=2) as ex:
        tid = ex.submit(1, echo, callback=broken)
        with trio.fail_after(60):
            while ex.statistics().buffered == 0:
                await trio.testing.wait_all_tasks_blocked()
        ex.set_version(2)
        assert await ex.wait(1, timeout=0, raise_timeout=False) == []  # dropped as stale
    messages = [r.getMessage() for r in caplog.records]
    assert f"Completion callback of task {tid} failed." in messages
    assert f"Task {tid}: dropped, its oldest token (version 0) is older than 1." in messages


async def test_group_statistics_reset_by_default_and_keep_with_reset_false() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        await ex.rollout_batch(range(2), echo, group_size=2)
        kept = ex.group_statistics(reset=False)
        assert kept and ex.group_statistics(reset=False) == kept
        assert ex.group_statistics() == kept
        assert ex.group_statistics() == {}
