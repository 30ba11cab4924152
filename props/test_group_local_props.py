"""The group properties again, on the real embedded engine with the tiny model."""

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, run_group, workflow_context
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflow_context import StatsRecorder

MODEL, TOKENIZER = tiny_model(seed=0)
PROMPT = TOKENIZER.apply_chat_template(
    [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
)
GCONFIG = GenerationConfig(max_new_tokens=4, temperature=1.0)  # few tokens keep 200 examples cheap


def rejecting(mask, seed):
    async def wf(engine, data):
        i = workflow_context.get().sample_idx
        resp = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GCONFIG.new(seed=seed + i)))
        return None if mask[i] else Trajectory.from_response(resp, reward=float(resp.output_len))

    return wf


# The sampling seeds make the space of examples large enough for 200 distinct ones.
seeds = st.integers(0, 2**31)


@given(st.lists(st.booleans(), min_size=1, max_size=6), seeds)
async def test_real_engine_merge_keeps_each_usable_slot_once_in_order(mask, seed):
    """On LocalEngine: one row per usable slot, in slot order (each slot's seeded answer),
    versions -1 exactly where loss_mask is 0, finite logprobs <= 0."""
    async with LocalEngine(MODEL, TOKENIZER, seed=0) as engine:
        out = await run_group(rejecting(mask, seed), engine, {}, len(mask), stats=StatsRecorder())
        usable = [i for i, rejected in enumerate(mask) if not rejected]
        if not usable:
            assert out is None
            return
        assert out.batch_size == len(usable)
        for row, i in enumerate(usable):
            alone = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GCONFIG.new(seed=seed + i)))
            n = len(PROMPT) + alone.output_len
            assert out.input_ids[row, :n].tolist() == [*PROMPT, *alone.output_tokens]
        assert bool((out.versions[out.loss_mask == 0] == -1).all())
        assert bool((out.versions[out.loss_mask == 1] == 0).all())
        assert bool((out.logprobs <= 0).all())


@given(st.integers(2, 5), seeds, st.data())
async def test_real_engine_failure_cuts_every_started_sibling_short(g, seed, data):
    """When one slot fails while all its siblings are generating on LocalEngine, the
    group raises that failure, every sibling had started (at least one step) and was cut
    short (fewer steps than its budget), and no request of the group is live afterwards."""
    failing = data.draw(st.integers(0, g - 1))
    rids = {i: f"slot-{i}" for i in range(g) if i != failing}
    budget = 64

    async def wf(engine, data_):
        i = workflow_context.get().sample_idx
        if i == failing:
            # Fail once every sibling is in the engine and has produced a token.
            with trio.fail_after(30):  # a guard against hanging, not a timing assertion
                while min(engine.statistics().steps_per_rid.get(r, 0) for r in rids.values()) < 1:
                    await trio.sleep(0.001)
            raise RuntimeError("injected")
        long = GenerationConfig(max_new_tokens=budget, ignore_eos=True, temperature=1.0, seed=seed + i)
        await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=long, rid=rids[i]))
        return None

    async with LocalEngine(MODEL, TOKENIZER, seed=0) as engine:
        with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="injected")):
            await run_group(wf, engine, {}, g, stats=StatsRecorder())
        stats = engine.statistics()
        assert not (stats.live_rids & set(rids.values()))
        steps = [stats.steps_per_rid.get(r, 0) for r in rids.values()]
        assert all(1 <= n < budget for n in steps), steps
