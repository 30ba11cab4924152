"""The executor's calls, rule by rule (found by mutation testing of ``_executor`` and
``_consumers``): each refusal's whole message and the numbers it names, and what each call
passes on to the workflow, the group and the acceptance check.

The executor tests reach these through whole runs; these pin each rule a user meets. What
the calls do over time (a stop, an abandoned call, stall warnings, progress, observers) is
in tests/test_executor_effects.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from rollout_trio.executor import open_executor
from rollout_trio.testing import ScriptedEngine

from .executor_helpers import DEADLINE, echo, scaled, small_rewards_only, whole


async def test_wait_refuses_counts_it_could_never_fill_naming_them(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, queue_size=3, max_head_offpolicyness=10) as ex:
        for bad in (0, -1, True, 1.5):
            with pytest.raises(ValueError, match=whole(f"count must be positive, got {bad!r}")):
                await ex.wait(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=whole("count must be <= queue_size (3), got 4")):
            await ex.wait(4)
        ex.submit(5, echo)
        with pytest.raises(TimeoutError, match=whole("Timed out waiting for 3 results, only received 1")):
            await ex.wait(3, timeout=1)
        assert await ex.wait(3, timeout=1, raise_timeout=False) == []
        (one,) = await ex.wait(1, timeout=1)  # the count at the queue's size is allowed, and nothing was taken
        assert float(one.rewards[0]) == 5.0


async def test_wait_for_task_says_why_it_cannot_answer(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine(delay=100) as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        tid = ex.submit(1, echo)
        with pytest.raises(TimeoutError, match=whole(f"Timed out waiting for task {tid}.")):
            await ex.wait_for_task(tid, timeout=1)
        assert await ex.wait_for_task(tid, timeout=1, raise_timeout=False) is None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.rollout_batch, [2], echo)
            await trio.testing.wait_all_tasks_blocked()
            batch_task = max(ex._store.tasks)
            with pytest.raises(ValueError, match=whole(
                f"Task {batch_task} belongs to a rollout_batch or prepare_batch call that will take it"
            )):  # fmt: skip
                await ex.wait_for_task(batch_task)
        assert float((await ex.wait_for_task(tid)).rewards[0]) == 1.0  # type: ignore[union-attr]
        with pytest.raises(ValueError, match=whole(f"Task {tid}: its result was already taken.")):
            await ex.wait_for_task(tid)
        with pytest.raises(ValueError, match=whole("Task 99 is never submitted.")):
            await ex.wait_for_task(99)


async def test_rollout_stream_refuses_a_window_or_data_it_cannot_use() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        for bad in (0, -2, True, 1.5, "2"):
            with pytest.raises(ValueError, match=whole(f"rollout_stream: window must be an integer >= 1, got {bad!r}")):
                ex.rollout_stream([1], echo, window=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=whole("rollout_stream: data must be an iterable or async iterable, got int")):
            ex.rollout_stream(3, echo)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=whole("should_accept_fn: must be callable or None, got int")):
            ex.rollout_stream([1], echo, should_accept_fn=1)  # type: ignore[arg-type]
        async with ex.rollout_stream([1, 2, 3], echo, window=1) as outcomes:  # the smallest window runs
            got = [float(o.trajectory.rewards[0]) async for o in outcomes]
        assert sorted(got) == [1.0, 2.0, 3.0]


async def test_prepare_batch_refuses_a_batch_size_it_cannot_use() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, queue_size=2, max_head_offpolicyness=10) as ex:
        for bad in (None, 0, True, 1.5):
            with pytest.raises(ValueError, match=whole(
                f"prepare_batch: batch_size must be an integer >= 1 (or the source's batch_size), got {bad!r}"
            )):  # fmt: skip
                await ex.prepare_batch([1, 2, 3], echo, batch_size=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=whole("Inference engine config's queue size is too small: 2 < batch size 3.")):
            await ex.prepare_batch([1, 2, 3], echo, batch_size=3)
        assert len(await ex.prepare_batch([1, 2, 3], echo, batch_size=2)) == 2  # the queue's size is allowed


async def test_submit_refuses_ids_and_callables_naming_the_argument() -> None:
    async with ScriptedEngine(delay=1) as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        for bad, kind in (("3", "str"), (True, "bool"), (1.0, "float")):
            with pytest.raises(TypeError, match=whole(f"task_id: must be an int or None, got {kind}")):
                ex.submit(1, echo, task_id=bad)  # type: ignore[arg-type]
        ex.submit(1, echo, task_id=4)
        with pytest.raises(ValueError, match=whole(
            "Duplicate task_id: 4; a task with this id is pending, running or unconsumed"
        )):  # fmt: skip
            ex.submit(1, echo, task_id=4)
        with pytest.raises(TypeError, match=whole("should_accept_fn: must be callable or None, got int")):
            ex.submit(1, echo, should_accept_fn=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=whole("callback: must be callable or None, got str")):
            ex.submit(1, echo, callback="print")  # type: ignore[arg-type]
        for call in (
            lambda: ex.rollout_batch([1], echo, callback="print"),
            lambda: ex.prepare_batch([1], echo, batch_size=1, callback="print"),
        ):
            with pytest.raises(TypeError, match=whole("callback: must be callable or None, got str")):
                await call()
        assert ex.statistics().submitted == 1  # the refused calls queued nothing


async def test_a_closed_executor_says_its_block_has_ended() -> None:
    async with ScriptedEngine() as engine:
        async with open_executor(engine) as ex:
            pass
        message = whole("the executor is closed (its `async with open_executor(...)` block has ended)")
        with pytest.raises(RuntimeError, match=message):
            ex.submit(1, echo)
        with pytest.raises(RuntimeError, match=message):
            await ex.wait(1)


async def test_dump_to_file_names_every_missing_piece_in_order() -> None:
    async with ScriptedEngine() as engine:
        with pytest.raises(ValueError, match=whole(
            "RolloutConfig.dump_to_file: needs fileroot, experiment_name, trial_name, tokenizer"
            " (set them, or turn dump_to_file off)"
        )):  # fmt: skip
            async with open_executor(engine, dump_to_file=True):
                pass


BUDGET = "(max_head_offpolicyness 0 + version 0 + 1) * consumer_batch_size 1 - accepted 0"
ADVICE = (
    "pass is_eval=True for evaluation, raise max_head_offpolicyness or consumer_batch_size, "
    "or split the batch (rollout_stream waits for version bumps)"
)


async def test_a_batch_the_budget_can_never_start_is_refused_naming_the_numbers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The budget named as the sum it is; a budget already overdrawn by queued work reads 0."""
    async with ScriptedEngine(delay=100) as engine, open_executor(engine, queue_size=4) as ex:
        with pytest.raises(ValueError, match=whole(
            "rollout_batch: 2 training tasks can never all start before the next version bump: the staleness "
            f"budget allows 1 = {BUDGET} - running 0 - queued ahead 0; {ADVICE}"
        )):  # fmt: skip
            await ex.rollout_batch(range(2), echo)
        for i in range(3):
            ex.submit(i, echo)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ValueError, match=whole(
            "rollout_batch: 1 training tasks can never all start before the next version bump: the staleness "
            f"budget allows 0 = {BUDGET} - running 1 - queued ahead 2; {ADVICE}"
        )):  # fmt: skip
            await ex.rollout_batch(range(1), echo)
        with pytest.raises(ValueError, match=whole(
            "prepare_batch: batch_size 2 can never be filled before the next version bump: 0 results are finished "
            f"or running and the staleness budget allows 0 more = {BUDGET} - running 1 - queued ahead 2 (other work "
            "first); bump the version (set_version) after each batch, use batch_size <= (max_head_offpolicyness + 1) "
            "* consumer_batch_size, or raise them"
        )):  # fmt: skip
            await ex.prepare_batch([1, 2, 3], echo, batch_size=2)
        assert ex.statistics().submitted == 3  # the refused calls queued nothing
        assert len(await ex.rollout_batch(range(5), echo, is_eval=True)) == 5  # evaluation is not budgeted


