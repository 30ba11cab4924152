"""The executor's one store of finished tasks (issue 17 items 1-5, 7, 9-11; issue 16's pause
and set_version items): every call takes its own results in one step, or nothing."""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import pytest
import torch
import trio
import trio.testing

from rollout_trio import ModelRequest, Trajectory, VersionMismatchError, workflow_context
from rollout_trio.executor import open_executor
from rollout_trio.testing import ScriptedEngine

from .test_executor import gen_workflow


def marked(value: int) -> Trajectory:
    return Trajectory.from_dict({"input_ids": torch.tensor([[value]]), "attention_mask": torch.tensor([[True]])})


def mark(traj: Any) -> int:
    return int(traj.input_ids[0, 0])


async def sleepy(engine: Any, data: int) -> Trajectory:
    """Sleeps ``data`` seconds and returns a trajectory marked with ``data``."""
    await trio.sleep(data)
    return marked(data)


# -- item 1: eval is not limited by the training budget; impossible calls raise at once -----


async def test_a_training_rollout_batch_the_budget_can_never_start_raises_at_once() -> None:
    async with ScriptedEngine() as engine, open_executor(engine) as ex:  # b=1, s=0: one start per version
        with trio.fail_after(5), pytest.raises(ValueError, match=r"3 training tasks .* budget allows 1 = \(max_head_offpolicyness 0 \+ version 0 \+ 1\) \* consumer_batch_size 1"):
            await ex.rollout_batch([{}, {}, {}], gen_workflow, progress=False)
        s = ex.statistics()
        assert s.submitted == 0 and s.balanced()  # nothing was queued
        assert len(await ex.rollout_batch([{}], gen_workflow, progress=False)) == 1


@pytest.mark.parametrize(("config", "batch"), [({"consumer_batch_size": 2, "max_head_offpolicyness": 1}, 5),
                                               ({"consumer_batch_size": 4, "dp_size": 2}, 3)])  # fmt: skip
async def test_a_prepare_batch_larger_than_the_budget_raises_at_once(config: dict[str, int], batch: int) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, **config) as ex:
        with trio.fail_after(5), pytest.raises(ValueError, match=rf"batch_size {batch} can never be filled"):
            await ex.prepare_batch(range(10), gen_workflow, batch_size=batch, progress=False)


async def test_a_trainer_that_never_bumps_is_told_instead_of_hanging() -> None:
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2, max_head_offpolicyness=1) as ex:
        for _ in range(2):
            assert len(await ex.prepare_batch(range(10), gen_workflow, batch_size=2, progress=False)) == 2
        with trio.fail_after(5), pytest.raises(ValueError, match=r"accepted 4 - running 0"):
            await ex.prepare_batch(range(10), gen_workflow, batch_size=2, progress=False)
        ex.set_version(1)
        assert len(await ex.prepare_batch(range(10), gen_workflow, batch_size=2, progress=False)) == 2


async def test_eval_tasks_do_not_use_the_training_budget(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2) as ex:
        # A training step takes the whole budget of version 0 (b=2, s=0).
        assert len(await ex.prepare_batch(range(10), gen_workflow, batch_size=2, progress=False)) == 2
        assert ex.statistics().capacity <= 0
        with trio.fail_after(100):
            got = await ex.rollout_batch([{}] * 5, gen_workflow, is_eval=True, progress=False)
        assert len(got) == 5
        assert ex.statistics().capacity <= 0  # and gave none back nor took any


# -- item 2: an abandoned eval batch never becomes training data ----------------------------


async def test_an_abandoned_eval_batch_leaks_nothing_into_wait(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_concurrent_rollouts=4, max_head_offpolicyness=10) as ex:
        with trio.move_on_after(5):
            await ex.rollout_batch([1, 100], sleepy, is_eval=True, progress=False)
        ex.submit(7, sleepy)
        assert [mark(t) for t in await ex.wait(1)] == [7]
        s = ex.statistics()
        assert (s.discarded, s.cancelled, s.buffered) == (1, 1, 0) and s.balanced()


