"""The group properties again, on the real embedded engine with the tiny model."""

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, run_group, workflow_context
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflow_context import StatsRecorder

MODEL, TOKENIZER = tiny_model(seed=0)
PROMPT = TOKENIZER.apply_chat_template(
    [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
)
GCONFIG = GenerationConfig(max_new_tokens=6, temperature=1.0)


def rejecting(mask):
    async def wf(engine, data):
        i = workflow_context.get().sample_idx
        resp = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GCONFIG.new(seed=i)))
        return None if mask[i] else Trajectory.from_response(resp, reward=float(resp.output_len))

    return wf


@settings(max_examples=25)
@given(st.lists(st.booleans(), min_size=1, max_size=6))
async def test_real_engine_merge_keeps_each_usable_slot_once_in_order(mask):
    """On LocalEngine: one row per usable slot, in slot order (each slot's seeded answer),
    versions -1 exactly where loss_mask is 0, finite logprobs <= 0."""
    async with LocalEngine(MODEL, TOKENIZER, seed=0) as engine:
        out = await run_group(rejecting(mask), engine, {}, len(mask), stats=StatsRecorder())
        usable = [i for i, rejected in enumerate(mask) if not rejected]
        if not usable:
            assert out is None
            return
        assert out.batch_size == len(usable)
        for row, i in enumerate(usable):
            alone = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GCONFIG.new(seed=i)))
            n = len(PROMPT) + alone.output_len
            assert out.input_ids[row, :n].tolist() == [*PROMPT, *alone.output_tokens]
        assert bool((out.versions[out.loss_mask == 0] == -1).all())
        assert bool((out.versions[out.loss_mask == 1] == 0).all())
        assert bool((out.logprobs <= 0).all())


@settings(max_examples=15)
@given(st.integers(2, 5), st.data())
async def test_real_engine_failure_leaves_no_generation_running(g, data):
    """When one slot fails while its siblings are generating on LocalEngine, the group
    raises, and no request of the group is live in the engine afterwards."""
    failing = data.draw(st.integers(0, g - 1))
    rids = [f"slot-{i}" for i in range(g)]

    async def wf(engine, data_):
        i = workflow_context.get().sample_idx
        if i == failing:
            await trio.sleep(0.01)
            raise RuntimeError("injected")
        long = GenerationConfig(max_new_tokens=400, ignore_eos=True)
        await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=long, rid=rids[i]))
        return None

    async with LocalEngine(MODEL, TOKENIZER, seed=0) as engine:
        try:
            await run_group(wf, engine, {}, g, stats=StatsRecorder())
        except ExceptionGroup as eg:
            assert [type(e) for e in eg.exceptions] == [RuntimeError]
        else:
            raise AssertionError("the group did not raise")
        stats = engine.statistics()
        assert not (stats.live_rids & set(rids))
        # No request ran to its 400-token budget: each was cut short by the cancellation.
        assert all(stats.steps_per_rid.get(r, 0) < 400 for r in rids)
