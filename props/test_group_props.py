"""Properties of grouped rollouts: merging, statistics, and failure under random injection."""

import pytest
import torch
import trio
from hypothesis import given
from hypothesis import strategies as st

from rollout_trio import Interaction, ModelRequest, ModelResponse, run_group, workflow_context
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder

# Each slot: None (rejected) or the length of the one row it returns.
slot_plans = st.lists(st.none() | st.integers(1, 6), min_size=1, max_size=8)


def row_for(slot, length):
    ids = torch.arange(length, dtype=torch.int32) + 100 * slot
    return {"input_ids": ids[None], "attention_mask": torch.ones(1, length, dtype=torch.bool)}


def planned(plan):
    async def wf(engine, data):
        i = workflow_context.get().sample_idx
        await trio.sleep(0)
        return None if plan[i] is None else row_for(i, plan[i])

    return wf


@given(slot_plans)
async def test_merge_keeps_each_usable_slot_once_in_slot_order(plan):
    """The merged batch has one row per usable slot, in slot order, shape [usable, max_len],
    each row's original tokens unchanged."""
    out = await run_group(planned(plan), ScriptedEngine(), {}, len(plan), stats=StatsRecorder())
    usable = [(i, n) for i, n in enumerate(plan) if n is not None]
    if not usable:
        assert out is None
        return
    assert tuple(out.input_ids.shape) == (len(usable), max(n for _, n in usable))
    for row, (i, n) in enumerate(usable):
        assert torch.equal(out.input_ids[row, :n], row_for(i, n)["input_ids"][0])
        assert int(out.attention_mask[row].sum()) == n
    assert out.rollout_group.row_counts == (1,) * len(usable)


@given(slot_plans, st.data())
async def test_statistics_depend_only_on_which_slots_were_usable(plan, data):
    """Two groups with the same usable/unusable pattern but different contents record the same
    statistics, and those follow the definitions of spec/group.md §11.1."""
    other = [None if n is None else data.draw(st.integers(1, 6)) for n in plan]
    minimum = data.draw(st.integers(1, len(plan)))
    recs = []
    for p in (plan, other):
        rec = StatsRecorder()
        await run_group(planned(p), ScriptedEngine(), {}, len(p), min_usable_group_size=minimum, stats=rec)
        recs.append(rec.records[0].values)
    assert recs[0] == recs[1]
    g, u = len(plan), sum(n is not None for n in plan)
    trainable = u if u >= minimum and u > 0 else 0
    assert recs[0] == {
        "target_slot_count": g, "usable_slot_count": u, "trainable_slot_count": trainable,
        "fully_masked_group": float(u == 0), "singleton_slot_group": float(u == 1),
        "pre_filter_usable_slot_yield": u / g, "pre_filter_trainable_slot_yield": trainable / g,
    }


# Each slot: how many steps it takes, whether each step is an engine call, and the step
# it fails at (None: it succeeds).
slot_scripts = st.lists(
    st.tuples(st.integers(0, 4), st.booleans(), st.none() | st.integers(0, 4)), min_size=1, max_size=6
)


@given(slot_scripts)
async def test_no_sibling_outlives_a_failure_and_the_cache_is_finalized_once(scripts):
    """Under random failure injection, with Trio's deterministic scheduling: when any slot
    fails, the group raises only after every slot has ended; every engine request ends
    completed or aborted; the finalizer runs exactly once, after all slots."""
    alive: set[int] = set()
    finalized: list[frozenset[int]] = []
    engine = ScriptedEngine()

    async def wf(engine, data):
        i = workflow_context.get().sample_idx
        steps, use_engine, fail_at = scripts[i]
        alive.add(i)
        try:
            for step in range(steps + 1):
                if fail_at is not None and step == fail_at:
                    raise RuntimeError(f"injected in slot {i}")
                if use_engine:
                    await engine.agenerate(ModelRequest(input_ids=[i + 1], rid=f"{i}-{step}"))
                else:
                    await trio.sleep(0)
            return row_for(i, 1)
        finally:
            alive.discard(i)

    async def hook(ctx):
        finalized.append(frozenset(alive))

    fails = [i for i, (steps, _, f) in enumerate(scripts) if f is not None and f <= steps]
    try:
        out = await run_group(wf, engine, {}, len(scripts), finalize_hook=hook, stats=StatsRecorder())
    except ExceptionGroup as eg:
        assert fails, "a group without injected failures raised"
        assert all(isinstance(e, RuntimeError) for e in eg.exceptions)
        assert {int(str(e).split()[-1]) for e in eg.exceptions} <= set(fails)
    else:
        assert not fails and out.batch_size == len(scripts)
    assert alive == set()
    assert finalized == [frozenset()]  # exactly once, when no slot was alive any more
    assert not engine.in_flight
    assert len(engine.completed) + len(engine.aborted) == len(engine.requests)


@given(st.integers(2, 8), st.data())
async def test_cancelling_one_slot_never_loses_another_slots_completed_result(g, data):
    """A slot that finished before a sibling failed is still in `results` when the
    metrics hook runs (the group holds results by slot index, not by completion)."""
    finish_first = data.draw(st.integers(0, g - 1))
    seen = []

    class WF:
        async def arun_episode(self, engine, data_):
            i = workflow_context.get().sample_idx
            if i == finish_first:
                resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-0.5], output_versions=[0])
                return {f"c{i}": Interaction(model_response=resp, reward=float(i))}
            await trio.sleep(0.001)
            raise ValueError("late failure")

        def record_group_metrics(self, data_, rewards, group_size):
            seen.append(rewards)

    with pytest.raises(ExceptionGroup) as info:
        await run_group(WF(), ScriptedEngine(), {}, g, stats=StatsRecorder())
    assert all(isinstance(e, ValueError) for e in info.value.exceptions)
    assert seen[0][finish_first] == float(finish_first)