# -- item 3: an iterable that raises queues nothing ------------------------------------------


async def test_a_rollout_batch_iterable_that_raises_part_way_queues_nothing() -> None:
    def items() -> Any:
        yield {}
        yield {}
        raise KeyError("broken dataset")

    async with ScriptedEngine() as engine, open_executor(engine, queue_size=2, max_head_offpolicyness=10) as ex:
        with pytest.raises(KeyError):
            await ex.rollout_batch(items(), gen_workflow, progress=False)
        s = ex.statistics()
        assert (s.submitted, s.buffered, s.queued) == (0, 0, 0)
        with trio.fail_after(10):
            for _ in range(3):  # the queue is not clogged: tasks still start
                assert await ex.wait_for_task(ex.submit({}, gen_workflow)) is not None


# -- item 4: a cancelled wait takes nothing; leftovers are visible ----------------------------


async def test_wait_for_task_cancelled_as_its_task_finishes_orphans_nothing() -> None:
    scope = trio.CancelScope()

    async def finishes_and_cancels_the_waiter(engine: Any, data: Any) -> Trajectory:
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # the waiter is cancelled in the very step its task finishes
        return marked(5)

    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        tid = ex.submit({}, finishes_and_cancels_the_waiter)
        with scope:
            await ex.wait_for_task(tid)
        assert scope.cancelled_caught
        assert ex.statistics().buffered == 1
        with trio.fail_after(5):
            assert [mark(t) for t in await ex.wait(1)] == [5]
        assert ex.statistics().balanced()


async def test_leftover_prepare_batch_results_have_an_oldest_version(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=1) as ex:
        await ex.prepare_batch([1, 1, 1, 1], sleepy, batch_size=2, progress=False)
        await trio.sleep(5)  # the other two finish
        s = ex.statistics()
        assert s.buffered == 2 and s.oldest_buffered_version == 0


# -- item 5: start order, and the same batches whatever the scheduling -----------------------


async def test_prepare_batch_hands_out_in_start_order(autojump_clock: trio.testing.MockClock) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=4) as ex:
        got = await ex.prepare_batch([4, 3, 2, 1], sleepy, batch_size=4, progress=False)  # finish in reverse
        assert [mark(t) for t in got] == [4, 3, 2, 1]


async def batches(seed: int, concurrency: int, *, deterministic: bool) -> list[list[int]]:
    """Three prepare_batch batches of task ids, with random per-task durations drawn from ``seed``."""
    durations = random.Random(seed)

    async def wf(engine: Any, data: int) -> Trajectory | None:
        await trio.sleep(durations.random())
        tid = workflow_context.get().task_id
        return None if tid % 5 == 3 else marked(tid)  # some rejections, the same in every run

    out = []
    config = {"consumer_batch_size": 4, "max_concurrent_rollouts": concurrency, "max_head_offpolicyness": 1,
              "deterministic_sampling": deterministic}  # fmt: skip
    async with ScriptedEngine() as engine, open_executor(engine, **config) as ex:
        for step in range(3):
            out.append([mark(t) for t in await ex.prepare_batch(range(100), wf, batch_size=4, progress=False)])
            ex.set_version(step + 1)
    return out


async def test_deterministic_prepare_batch_is_the_same_whatever_the_scheduling(autojump_clock: trio.testing.MockClock) -> None:
    runs = [await batches(seed, conc, deterministic=True) for seed, conc in ((0, 8), (1, 8), (2, 3), (3, 1))]
    assert all(run == runs[0] for run in runs), runs
    assert runs[0][0] == [0, 1, 2, 4]  # the source's order, rejected task 3 skipped
    loose = [await batches(seed, 8, deterministic=False) for seed in range(4)]
    assert any(run != loose[0] for run in loose)  # without it, scheduling decides (the test can tell)