async def test_prepare_batch_counts_its_running_tasks_once_when_it_refuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two of the source's tasks running (a first call was cancelled), a budget of 2: a batch
    of 3 can never fill before a version bump, and the refusal names the 2 in hand."""
    async with ScriptedEngine(delay=100) as engine, open_executor(engine, consumer_batch_size=2) as ex:
        with trio.move_on_after(1):
            await ex.prepare_batch([1, 2, 3, 4], echo, batch_size=2)
        assert ex.statistics().running == 2
        with trio.fail_after(DEADLINE), pytest.raises(ValueError, match=whole(
            "prepare_batch: batch_size 3 can never be filled before the next version bump: 2 results are finished "
            "or running and the staleness budget allows 0 more = (max_head_offpolicyness 0 + version 0 + 1) * "
            "consumer_batch_size 2 - accepted 0 - running 2 - queued ahead 0 (other work first); bump the version "
            "(set_version) after each batch, use batch_size <= (max_head_offpolicyness + 1) * consumer_batch_size, "
            "or raise them"
        )):  # fmt: skip
            await ex.prepare_batch([1, 2, 3, 4], echo, batch_size=3)
        assert len(await ex.prepare_batch([1, 2, 3, 4], echo, batch_size=2)) == 2  # the two in hand fill this one


async def test_prepare_batch_checks_its_first_calls_arguments_and_names_another_source() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        with pytest.raises(TypeError, match=whole("should_accept_fn: must be callable or None, got int")):
            await ex.prepare_batch([1], echo, batch_size=1, should_accept_fn=1)  # type: ignore[arg-type]
        source = [1, 2]
        await ex.prepare_batch(source, echo, batch_size=1)
        with pytest.raises(ValueError, match=whole(
            "prepare_batch: called with another data source or workflow than the first call; "
            "one executor cycles one source (use submit / rollout_batch for others)"
        )):  # fmt: skip
            await ex.prepare_batch([3], echo, batch_size=1)


# ------------------------------------------------------------------ what each call passes on


async def stream_all(ex: Any, items: list[int], **kw: Any) -> list[Any]:
    async with ex.rollout_stream(items, **kw) as outcomes:
        return [o async for o in outcomes]


async def test_every_call_passes_its_workflow_kwargs_acceptance_and_group_options_on() -> None:
    """``workflow_kwargs`` reach the workflow, ``should_accept_fn`` judges its trajectories,
    ``group_options`` reach the group (a bad one is the group's own error), and one slot per
    task is the default."""
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=100) as ex:
        kw: dict[str, Any] = {"workflow_kwargs": {"scale": 10.0}, "should_accept_fn": small_rewards_only}
        batch = await ex.rollout_batch([1, 3], scaled, **kw)
        assert [(t.batch_size, float(t.rewards[0])) for t in batch] == [(1, 10.0)]
        outcomes = await stream_all(ex, [1, 3], workflow=scaled, **kw)
        assert sorted((o.status, o.reason, o.data) for o in outcomes) == [
            ("accepted", None, 1), ("rejected", "should_accept_fn", 3)
        ]  # fmt: skip
        (accepted,) = [o.trajectory for o in outcomes if o.status == "accepted"]
        assert (accepted.batch_size, float(accepted.rewards[0])) == (1, 10.0)
        grouped = await ex.rollout_batch([1], scaled, group_size=2, **kw)
        assert [t.batch_size for t in grouped] == [2]
        for call in (
            lambda: ex.rollout_batch([1], scaled, group_size=2, finalize_timeout=0, **kw),
            lambda: stream_all(ex, [1], workflow=scaled, group_size=2, finalize_timeout=0, **kw),
            lambda: ex.prepare_batch([1], scaled, batch_size=1, group_size=2, finalize_timeout=0, **kw),
        ):
            with pytest.raises(ValueError, match=whole("finalize_timeout must be > 0 seconds, got 0")):
                await call()
        with pytest.raises(TypeError, match=whole("should_accept_fn: must be callable or None, got int")):
            await ex.rollout_batch([1], scaled, workflow_kwargs={"scale": 1.0}, should_accept_fn=1)  # type: ignore[arg-type]
        (prepared,) = await ex.prepare_batch([1, 3], scaled, batch_size=1, **kw)
        assert (prepared.batch_size, float(prepared.rewards[0])) == (1, 10.0)


async def test_submit_binds_its_workflow_kwargs() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        tid = ex.submit(2, scaled, workflow_kwargs={"scale": 4.0})
        traj = await ex.wait_for_task(tid)
    assert traj is not None and float(traj.rewards[0]) == 8.0


async def test_the_stats_recorder_given_is_the_one_filled() -> None:
    from rollout_trio import StatsRecorder

    stats = StatsRecorder()
    async with ScriptedEngine() as engine, open_executor(engine, stats=stats, max_head_offpolicyness=10) as ex:
        await ex.rollout_batch([1], echo, group_size=2)
        assert ex.stats is stats
    assert stats.export()["rollout/target_slot_count"] == 2.0
