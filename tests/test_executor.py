"""The executor on the scripted engine: spec/executor.md §4 and the §15 "Executor" cases (55-72)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
import trio.testing

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, WorkflowContractError, workflow_context
from rollout_trio.executor import ExecutorFailed, RolloutConfig, TaskOutcome, open_executor
from rollout_trio.testing import ScriptedEngine

from .group_helpers import I

GC = GenerationConfig(max_new_tokens=2)


async def gen_workflow(engine: Any, data: Any) -> Trajectory:
    """One generation; reward = data["reward"] (default 1.0)."""
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GC))
    return Trajectory.from_response(resp, data.get("reward", 1.0) if isinstance(data, dict) else 1.0)


def ex_of(engine: Any, **options: Any) -> Any:
    """An executor with a generous staleness budget (tests of the budget set it themselves)."""
    options.setdefault("max_head_offpolicyness", 1000)
    return open_executor(engine, **options)


def balanced(ex: Any) -> None:
    s = ex.statistics()
    assert s.balanced(), s


async def test_55_wait_count_must_be_positive() -> None:
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        with pytest.raises(ValueError, match="count must be positive, got 0"):
            await ex.wait(0)
        with pytest.raises(ValueError, match="count must be <= queue_size"):
            await ex.wait(17)


async def test_56_wait_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine(delay=100) as engine, ex_of(engine) as ex:
        ex.submit({}, gen_workflow)
        with pytest.raises(TimeoutError, match="Timed out waiting for 2 results, only received 0"):
            await ex.wait(2, timeout=0.1)
        assert await ex.wait(2, timeout=0.1, raise_timeout=False) == []
        balanced(ex)


async def test_57_wait_for_task_unknown_or_consumed() -> None:
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        with pytest.raises(ValueError, match="Task 99 is never submitted."):
            await ex.wait_for_task(99)
        ex.submit({}, gen_workflow)
        (traj,) = await ex.wait(1)
        assert isinstance(traj, Trajectory)
        with pytest.raises(ValueError, match="Task 0: its result was already taken"):
            await ex.wait_for_task(0)


async def test_58_auto_ids_and_duplicates() -> None:
    async with ScriptedEngine(delay=1) as engine, ex_of(engine, max_concurrent_rollouts=4) as ex:
        assert [ex.submit({}, gen_workflow) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="Duplicate task_id: 1"):
            ex.submit({}, gen_workflow, task_id=1)
        assert ex.submit({}, gen_workflow, task_id=3) == 3
        assert ex.submit({}, gen_workflow) == 4  # generated ids skip used ones
        balanced(ex)


async def test_59_none_is_rejected_and_wait_for_task_returns_none() -> None:
    async def none_wf(engine: Any, data: Any) -> None:
        return None

    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        tid = ex.submit({}, none_wf)
        assert await ex.wait_for_task(tid) is None
        s = ex.statistics()
        assert (s.rejected, s.rejected_by_reason, s.running, s.accepted) == (1, {"returned_none": 1}, 0, 0)
        ex.submit({}, lambda_empty)
        ex.submit({}, gen_workflow)
        assert len(await ex.wait(1)) == 1
        assert ex.statistics().rejected_by_reason == {"returned_none": 1, "empty_result": 1}
        balanced(ex)


async def lambda_empty(engine: Any, data: Any) -> dict[str, Any]:
    return {}


async def test_60_workflow_error_is_failed_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def boom(engine: Any, data: Any) -> None:
        raise RuntimeError("bad luck")

    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        tid = ex.submit({}, boom)
        assert await ex.wait_for_task(tid) is None
        s = ex.statistics()
        assert (s.failed, s.failed_by_reason) == (1, {"workflow_exception": 1})
        assert "bad luck" in caplog.text  # logged with its traceback, never silently
        balanced(ex)


async def test_on_workflow_error_raise_stops_the_executor() -> None:
    async def boom(engine: Any, data: Any) -> None:
        raise RuntimeError("bad luck")

    async with ScriptedEngine() as engine:
        with pytest.raises(ExecutorFailed) as info:
            async with ex_of(engine, on_workflow_error="raise") as ex:
                ex.submit({}, boom)
                await ex.wait(1)
        assert isinstance(info.value.__cause__, RuntimeError)


async def test_61_should_accept_fn_rejects() -> None:
    outcomes: list[TaskOutcome] = []
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        tid = ex.submit({}, gen_workflow, should_accept_fn=lambda t: False, callback=outcomes.append)
        assert await ex.wait_for_task(tid) is None
        assert ex.statistics().rejected_by_reason == {"should_accept_fn": 1}
    assert [(o.task_id, o.status, o.reason) for o in outcomes] == [(tid, "rejected", "should_accept_fn")]
    assert isinstance(outcomes[0].trajectory, Trajectory)


async def test_62_interaction_dict_becomes_rows() -> None:
    async def inter(engine: Any, data: Any) -> dict[str, Any]:
        a = I(1.0)
        b = I(1.0)
        b.cache = Trajectory(
            input_ids=torch.tensor([[1, 2, 3]]),
            attention_mask=torch.ones(1, 3, dtype=torch.bool),
            loss_mask=torch.tensor([[0, 1, 1]]),
            rewards=torch.tensor([1.0]),
        )
        return {"a": a, "b": b}

    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        ex.submit({}, inter)
        (traj,) = await ex.wait(1)
    assert isinstance(traj, Trajectory)
    assert traj.input_ids.shape == (2, 3)
    assert traj.attention_mask[0].tolist() == [True, True, False]


@pytest.mark.parametrize(
    "result",
    [
        {"input_ids": torch.tensor([1, 2]), "attention_mask": torch.tensor([True, True])},  # case 63: 1-D
        42,
    ],
)
async def test_63_contract_errors_stop_the_executor(result: Any) -> None:
    """DESIGN overrides case 63: a result breaking the contract stops the executor."""
    engine = ScriptedEngine(delay=1000)
    slow_done = trio.Event()

    async def bad(engine: Any, data: Any) -> Any:
        if data == "slow":
            try:
                return await gen_workflow(engine, {})
            finally:
                slow_done.set()
        return result

    with pytest.raises(ExecutorFailed) as info:
        async with engine, ex_of(engine, max_concurrent_rollouts=2) as ex:
            ex.submit("slow", bad)
            ex.submit("bad", bad)
            await ex.wait(1)
    assert isinstance(info.value.__cause__, WorkflowContractError)
    assert slow_done.is_set() and engine.aborted  # the sibling task was cancelled, its generation aborted
    with pytest.raises(ExecutorFailed):
        ex.submit("x", bad)  # every later call raises
    s = ex.statistics()
    assert (s.failed_by_reason, s.cancelled) == ({"contract_error": 1}, 1)
    assert s.balanced()


async def test_contract_error_inside_a_group_stops_the_executor() -> None:
    async def mixed(engine: Any, data: Any) -> Any:
        if workflow_context.get().sample_idx == 0:
            return {"a": I(1.0)}
        return await gen_workflow(engine, {})

    async with ScriptedEngine() as engine:
        with pytest.raises(ExecutorFailed) as info:
            async with ex_of(engine) as ex:
                ex.submit({}, mixed, group_size=2)
                await ex.wait(1)
    assert isinstance(info.value.__cause__, WorkflowContractError)


async def test_contract_error_seen_only_at_exit_raises_there() -> None:
    returned = trio.Event()

    async def bad(engine: Any, data: Any) -> Any:
        returned.set()
        return 42

    async with ScriptedEngine() as engine:
        with pytest.raises(ExecutorFailed):
            async with ex_of(engine) as ex:
                ex.submit({}, bad)
                await returned.wait()
                await trio.testing.wait_all_tasks_blocked()  # the executor has judged the result; no call sees it


async def test_64_check_trajectory_format_tracks_keys() -> None:
    async def wf(engine: Any, data: Any) -> dict[str, Any]:
        d = {"input_ids": torch.tensor([[1]]), "attention_mask": torch.tensor([[True]])}
        if data:
            d["rewards"] = torch.tensor([1.0])
        return d

    async with ScriptedEngine() as engine:
        with pytest.raises(ExecutorFailed, match="rewards"):
            async with ex_of(engine, check_trajectory_format=True) as ex:
                await ex.wait_for_task(ex.submit(True, wf))
                await ex.wait_for_task(ex.submit(False, wf))


async def test_65_deterministic_sampling_orders_by_task_id(autojump_clock: trio.testing.MockClock) -> None:
    async def wf(engine: Any, data: int) -> Trajectory:
        await trio.sleep(5 - data)  # finish in reverse order
        return Trajectory.from_dict({"input_ids": torch.tensor([[data]]), "attention_mask": torch.tensor([[True]])})

    async with ScriptedEngine() as engine:
        async with ex_of(engine, max_concurrent_rollouts=5, deterministic_sampling=True) as ex:
            for k in range(5):
                ex.submit(k, wf)
            got = await ex.wait(5)
            assert [int(t.input_ids[0, 0]) for t in got] == [0, 1, 2, 3, 4]
        async with ex_of(engine, max_concurrent_rollouts=5, max_head_offpolicyness=4) as ex:
            for k in range(5):
                ex.submit(k, wf, task_id=10 + k)
            got = await ex.wait(5)
            assert sorted(int(t.input_ids[0, 0]) for t in got) == [0, 1, 2, 3, 4]


async def test_66_prepare_batch_queue_too_small() -> None:
    async with ScriptedEngine() as engine, ex_of(engine, queue_size=2) as ex:
        with pytest.raises(ValueError, match="queue size is too small: 2 < batch size 4"):
            await ex.prepare_batch([{}], gen_workflow, batch_size=4)


async def test_67_prepare_batch_fixed_and_dynamic() -> None:
    async def odd_rejected(engine: Any, data: int) -> Trajectory | None:
        if workflow_context.get().task_id % 2:  # type: ignore[operator]
            return None
        return await gen_workflow(engine, {"reward": float(data)})

    async with ScriptedEngine() as engine:
        async with ex_of(engine, consumer_batch_size=4, max_head_offpolicyness=8) as ex:
            batch = await ex.prepare_batch(range(10), odd_rejected, batch_size=4)
            assert len(batch) == 4 and all(isinstance(t, Trajectory) for t in batch)
            balanced(ex)
        async with ex_of(engine, consumer_batch_size=4, max_head_offpolicyness=8) as ex:
            batch = await ex.prepare_batch(range(10), odd_rejected, batch_size=4, dynamic_bs=True)
            assert len(batch) == 2  # the accepted half of the first 4 finished tasks
            balanced(ex)


async def test_68_prepare_batch_refuses_another_workflow_or_source() -> None:
    source = [{}, {}]
    async with ScriptedEngine() as engine, ex_of(engine, max_head_offpolicyness=4) as ex:
        await ex.prepare_batch(source, gen_workflow, batch_size=1)
        with pytest.raises(ValueError, match="another data source or workflow"):
            await ex.prepare_batch(source, lambda_empty, batch_size=1)
        with pytest.raises(ValueError, match="another data source or workflow"):
            await ex.prepare_batch([{}], gen_workflow, batch_size=1)
        assert len(await ex.prepare_batch(source, gen_workflow, batch_size=1)) == 1


async def test_prepare_batch_empty_source_raises() -> None:
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        with pytest.raises(ValueError, match="yielded nothing in a full pass"):
            await ex.prepare_batch([], gen_workflow, batch_size=1)


async def test_prepare_batch_async_source_and_cycling() -> None:
    seen: list[int] = []

    class Source:
        def __aiter__(self) -> Any:
            return self._gen()

        async def _gen(self) -> Any:
            for k in range(3):
                yield k

    async def wf(engine: Any, data: int) -> Trajectory:
        seen.append(data)
        return await gen_workflow(engine, {})

    src = Source()
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2) as ex:
        for v in range(4):
            assert len(await ex.prepare_batch(src, wf, batch_size=2)) == 2
            ex.set_version(v + 1)
    assert len(seen) >= 8 and all(seen.count(k) >= 2 for k in range(3))  # cycled past the end


async def test_69_pause_holds_new_work_and_resume_releases(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        await ex.pause()
        tid = ex.submit({}, gen_workflow)
        with pytest.raises(TimeoutError):
            await ex.wait(1, timeout=1)
        assert ex.statistics().queued == 1 and not engine.requests
        await ex.resume()
        assert isinstance(await ex.wait_for_task(tid), Trajectory)


async def test_pause_interrupts_in_flight_and_delivers_finished(autojump_clock: trio.testing.MockClock) -> None:
    release = trio.Event()

    async def wf(engine: Any, data: str) -> Trajectory:
        await release.wait()
        if data == "local":  # finishes while paused, without the engine
            return Trajectory.from_dict({"input_ids": torch.tensor([[1]]), "attention_mask": torch.tensor([[True]])})
        return await gen_workflow(engine, {})

    async with ScriptedEngine(delay=1) as engine, ex_of(engine, max_concurrent_rollouts=2) as ex:
        gen_tid = ex.submit("gen", wf)
        local_tid = ex.submit("local", wf)
        while ex.statistics().running < 2:
            await trio.sleep(0.1)
        await ex.pause()
        release.set()
        assert isinstance(await ex.wait_for_task(local_tid), Trajectory)  # delivered while paused
        with pytest.raises(TimeoutError):
            await ex.wait_for_task(gen_tid, timeout=10)  # the engine's pause holds the generation
        await ex.resume()
        assert isinstance(await ex.wait_for_task(gen_tid), Trajectory)


async def test_70_pause_does_not_survive_a_new_executor() -> None:
    async with ScriptedEngine() as engine:
        async with ex_of(engine) as ex:
            await ex.pause()
            assert ex.paused
        await engine.resume()
        async with ex_of(engine) as ex:
            assert not ex.paused


async def test_71_closed_executor_refuses_calls() -> None:
    async with ScriptedEngine() as engine:
        async with ex_of(engine) as ex:
            pass
        with pytest.raises(RuntimeError, match="closed"):
            ex.submit({}, gen_workflow)


async def test_72_workflow_context() -> None:
    seen: list[tuple[Any, str]] = []

    async def wf(engine: Any, data: Any) -> None:
        seen.append((workflow_context.get(), workflow_context.stat_scope()))

    async with ScriptedEngine() as engine, ex_of(engine, max_concurrent_rollouts=2) as ex:
        a = ex.submit({}, wf)
        b = ex.submit({}, wf, is_eval=True)
        await ex.wait_for_task(a)
        await ex.wait_for_task(b)
    assert sorted(seen, key=lambda x: x[0].task_id) == [
        (workflow_context.WorkflowContext(task_id=a), "rollout"),
        (workflow_context.WorkflowContext(task_id=b, is_eval=True), "eval-rollout"),
    ]


async def test_staleness_gates_starts_until_a_version_bump(autojump_clock: trio.testing.MockClock) -> None:
    """§3.4 through the executor: M=8, b=4, s=1 starts 8, then nothing until V=1."""
    async with ScriptedEngine() as engine:
        async with open_executor(engine, max_concurrent_rollouts=8, consumer_batch_size=4, max_head_offpolicyness=1) as ex:
            for _ in range(20):
                ex.submit({}, gen_workflow)
            first = await ex.wait(8)
            assert len(first) == 8
            await trio.sleep(10)
            s = ex.statistics()
            assert (s.queued, s.running, s.capacity) == (12, 0, 0)
            engine.set_version(1)  # directly on the engine: the executor polls
            await ex.wait(4)
            assert ex.statistics().queued == 8
            ex.set_version(3)
            assert len(await ex.wait(8)) == 8
            balanced(ex)


async def test_on_version_recovered_prevents_a_burst() -> None:
    async with ScriptedEngine() as engine:
        engine.set_version(10)
        async with open_executor(engine, max_concurrent_rollouts=100, consumer_batch_size=4) as ex:
            assert ex.statistics().capacity == 44
            ex.on_version_recovered(10)
            assert ex.statistics().capacity == 4


async def test_dp_size_scales_the_budget() -> None:
    async with ScriptedEngine() as engine, ex_of(engine, consumer_batch_size=256, dp_size=8) as ex:
        assert (ex.staleness.max_concurrent_rollouts, ex.staleness.consumer_batch_size, ex.queue_size) == (32, 32, 4096)


async def test_buffer_never_exceeds_queue_size(autojump_clock: trio.testing.MockClock) -> None:
    """A trainer that stops consuming: the executor stops starting work; memory stays bounded."""
    async with ScriptedEngine() as engine:
        async with ex_of(engine, max_concurrent_rollouts=4, max_head_offpolicyness=1000, queue_size=6) as ex:
            for _ in range(50):
                ex.submit({}, gen_workflow)
            for _ in range(20):
                await trio.sleep(1)
                s = ex.statistics()
                assert s.buffered + s.running <= 6
            assert (s.buffered, s.running, s.queued) == (6, 0, 44)
            assert len(await ex.wait(6)) == 6
            await trio.sleep(1)
            assert ex.statistics().buffered == 6
            balanced(ex)


async def test_rollout_batch_waits_for_its_own_tasks_in_input_order() -> None:
    async def wf(engine: Any, data: int) -> Trajectory | None:
        await trio.sleep(0.01 * max(0, 5 - data))
        if data == 2:
            return None
        return Trajectory.from_dict({"input_ids": torch.tensor([[data]]), "attention_mask": torch.tensor([[True]])})

    async with ScriptedEngine() as engine, ex_of(engine, max_concurrent_rollouts=3, max_head_offpolicyness=10) as ex:
        other = ex.submit(9, wf)
        got = await ex.rollout_batch(range(5), wf, progress=False)
        assert [int(t.input_ids[0, 0]) for t in got] == [0, 1, 3, 4]
        assert int((await ex.wait_for_task(other)).input_ids[0, 0]) == 9  # not taken by rollout_batch
        balanced(ex)


async def test_rollout_batch_group_options_pass_through() -> None:
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        (traj,) = await ex.rollout_batch([{"reward": 1.0}], gen_workflow, group_size=3, progress=False)
        assert traj.batch_size == 3
        with pytest.raises(ValueError, match="reward_normalization needs group_size > 1"):
            ex.submit({}, gen_workflow, reward_normalization=True)
        stats = ex.group_statistics()
    assert stats["rollout/target_slot_count"] == 3.0


async def test_cancel_a_queued_and_a_running_task(autojump_clock: trio.testing.MockClock) -> None:
    outcomes: list[TaskOutcome] = []
    async with ScriptedEngine(delay=100) as engine, ex_of(engine) as ex:
        running = ex.submit({}, gen_workflow, callback=outcomes.append)
        queued = ex.submit({}, gen_workflow, callback=outcomes.append)
        while not engine.requests:
            await trio.sleep(0.1)
        assert ex.cancel(queued) and ex.cancel(running)
        assert await ex.wait_for_task(running) is None
        assert engine.aborted == [engine.requests[0].rid]
        assert not ex.cancel(running)
        s = ex.statistics()
        assert (s.cancelled, s.running, s.queued) == (2, 0, 0)
        assert s.capacity == 1  # the cancelled task gave its budget back
        balanced(ex)
    assert sorted(o.status for o in outcomes) == ["cancelled", "cancelled"]


async def test_episode_timeout_counts_as_failed(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine(delay=100) as engine, ex_of(engine, episode_timeout=5) as ex:
        tid = ex.submit({}, gen_workflow)
        assert await ex.wait_for_task(tid) is None
        assert ex.statistics().failed_by_reason == {"timeout": 1}
        assert len(engine.aborted) == 1


@pytest.mark.parametrize("how", ["normal", "error", "cancel"])
async def test_leaving_cancels_in_flight_work(how: str, autojump_clock: trio.testing.MockClock) -> None:
    engine = ScriptedEngine(delay=1000)
    async with engine:
        with trio.move_on_after(50) as outer:
            try:
                async with ex_of(engine, max_concurrent_rollouts=3) as ex:
                    for _ in range(5):
                        ex.submit({}, gen_workflow)
                    while len(engine.in_flight) < 3:
                        await trio.sleep(1)
                    if how == "error":
                        raise KeyError("trainer bug")
                    if how == "cancel":
                        await trio.sleep_forever()
            except KeyError:
                assert how == "error"
        assert outer.cancelled_caught == (how == "cancel")
    assert not engine.in_flight and len(engine.aborted) == 3
    s = ex.statistics()
    assert (s.cancelled, s.running, s.queued) == (5, 0, 0) and s.balanced()


async def test_body_exception_is_not_wrapped_in_a_group() -> None:
    async with ScriptedEngine() as engine:
        with pytest.raises(KeyError):
            async with ex_of(engine):
                raise KeyError("x")


async def test_callback_errors_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    def cb(outcome: TaskOutcome) -> None:
        raise RuntimeError("callback broke")

    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        tid = ex.submit({}, gen_workflow, callback=cb)
        assert isinstance(await ex.wait_for_task(tid), Trajectory)
    assert "Completion callback of task 0 failed" in caplog.text


async def test_dump_to_file_needs_every_piece() -> None:
    async with ScriptedEngine() as engine:
        with pytest.raises(ValueError, match="needs fileroot, trial_name, tokenizer"):
            async with ex_of(engine, dump_to_file=True, experiment_name="e"):
                pass


async def test_dumper_sees_accepted_and_rejected() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[int, bool, bool]] = []
            self.closed = False

        async def __aenter__(self) -> Recorder:
            return self

        async def __aexit__(self, *exc: object) -> None:
            self.closed = True

        async def dump(self, traj: Trajectory, *, task_id: int, is_eval: bool, accepted: bool = True) -> bool:
            self.calls.append((task_id, is_eval, accepted))
            return True

    rec = Recorder()
    async with ScriptedEngine() as engine, ex_of(engine, dumper=rec, max_concurrent_rollouts=2) as ex:
        a = ex.submit({}, gen_workflow)
        b = ex.submit({}, gen_workflow, should_accept_fn=lambda t: False, is_eval=True)
        await ex.wait_for_task(a)
        await ex.wait_for_task(b)
    assert sorted(rec.calls) == [(a, False, True), (b, True, False)] and rec.closed


def test_config_in_open_executor_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        RolloutConfig.coerce({"queue": 1})


async def test_dumps_through_the_executor(tmp_path: Any) -> None:
    """Accepted and should_accept_fn-rejected trajectories are dumped (with ``accepted``),
    None results are not; the dumper is flushed when the executor exits."""
    from rollout_trio.executor import read_dump
    from rollout_trio.models import byte_tokenizer

    async def wf(engine: Any, data: str) -> Trajectory | None:
        return None if data == "none" else await gen_workflow(engine, {})

    cfg = RolloutConfig(
        dump_to_file=True, fileroot=str(tmp_path), experiment_name="exp", trial_name="t1",
        max_head_offpolicyness=10, max_concurrent_rollouts=3,
    )  # fmt: skip
    async with ScriptedEngine() as engine, open_executor(engine, cfg, tokenizer=byte_tokenizer()) as ex:
        a = ex.submit("ok", wf)
        b = ex.submit("ok", wf, should_accept_fn=lambda t: False, is_eval=True)
        c = ex.submit("none", wf)
        for tid in (a, b, c):
            await ex.wait_for_task(tid)
    records = read_dump(tmp_path / "exp" / "t1")
    assert sorted((r.task_id, r.accepted, r.is_eval) for r in records) == [(a, True, False), (b, False, True)]


@pytest.mark.parametrize("name", ["../../x", "/abs/path", ""])
async def test_hostile_dump_names_fail_at_start(tmp_path: Any, name: str) -> None:
    from rollout_trio.models import byte_tokenizer

    async with ScriptedEngine() as engine:
        with pytest.raises(ValueError):
            async with open_executor(
                engine, dump_to_file=True, fileroot=str(tmp_path), experiment_name=name, trial_name="t",
                tokenizer=byte_tokenizer(),
            ):  # fmt: skip
                pass
    assert list(tmp_path.iterdir()) == []


async def test_progress_bar_only_when_asked_or_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    async with ScriptedEngine() as engine, ex_of(engine) as ex:
        await ex.rollout_batch([{}] * 3, gen_workflow)  # stderr is not a terminal here: silent
        assert capsys.readouterr().err == ""
        await ex.rollout_batch([{}] * 3, gen_workflow, progress=True)
        err = capsys.readouterr().err
        assert "task" in err and "0/3" in err, err


async def test_group_statistics_are_kept_per_scope() -> None:
    async with ScriptedEngine() as engine, ex_of(engine, max_concurrent_rollouts=2) as ex:
        await ex.rollout_batch([{}], gen_workflow, group_size=2, progress=False)
        await ex.rollout_batch([{}], gen_workflow, group_size=3, is_eval=True, progress=False)
        stats = ex.group_statistics()
    assert stats["rollout/target_slot_count"] == 2.0
    assert stats["eval-rollout/target_slot_count"] == 3.0


async def test_an_abandoned_rollout_batch_loses_no_accepted_trajectory(autojump_clock: trio.testing.MockClock) -> None:
    async def wf(engine: Any, data: int) -> Trajectory:
        await trio.sleep(data)
        return Trajectory.from_dict({"input_ids": torch.tensor([[data]]), "attention_mask": torch.tensor([[True]])})

    async with ScriptedEngine() as engine, ex_of(engine, max_concurrent_rollouts=4) as ex:
        with trio.move_on_after(5):
            await ex.rollout_batch([1, 2, 100, 200], wf, progress=False)
        await trio.testing.wait_all_tasks_blocked()  # the cancelled tasks unwind
        s = ex.statistics()
        assert (s.buffered, s.cancelled, s.running) == (2, 2, 0) and s.balanced()  # the slow two were cancelled
        assert sorted(int(t.input_ids[0, 0]) for t in await ex.wait(2)) == [1, 2]


async def test_an_abandoned_prepare_batch_hands_its_trajectories_to_the_next_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def wf(engine: Any, data: int) -> Trajectory:
        await trio.sleep(data)
        return Trajectory.from_dict({"input_ids": torch.tensor([[data]]), "attention_mask": torch.tensor([[True]])})

    source = [1, 1000, 1000]
    async with ScriptedEngine() as engine, open_executor(engine, max_concurrent_rollouts=3, consumer_batch_size=3) as ex:
        with trio.move_on_after(10):
            await ex.prepare_batch(source, wf, batch_size=3)
        assert ex.statistics().buffered == 1 and ex.statistics().balanced()
        batch = await ex.prepare_batch(source, wf, batch_size=3)
        assert [int(t.input_ids[0, 0]) for t in batch] == [1, 1000, 1000]  # the one taken before is first


async def test_a_source_that_outruns_the_trainer_waits(autojump_clock: trio.testing.MockClock) -> None:
    """prepare_batch pulls items lazily: a trainer that stops asking stops the reading."""
    pulled = 0

    def endless() -> Any:
        nonlocal pulled
        while True:
            pulled += 1
            yield {}

    source = endless()
    async with ScriptedEngine() as engine, open_executor(
        engine, consumer_batch_size=2, max_concurrent_rollouts=8, max_head_offpolicyness=1
    ) as ex:
        assert len(await ex.prepare_batch(source, gen_workflow, batch_size=2)) == 2
        await trio.sleep(1000)
        assert pulled <= 2 + ex.staleness.get_pending_limit()
        s = ex.statistics()
        assert s.buffered + s.running + s.queued + s.accepted == pulled


async def test_data_loader_style_source_batches_and_epochs() -> None:
    """A source with ``batch_size`` yields batches; its sampler hears each new epoch."""

    class Sampler:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    class Loader:
        batch_size = 2

        def __init__(self) -> None:
            self.sampler = Sampler()

        def __iter__(self) -> Any:
            return iter([[{}, {}], [{}, {}]])

    loader = Loader()
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2) as ex:
        for step in range(4):
            assert len(await ex.prepare_batch(loader, gen_workflow)) == 2
            ex.set_version(step + 1)
    assert loader.sampler.epochs[:1] == [1]


async def test_oldest_buffered_version(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, ex_of(engine, max_concurrent_rollouts=4) as ex:
        for _ in range(2):
            ex.submit({}, gen_workflow)
        while ex.statistics().buffered < 2:
            await trio.sleep(1)
        ex.set_version(1)
        ex.submit({}, gen_workflow)
        while ex.statistics().buffered < 3:
            await trio.sleep(1)
        assert ex.statistics().oldest_buffered_version == 0
        await ex.wait(2)
        assert ex.statistics().oldest_buffered_version == 1
        await ex.wait(1)
        assert ex.statistics().oldest_buffered_version is None
