"""Issue 27: a call's own results never stop that call or other work from starting.

Each test is a reproduction from the issue that waited forever on the old executor (the
dispatcher counted every finished result, owned or not, against ``queue_size``). A hang
here is a failure: every call runs under a virtual-clock deadline (``autojump_clock``), so
a call that cannot finish fails the test at once instead of stalling the suite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import trio.testing

from rollout_trio import GenerationConfig, ModelRequest, Trajectory
from rollout_trio.executor import open_executor
from rollout_trio.testing import ScriptedEngine

GC = GenerationConfig(max_new_tokens=2)
DEADLINE = 3600.0  # virtual seconds: far more than any of these calls needs when it can finish


async def workflow(engine: Any, data: Any) -> Trajectory:
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GC))
    return Trajectory.from_response(resp, 1.0)


@pytest.mark.parametrize("is_eval", [True, False])
async def test_a_rollout_batch_longer_than_queue_size_finishes_on_the_default_config(
    autojump_clock: trio.testing.MockClock, is_eval: bool
) -> None:
    """The issue's first reproduction: 17 items on queue_size 16 waited forever (eval)."""
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=1000) as ex:
        assert ex.queue_size == 16
        with trio.fail_after(DEADLINE):
            results = await ex.rollout_batch(list(range(17)), workflow, is_eval=is_eval)
        assert len(results) == 17
        s = ex.statistics()
        assert s.buffered == 0 and s.running == 0 and s.balanced(), s


@pytest.mark.parametrize("is_eval", [True, False])
async def test_80_items_on_a_small_batch_config_finish(autojump_clock: trio.testing.MockClock, is_eval: bool) -> None:
    """consumer_batch_size=4, max_head_offpolicyness=1000: 60 items finished, 80 hung."""
    async with ScriptedEngine() as engine, open_executor(
        engine, consumer_batch_size=4, max_head_offpolicyness=1000
    ) as ex:
        with trio.fail_after(DEADLINE):
            results = await ex.rollout_batch(list(range(80)), workflow, is_eval=is_eval)
        assert len(results) == 80


async def test_leftover_prepare_batch_results_do_not_block_submits_or_eval_batches(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The trainer loop of the issue (batch 64, concurrency 8, s=2, an eval rollout_batch(8)
    after each step) hung at step 7; AReaL runs its 10 steps."""
    dataset = [{"i": i} for i in range(1000)]
    async with ScriptedEngine() as engine, open_executor(
        engine, consumer_batch_size=64, max_concurrent_rollouts=8, max_head_offpolicyness=2
    ) as ex:
        for step in range(10):
            with trio.fail_after(DEADLINE):
                batch = await ex.prepare_batch(dataset, workflow, batch_size=64)
                assert len(batch) == 64
                ex.set_version(step + 1)
                evals = await ex.rollout_batch(list(range(8)), workflow, is_eval=True)
                assert len(evals) == 8
                ex.submit({}, workflow)
                assert await ex.wait(1, timeout=DEADLINE)
        assert ex.statistics().balanced()


async def slow_workflow(engine: Any, data: Any) -> Trajectory:
    await trio.sleep(1)
    return await workflow(engine, data)


async def failing_workflow(engine: Any, data: Any) -> Trajectory:
    await trio.sleep(0.01)
    raise RuntimeError("always fails")


async def test_a_full_common_pool_does_not_stop_a_rollout_batch(autojump_clock: trio.testing.MockClock) -> None:
    """Unconsumed submit results filled queue_size, and every rollout_batch then waited for
    the next wait(): a call's work is not the common pool's."""
    async with ScriptedEngine() as engine, open_executor(engine, queue_size=4, max_head_offpolicyness=1000) as ex:
        for i in range(4):
            ex.submit(i, workflow)
        with trio.fail_after(DEADLINE):
            while ex.statistics().buffered < 4:
                await trio.sleep(1)
            assert len(await ex.rollout_batch(range(8), workflow, is_eval=True)) == 8
            assert len(await ex.rollout_batch(range(8), workflow)) == 8
            ex.submit(99, workflow)  # the pool is full: it waits for room ...
            assert len(await ex.wait(4)) == 4
            assert len(await ex.wait(1)) == 1  # ... and runs once there is
        assert ex.statistics().balanced()


async def test_a_training_batch_counts_the_training_work_queued_ahead_of_it(autojump_clock: trio.testing.MockClock) -> None:
    """Submits queued ahead took the budget first and the batch, within the budget alone,
    waited forever; now the check counts them and names the numbers at once."""
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=4, max_concurrent_rollouts=1) as ex:
        for i in range(3):
            ex.submit(i, slow_workflow)
        with trio.fail_after(1), pytest.raises(ValueError, match=r"2 training tasks can never all start.* allows 1 .* queued ahead 3"):
            await ex.rollout_batch(range(2), workflow)
        assert ex.statistics().submitted == 3  # nothing of the refused batch was queued
        with trio.fail_after(DEADLINE):
            assert len(await ex.rollout_batch(range(1), workflow)) == 1  # what the budget leaves does run
            assert len(await ex.wait(3)) == 3


async def test_of_two_concurrent_training_batches_the_second_is_refused_when_both_cannot_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two batches that each passed the check alone hung: one took every start."""
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=4, max_concurrent_rollouts=1) as ex:
        results: list[Any] = []
        async with trio.open_nursery() as nursery:

            async def first() -> None:
                results.extend(await ex.rollout_batch(range(3), slow_workflow))

            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            with trio.fail_after(1), pytest.raises(ValueError, match=r"3 training tasks can never all start"):
                await ex.rollout_batch(range(3), slow_workflow)
        assert len(results) == 3


