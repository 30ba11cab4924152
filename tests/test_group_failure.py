"""A failing slot cancels its siblings and their generations; cases 20-23 of spec/group.md."""

import logging

import pytest
import trio
import trio.testing

from rollout_trio import (
    GenerationConfig,
    GroupedRolloutWorkflow,
    GroupRolloutError,
    ModelRequest,
    RolloutError,
    run_group,
    workflow_context,
)
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder

from .group_helpers import I, scripted, traj


class Probe:
    """A workflow whose slot 0 fails once slot 1 is blocked in the engine."""

    def __init__(self, exc=None):
        self.exc = exc or ValueError("candidate failed")
        self.cleanup_ran = []
        self.finalized = []
        self.sibling_cancelled = None
        self.in_engine = trio.Event()

    async def arun_episode(self, engine, data):
        i = workflow_context.get().sample_idx
        if i == 0:
            await self.in_engine.wait()
            raise self.exc
        try:
            self.in_engine.set()
            return await engine.agenerate(ModelRequest(input_ids=[1, 2], rid=f"slot-{i}"))
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await trio.sleep(0)  # async cleanup still runs
                self.cleanup_ran.append(i)
            self.sibling_cancelled = True
            raise

    async def _afinalize_processor_cache_group(self, ctx):
        self.finalized.append((ctx.group_size, ctx.sample_idx, self.sibling_cancelled))


async def test_case_20_child_error_cancels_siblings_and_aborts_their_requests():
    wf = Probe()
    engine = ScriptedEngine(delay=float("inf"))
    rec = StatsRecorder()
    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="candidate failed")) as info:
        await GroupedRolloutWorkflow(wf, 3, stats=rec).arun_episode(engine, {})
    (leaf,) = info.value.exceptions
    assert leaf is wf.exc  # the same object, inside a strict group
    assert "slot 0 of a group of 3" in leaf.__notes__[0]
    assert sorted(wf.cleanup_ran) == [1, 2]
    assert sorted(engine.aborted) == ["slot-1", "slot-2"] and engine.completed == [] and not engine.in_flight
    assert wf.finalized == [(3, None, True)]  # once, after the cancellation, with the group context
    assert rec.summaries() == {}  # a failed group records no statistics


async def test_several_failures_are_all_reported_with_their_slots():
    async def wf(engine, data):
        i = workflow_context.get().sample_idx
        raise KeyError(f"slot {i}")

    with pytest.RaisesGroup(KeyError, KeyError) as info:
        await run_group(wf, ScriptedEngine(), {}, 2, stats=StatsRecorder())
    notes = sorted(e.__notes__[0] for e in info.value.exceptions)
    assert "slot 0" in notes[0] and "slot 1" in notes[1]


async def test_case_21_parent_cancel_propagates_as_cancellation():
    wf = Probe()
    engine = ScriptedEngine(delay=float("inf"))

    async def slot0_blocks(engine, data):
        return await engine.agenerate(ModelRequest(input_ids=[1], rid=f"r{workflow_context.get().sample_idx}"))

    wf.arun_episode = slot0_blocks
    group = GroupedRolloutWorkflow(wf, 3, stats=StatsRecorder())
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(group.arun_episode, engine, {})
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    assert sorted(engine.aborted) == ["r0", "r1", "r2"] and not engine.in_flight
    assert len(wf.finalized) == 1


async def test_case_21_child_cancel_is_not_a_failure_of_the_siblings():
    """A slot that raises Cancelled from an outer scope propagates cancellation, nothing else."""
    engine = ScriptedEngine(delay=float("inf"))

    async def wf(engine, data):
        return await engine.agenerate(ModelRequest(input_ids=[1]))

    with trio.move_on_after(0.05) as scope:
        await run_group(wf, engine, {}, 2, stats=StatsRecorder())
    assert scope.cancelled_caught and len(engine.aborted) == 2


async def test_case_22_metrics_hook_runs_before_the_error_propagates():
    calls = []

    class WF:
        async def arun_episode(self, engine, data):
            if workflow_context.get().sample_idx == 0:
                return {"completion": I(0.75)}
            await trio.sleep(0.01)
            raise ValueError("failed slot")

        def record_group_metrics(self, data, rewards, group_size):
            calls.append((rewards, group_size))

    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="failed slot")):
        await run_group(WF(), ScriptedEngine(), {}, 2, stats=StatsRecorder())
    assert calls == [([0.75, None], 2)]