async def test_use_seed_makes_prepare_batch_reproducible_on_local_engine() -> None:
    from rollout_trio import GenerationConfig
    from rollout_trio.engines import LocalEngine
    from rollout_trio.models import tiny_model
    from rollout_trio.workflows import arithmetic_prompts, arithmetic_reward, rlvr_workflow

    model, tok = tiny_model(seed=0)
    wf = rlvr_workflow(tok, arithmetic_reward, GenerationConfig(max_new_tokens=5, temperature=1.0))

    async def run(concurrency: int, engine_seed: int) -> list[list[int]]:
        out = []
        async with LocalEngine(model, tok, seed=engine_seed) as engine:
            cfg = {"consumer_batch_size": 4, "max_concurrent_rollouts": concurrency, "max_head_offpolicyness": 1}
            async with open_executor(engine, **cfg) as ex:
                with workflow_context.use_seed(7):
                    for step in range(2):
                        batch = await ex.prepare_batch(arithmetic_prompts(16), wf, batch_size=4, progress=False)
                        out.extend(t.input_ids[0][t.attention_mask[0]].tolist() for t in batch)
                        ex.set_version(step + 1)
        return out

    with trio.fail_after(90):
        first = await run(8, engine_seed=1)
        assert first == await run(1, engine_seed=2)  # other scheduling, other engine seed: same tokens


# -- item 7: a bad reward value rejects its task ----------------------------------------------


@pytest.mark.parametrize("reward", [math.nan, math.inf, "0.5"])
async def test_a_bad_reward_rejects_the_task_not_the_executor(reward: Any) -> None:
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        assert await ex.wait_for_task(ex.submit({"reward": reward}, gen_workflow)) is None
        assert await ex.wait_for_task(ex.submit({"reward": math.nan}, gen_workflow, group_size=2)) is None
        assert await ex.wait_for_task(ex.submit({"reward": 1.0}, gen_workflow)) is not None  # it goes on
        s = ex.statistics()
        assert s.rejected_by_reason == {"invalid_reward": 2} and s.balanced()


async def test_a_nan_rewards_tensor_rejects_too() -> None:
    async def nan_rewards(engine: Any, data: Any) -> dict[str, Any]:
        return {"input_ids": torch.tensor([[1]]), "attention_mask": torch.tensor([[True]]), "rewards": torch.tensor([math.nan])}

    async with ScriptedEngine() as engine, open_executor(engine) as ex:
        assert await ex.wait_for_task(ex.submit({}, nan_rewards)) is None
        assert ex.statistics().rejected_by_reason == {"invalid_reward": 1}


# -- item 9: ScriptedEngine's pauses nest like LocalEngine's ----------------------------------