async def test_prepare_batch_whose_every_episode_fails_raises_executor_stalled(autojump_clock: trio.testing.MockClock) -> None:
    """prepare_batch resubmitted failing episodes forever, silently (3,748 in 5 s)."""
    from rollout_trio import ExecutorStalled

    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=4, max_consecutive_rejections=50) as ex:
        with trio.fail_after(DEADLINE), pytest.raises(ExecutorStalled, match=r"prepare_batch: \d+ tasks in a row .*workflow_exception") as info:
            await ex.prepare_batch(range(10), failing_workflow, batch_size=4)
        # Tasks that end in the same instant are counted together: at most a concurrency's worth over.
        assert 50 <= info.value.count < 54 and info.value.reasons == {"workflow_exception": info.value.count}
        s = ex.statistics()
        assert s.failed >= 50 and s.balanced()


async def test_wait_and_rollout_batch_raise_executor_stalled_when_nothing_is_ever_accepted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from rollout_trio import ExecutorStalled

    async with ScriptedEngine() as engine, open_executor(engine, max_consecutive_rejections=5, max_head_offpolicyness=100) as ex:
        for i in range(20):
            ex.submit(i, failing_workflow)
        with trio.fail_after(DEADLINE), pytest.raises(ExecutorStalled, match="wait: 5 tasks in a row"):
            await ex.wait(1)
        with trio.fail_after(DEADLINE), pytest.raises(ExecutorStalled, match="rollout_batch: 5 tasks in a row"):
            await ex.rollout_batch(range(20), failing_workflow, is_eval=True)
        # The executor goes on: a good batch still runs.
        with trio.fail_after(DEADLINE):
            assert len(await ex.rollout_batch(range(3), workflow)) == 3
        assert ex.statistics().balanced()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda resp: Trajectory.from_response(resp, 1e39), id="from_response-1e39"),
        pytest.param(
            lambda resp: {**Trajectory.from_response(resp, 0.0).to_dict(), "rewards": torch.tensor([1e39], dtype=torch.float64)},
            id="dict-tensor-1e39",
        ),
        pytest.param(lambda resp: {**Trajectory.from_response(resp, 0.0).to_dict(), "rewards": "high"}, id="dict-string"),
    ],
)
async def test_a_reward_float32_cannot_hold_or_a_string_rejects_its_task_only(
    autojump_clock: trio.testing.MockClock, make: Any
) -> None:
    """These stopped the whole executor (WorkflowContractError) instead of rejecting the task."""

    async def bad(engine: Any, data: Any) -> Any:
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GC))
        return make(resp) if data == 0 else Trajectory.from_response(resp, 1.0)

    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=100) as ex:
        with trio.fail_after(DEADLINE):
            results = await ex.rollout_batch(range(4), bad)
        assert len(results) == 3
        assert ex.statistics().rejected_by_reason == {"invalid_reward": 1}