async def test_case_23_metrics_hook_sees_rewards_before_normalization():
    calls = []
    a, b = I(0.0), I(1.0)

    class WF:
        async def arun_episode(self, engine, data):
            return [{"a": a}, {"b": b}][workflow_context.get().sample_idx]

        def record_group_metrics(self, data, rewards, group_size):
            calls.append(list(rewards))

    await run_group(WF(), ScriptedEngine(), {}, 2, reward_normalization=True, stats=StatsRecorder())
    assert calls == [[0.0, 1.0]]
    assert (a.reward, b.reward) == pytest.approx((-1.0, 1.0))


async def test_finalizer_runs_once_on_success_and_its_errors_are_logged(caplog):
    calls = []

    async def hook(ctx):
        calls.append(ctx.group_size)
        raise OSError("disk gone")

    with caplog.at_level(logging.WARNING, logger="rollout_trio.group"):
        out = await run_group(scripted([traj(1), traj(2)]), ScriptedEngine(), {}, 2, finalize_hook=hook, stats=StatsRecorder())
    assert out.batch_size == 2 and calls == [2]
    assert "Failed to finalize rollout group resources (OSError: disk gone)." in caplog.text


async def test_a_hanging_finalizer_is_abandoned_at_its_deadline(autojump_clock, caplog):
    async def hook(ctx):
        await trio.sleep_forever()

    with caplog.at_level(logging.WARNING, logger="rollout_trio.group"):
        out = await run_group(scripted([traj(1)]), ScriptedEngine(), {}, 1, finalize_hook=hook, finalize_timeout=5.0, stats=StatsRecorder())
    assert out.batch_size == 1
    assert "timed out after 5.0 s" in caplog.text


async def test_finalizer_runs_even_when_the_group_is_cancelled(autojump_clock):
    done = []

    async def hook(ctx):
        await trio.sleep(1)  # shielded: the cancellation does not cut it short
        done.append(ctx.group_size)

    async def wf(engine, data):
        await trio.sleep_forever()

    with trio.move_on_after(2):
        await run_group(wf, ScriptedEngine(), {}, 3, finalize_hook=hook, stats=StatsRecorder())
    assert done == [3]


async def test_groups_use_the_engine_through_requests_with_sampling_settings():
    seen = []

    async def wf(engine, data):
        resp = await engine.agenerate(ModelRequest(input_ids=[5], gconfig=GenerationConfig(max_new_tokens=2)))
        seen.append(resp.output_tokens)
        return traj(resp.output_tokens[0])

    out = await run_group(wf, ScriptedEngine(), {}, 3, stats=StatsRecorder())
    assert seen == [(6, 7)] * 3 and out.input_ids.tolist() == [[6], [6], [6]]


# -- GroupRolloutError: a strict exception group that knows its group ---------------------


async def test_slot_failures_raise_a_group_rollout_error_with_the_failing_slots():
    results = [traj(1), KeyError("a"), traj(3), ValueError("b")]
    with pytest.raises(GroupRolloutError) as info:
        await run_group(scripted(results), ScriptedEngine(), {}, 4, stats=StatsRecorder())
    err = info.value
    assert isinstance(err, ExceptionGroup) and isinstance(err, RolloutError)
    assert err.group_size == 4
    assert sorted(zip(err.slots, map(type, err.exceptions)), key=lambda p: p[0]) == [(1, KeyError), (3, ValueError)]
    for slot, exc in zip(err.slots, err.exceptions):
        assert f"rollout_trio: raised in slot {slot} of a group of 4" in exc.__notes__


async def test_except_star_splits_a_group_rollout_error_keeping_slots_and_size():
    results = [ValueError("v"), traj(2), ExceptionGroup("inner", [KeyError("k"), ValueError("w")])]
    caught = {}
    try:
        await run_group(scripted(results), ScriptedEngine(), {}, 3, stats=StatsRecorder())
    except* KeyError as eg:
        caught["key"] = eg
    except* ValueError as eg:
        caught["value"] = eg
    assert type(caught["key"]) is GroupRolloutError and type(caught["value"]) is GroupRolloutError
    assert (caught["key"].slots, caught["key"].group_size) == ((2,), 3)
    assert sorted(caught["value"].slots) == [0, 2]
    with pytest.RaisesGroup(ValueError, pytest.RaisesGroup(KeyError, ValueError)):
        await run_group(scripted(results), ScriptedEngine(), {}, 3, stats=StatsRecorder())
