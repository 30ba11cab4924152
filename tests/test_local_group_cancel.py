"""A failing slot on the real LocalEngine: no sibling runs on past the failure (issue 11 item 6)."""

from __future__ import annotations

import time

import pytest
import trio

from rollout_trio import GenerationConfig, GroupRolloutError, ModelRequest, run_group, workflow_context
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflow_context import StatsRecorder

G = 16
TOKENS = 3


async def one_group(engine: LocalEngine, failing: int, tag: str) -> dict[str, int]:
    """Run a group whose slots all finish on the same forward pass; slot ``failing`` raises."""
    seen = {"failed": 0, "ran_past_failure": 0, "results": 0}
    rids = [f"{tag}-{i}" for i in range(G)]

    async def wf(engine_, data):
        i = workflow_context.get().sample_idx
        gconfig = GenerationConfig(max_new_tokens=TOKENS, ignore_eos=True, greedy=True)
        await engine_.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig, rid=rids[i]))
        seen["results"] += 1  # no checkpoint from here to the return
        if i == failing:
            seen["failed"] = 1
            raise RuntimeError("injected")
        if seen["failed"]:
            seen["ran_past_failure"] += 1
        return None

    async def release_when_all_queued() -> None:
        with trio.fail_after(30):  # a guard against hanging, not a timing assertion
            while len(engine.statistics().live_rids & set(rids)) < G:
                await trio.sleep(0.002)
        await engine.resume()
        # Block the Trio thread (on purpose) until every request has finished in the
        # engine: their completions then queue up and wake all slots in one scheduler
        # round, the case where a sibling used to run on after the failure.
        deadline = time.monotonic() + 30
        while any(engine.statistics().steps_per_rid.get(r) != TOKENS for r in rids):
            assert time.monotonic() < deadline, "the engine did not finish the group's requests"
            time.sleep(0.001)

    await engine.pause()  # every request joins one batch, so all finish on the same pass
    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_when_all_queued)
        with pytest.RaisesGroup(RuntimeError, check=lambda eg: isinstance(eg, GroupRolloutError)):
            await run_group(wf, engine, {}, G, stats=StatsRecorder())
    steps = engine.statistics().steps_per_rid
    # The scenario happened: every request ran to its budget, so all were woken together.
    assert [steps.get(r) for r in rids] == [TOKENS] * G
    return seen


async def test_no_sibling_runs_past_a_failure_on_the_local_engine() -> None:
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        # Trio runs a batch of woken tasks forwards or backwards: failing slots near each
        # end and in the middle leave siblings after them in either order.
        outcomes = [await one_group(engine, failing, f"g{failing}") for failing in (1, G // 2, G - 2)]
    for seen in outcomes:
        assert seen["failed"] == 1
        assert seen["ran_past_failure"] == 0
        assert 1 <= seen["results"] <= G