async def test_scripted_engine_pause_update_resume_releases_every_held_request() -> None:
    async with ScriptedEngine() as engine, trio.open_nursery() as nursery:
        await engine.pause()
        done = trio.Event()

        async def request() -> None:
            await engine.agenerate(ModelRequest(input_ids=[1]))
            done.set()

        nursery.start_soon(request)
        await trio.testing.wait_all_tasks_blocked()
        await engine.update_weights({}, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()  # the outer pause is still in effect
        await engine.resume()
        with trio.fail_after(5):
            await done.wait()


# -- item 10: reasons and old ids -------------------------------------------------------------


async def test_a_workflow_error_at_the_episode_deadline_keeps_its_reason(autojump_clock: trio.testing.MockClock) -> None:
    async def slot(engine: Any, data: Any) -> Trajectory:
        if workflow_context.get().sample_idx == 0:
            with trio.CancelScope(shield=True):
                await trio.sleep(10)  # past the deadline, then fails
            raise RuntimeError("slot 0 broke")
        await trio.sleep_forever()
        raise AssertionError

    async with ScriptedEngine() as engine, open_executor(engine, episode_timeout=5) as ex:
        assert await ex.wait_for_task(ex.submit({}, slot, group_size=2)) is None
        assert ex.statistics().failed_by_reason == {"workflow_exception": 1}


async def test_wait_for_task_on_a_long_ago_rejected_task_returns_none() -> None:
    async def none_wf(engine: Any, data: Any) -> None:
        return None

    async with ScriptedEngine() as engine, open_executor(engine, queue_size=2, max_head_offpolicyness=100) as ex:
        old = ex.submit({}, none_wf)
        for _ in range(6):
            await ex.wait_for_task(ex.submit({}, gen_workflow))
        assert await ex.wait_for_task(old) is None
        with pytest.raises(ValueError, match="already taken"):
            await ex.wait_for_task(old + 1)
        with pytest.raises(ValueError, match="never submitted"):
            await ex.wait_for_task(1000)


# -- item 11: a sync source runs off the Trio thread -------------------------------------------


async def test_a_sync_source_is_read_off_the_trio_thread() -> None:
    threads: list[tuple[str, threading.Thread]] = []

    class Sampler:
        def set_epoch(self, epoch: int) -> None:
            threads.append(("set_epoch", threading.current_thread()))

    class Loader:
        batch_size = 2
        sampler = Sampler()

        def __iter__(self) -> Any:
            for _ in range(2):
                threads.append(("next", threading.current_thread()))  # the collate would run here
                yield [{}, {}]

    loader = Loader()
    async with ScriptedEngine() as engine, open_executor(engine, consumer_batch_size=2) as ex:
        for step in range(3):
            assert len(await ex.prepare_batch(loader, gen_workflow, progress=False)) == 2
            ex.set_version(step + 1)
    assert {what for what, _ in threads} == {"next", "set_epoch"}
    assert all(t is not threading.main_thread() for _, t in threads)


# -- issue 16: pause / resume serialized; set_version against server-owned versions ----------


class SlowPauseEngine(ScriptedEngine):
    """A pause that takes a while to reach the servers (a fan-out); a resume that is quick."""

    async def pause(self) -> None:
        await trio.sleep(1)
        self._resumed = trio.Event() if self._resumed.is_set() else self._resumed

    def holds_requests(self) -> bool:
        return not self._resumed.is_set()


async def test_a_resume_racing_a_pause_leaves_engine_and_executor_agreeing(autojump_clock: trio.testing.MockClock) -> None:
    async with SlowPauseEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ex.pause)
            await trio.testing.wait_all_tasks_blocked()  # the pause is on its way to the servers
            await ex.resume()
        assert not ex.paused and not engine.holds_requests()
        with trio.fail_after(5):
            assert await ex.wait_for_task(ex.submit({}, gen_workflow)) is not None


class ServerVersionedEngine(ScriptedEngine):
    """Servers that own their version: a request pinned to another version fails, like
    RemoteEngine with version checks."""

    servers_own_version = True

    def __init__(self) -> None:
        super().__init__()
        self.server_version = 0

    async def agenerate(self, req: ModelRequest) -> Any:
        if self.version != self.server_version:
            raise VersionMismatchError(f"pinned {self.version}, the server reports {self.server_version}")
        return await super().agenerate(req)


async def test_set_version_ahead_of_the_servers_fails_no_task() -> None:
    async with ServerVersionedEngine() as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        ex.set_version(5)
        assert ex.statistics().version == 5  # the trainer's version, for budget and staleness
        for _ in range(3):
            assert await ex.wait_for_task(ex.submit({}, gen_workflow)) is not None
        assert ex.statistics().failed == 0


async def test_set_version_ahead_of_serve_behind_remote_engine_fails_no_task() -> None:
    from rollout_trio.engines import RemoteEngine

    from .conftest_remote import serve
    from .test_executor_engines import prompt

    async def short(engine: Any, data: Any) -> Trajectory:
        from rollout_trio import GenerationConfig

        resp = await engine.agenerate(ModelRequest(input_ids=prompt(), gconfig=GenerationConfig(max_new_tokens=3)))
        return Trajectory.from_response(resp, 0.0)

    with serve("--seed", "0") as server:
        with trio.fail_after(60):
            async with RemoteEngine([server.address], "sglang", setup_timeout=20, seed=0) as engine:
                async with open_executor(engine, max_head_offpolicyness=10) as ex:
                    ex.set_version(3)
                    for _ in range(2):
                        assert await ex.wait_for_task(ex.submit({}, short)) is not None
                    assert ex.statistics().failed == 0