async def test_a_call_waiting_on_something_outside_says_what_after_stall_warning_s(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A paused executor and a spent staleness budget are named in one log line and in statistics()."""
    caplog.set_level("WARNING", logger="rollout_trio.executor")
    async with ScriptedEngine() as engine, open_executor(engine, stall_warning_s=30.0, max_head_offpolicyness=100) as ex:
        await ex.pause()
        done = trio.Event()
        async with trio.open_nursery() as nursery:

            async def batch() -> None:
                await ex.rollout_batch(range(2), workflow, is_eval=True)
                done.set()

            nursery.start_soon(batch)
            await trio.sleep(31)
            assert ex.statistics().stalled_calls == {"rollout_batch": 1}
            lines = [r.getMessage() for r in caplog.records if "without progress" in r.getMessage()]
            assert len(lines) == 1 and "rollout_batch has waited 30 s" in lines[0] and "paused" in lines[0], lines
            await trio.sleep(300)
            assert len([r for r in caplog.records if "without progress" in r.getMessage()]) == 1  # said once
            await ex.resume()
            with trio.fail_after(DEADLINE):
                await done.wait()
        assert ex.statistics().stalled_calls == {}
    caplog.clear()
    async with ScriptedEngine() as engine, open_executor(engine, stall_warning_s=30.0, consumer_batch_size=2) as ex:
        for i in range(4):
            ex.submit(i, workflow)
        await trio.sleep(1)
        with trio.move_on_after(40):
            await ex.wait(3)
        lines = [r.getMessage() for r in caplog.records if "without progress" in r.getMessage()]
        assert len(lines) == 1 and "staleness budget is spent" in lines[0] and "a version bump opens it" in lines[0], lines


async def test_rollout_stream_holds_at_most_its_window_and_hands_out_every_item_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A set too large to hold: 2,000 items, read lazily, through a window of 8. (An async
    source here: a sync iterator is read in a worker thread, which a virtual clock skips past.)"""

    async def items() -> Any:
        for i in range(2000):
            yield i

    peak = 0
    seen: list[int] = []
    async with ScriptedEngine() as engine, open_executor(engine, max_concurrent_rollouts=4) as ex:
        with trio.fail_after(DEADLINE):
            async with ex.rollout_stream(items(), workflow, is_eval=True, window=8) as outcomes:
                async for outcome in outcomes:
                    s = ex.statistics()
                    peak = max(peak, s.queued + s.running + s.buffered + 1)
                    assert outcome.status == "accepted" and isinstance(outcome.trajectory, Trajectory)
                    seen.append(outcome.data)
        assert sorted(seen) == list(range(2000))
        assert peak <= 8
        assert ex.statistics().balanced()


async def test_a_training_stream_waits_for_version_bumps_and_leaving_early_cancels_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2) as ex:
        got = 0
        with trio.fail_after(DEADLINE):
            async with ex.rollout_stream(range(100), workflow) as outcomes:
                async for outcome in outcomes:
                    assert outcome.status == "accepted"
                    got += 1
                    if got % 2 == 0:
                        ex.set_version(got // 2)  # the trainer steps between outcomes
                    if got == 10:
                        break
        s = ex.statistics()
        assert got == 10 and s.queued == 0 and s.running == 0 and s.balanced(), s


async def test_drop_stale_false_keeps_old_results_as_areal_does(autojump_clock: trio.testing.MockClock) -> None:
    """AReaL's rule as an option: admission by budget only, nothing dropped after."""
    for drop in (True, False):
        async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=0, drop_stale=drop) as ex:
            ex.submit(0, workflow)
            while ex.statistics().buffered < 1:
                await trio.sleep(1)
            ex.set_version(2)
            got = await ex.wait(1, timeout=10, raise_timeout=False)
            s = ex.statistics()
            if drop:
                assert got == [] and s.stale == 1 and s.stale_tokens == 2
            else:
                assert len(got) == 1 and s.stale == 0


async def test_a_stalled_call_shows_in_the_metrics_and_top_until_it_progresses(autojump_clock: trio.testing.MockClock) -> None:
    from prometheus_client import generate_latest

    from rollout_trio.observe import ExecutorMetrics
    from rollout_trio.observe._snapshot import snapshot_from_text

    metrics = ExecutorMetrics()

    def stalled() -> Any:
        return dict(snapshot_from_text(generate_latest(metrics.registry).decode(), "test")["counts"])["stalled calls"]

    async with ScriptedEngine() as engine, open_executor(engine, stall_warning_s=10.0, observers=[metrics]) as ex:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.wait, 1)
            await trio.sleep(11)
            assert stalled() == 1
            ex.submit(0, workflow)
            await trio.testing.wait_all_tasks_blocked()
        assert stalled() == 0
