"""Issue 27: a call's own results never stop that call or other work from starting.

Each test is a reproduction from the issue that waited forever on the old executor (the
dispatcher counted every finished result, owned or not, against ``queue_size``). A hang
here is a failure: every call runs under a virtual-clock deadline (``autojump_clock``), so
a call that cannot finish fails the test at once instead of stalling the suite.
"""

from __future__ import annotations

from typing import Any

import pytest
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
