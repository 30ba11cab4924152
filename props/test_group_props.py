"""Properties of grouped rollouts: merging, statistics, and failure under random injection."""

import math

import pytest
import torch
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from rollout_trio import Interaction, ModelRequest, ModelResponse, Trajectory, WorkflowContractError, run_group, workflow_context
from rollout_trio.testing import ScriptedEngine
from rollout_trio.testing import strategies as rst
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
        summaries = rec.summaries()
        assert {x.count for x in summaries.values()} == {1}
        recs.append({key.removeprefix("rollout/"): x.total for key, x in summaries.items()})
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


@given(st.integers(3, 8), st.data())
async def test_a_failure_cancels_the_running_slots_but_keeps_a_finished_result(g, data):
    """When a slot fails after another finished, every still-running sibling is really
    cancelled (it sees Cancelled), and the finished slot's result is still what the
    metrics hook gets for it (results are held by slot index, not by completion)."""
    finish_first = data.draw(st.integers(0, g - 1))
    failing = data.draw(st.integers(0, g - 1).filter(lambda i: i != finish_first))
    finished = trio.Event()
    cancelled: list[int] = []
    seen = []

    class WF:
        async def arun_episode(self, engine, data_):
            i = workflow_context.get().sample_idx
            if i == finish_first:
                resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-0.5], output_versions=[0])
                finished.set()
                return {f"c{i}": Interaction(model_response=resp, reward=float(i))}
            if i == failing:
                await finished.wait()
                raise ValueError("late failure")
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                cancelled.append(i)
                raise

        def record_group_metrics(self, data_, rewards, group_size):
            seen.append(rewards)

    with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="late failure")):
        await run_group(WF(), ScriptedEngine(), {}, g, stats=StatsRecorder())
    assert sorted(cancelled) == sorted(set(range(g)) - {finish_first, failing})
    assert seen == [[float(finish_first) if i == finish_first else None for i in range(g)]]


# -- hostile rewards under reward normalization ------------------------------------------

F32_MAX = 3.4028234663852886e38


def bad_reward(r: float) -> bool:
    return not math.isfinite(r) or abs(r) > F32_MAX


def oracle(refs: list[float], use_std: bool) -> tuple[list[float], float, float]:
    """Rollout-time normalization in exact-as-possible Python floats (fsum, pstdev):
    the normalized values, the mean and the divisor."""
    mean = math.fsum(refs) / len(refs)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in refs) / len(refs))
    divisor = 1.0 if not use_std or std <= 1e-8 else std + 1e-8
    return [(r - mean) / divisor for r in refs], mean, divisor


def overflows(refs: list[float], use_std: bool) -> bool:
    """Whether an exact normalized value lies beyond float32's range by more than rounding
    (possible when centring without the std divisor, with rewards near the limit)."""
    return any(abs(v) > F32_MAX * (1 + 2**-20) for v in oracle(refs, use_std)[0])


def check_normalized(out: list[float], refs: list[float], use_std: bool) -> None:
    """Finite, close to the oracle, and never a silent 0 when the references differ."""
    assert all(math.isfinite(x) for x in out), out
    expected, mean, divisor = oracle(refs, use_std)
    biggest = max(abs(r) for r in refs)
    for got, want, r in zip(out, expected, refs):
        # Rounding allowed: the float32 result, the float32 copies of r and of the mean,
        # and float64 sums at the scale of the largest reference.
        tol = 1e-6 * abs(want) + (1e-7 * (abs(r) + abs(mean)) + 1e-14 * biggest) / divisor + 1e-30
        assert abs(got - want) <= tol, (got, want, refs)
    f32 = [float(torch.tensor(r, dtype=torch.float32)) for r in refs]
    if len(set(f32)) > 1:
        assert any(x != 0.0 for x in out), (out, refs)


# Found by CI-length runs: float32 rounding of an input carried its centred value a hair
# past float32's range, which came out as -inf; that now saturates.
@example(rewards=[1.7014117838986642e38, 1.7014118853107118e38, -3.402823364973241e38], use_std=False)
@example(rewards=[F32_MAX, F32_MAX, -F32_MAX], use_std=False)  # truly beyond: an error
@given(st.integers(2, 6).flatmap(lambda g: st.lists(rst.any_rewards(), min_size=g, max_size=g)), st.booleans())
async def test_interaction_rewards_normalize_to_finite_values_or_name_the_bad_slot(rewards, use_std):
    """With reward_normalization on, interaction rewards drawn from NaN, infinities, huge
    and tiny magnitudes either raise WorkflowContractError naming the first slot whose
    reward is not a finite float32 (or whose normalized value float32 cannot hold), or
    normalize to finite values matching an exact oracle, never all 0 when the rewards
    differ."""
    resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-0.5], output_versions=[0])
    slots = [{f"c{i}": Interaction(model_response=resp, reward=r)} for i, r in enumerate(rewards)]
    bad = [i for i, r in enumerate(rewards) if bad_reward(r)]
    wf = planned_results(slots)
    if bad:
        with pytest.raises(WorkflowContractError, match=f"^slot {bad[0]}: "):
            await run_group(wf, ScriptedEngine(), {}, len(rewards), reward_normalization=True,
                            reward_normalization_use_std=use_std, stats=StatsRecorder())
        return
    if overflows(rewards, use_std):
        with pytest.raises(WorkflowContractError, match=r"^slot \d+: 'reward': .*beyond float32's range"):
            await run_group(wf, ScriptedEngine(), {}, len(rewards), reward_normalization=True,
                            reward_normalization_use_std=use_std, stats=StatsRecorder())
        return
    out = await run_group(wf, ScriptedEngine(), {}, len(rewards), reward_normalization=True,
                          reward_normalization_use_std=use_std, stats=StatsRecorder())
    inters = list(out.values())
    assert [x.original_reward for x in inters] == rewards
    check_normalized([x.reward for x in inters], rewards, use_std)


@given(st.integers(2, 6).flatmap(lambda g: st.lists(rst.any_rewards(), min_size=g, max_size=g)), st.data())
async def test_row_rewards_normalize_to_finite_values_or_name_the_bad_slot(rewards, data):
    """The same for tensor rows (float64 rewards tensors, so values beyond float32 reach
    the check), under drawn group options: a clear error naming the slot, or finite rows
    matching the oracle over the kept rollouts."""
    options = data.draw(rst.group_options(len(rewards)))
    slots = [
        {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2, dtype=torch.bool),
         "rewards": torch.tensor([r], dtype=torch.float64)}
        for r in rewards
    ]
    bad = [i for i, r in enumerate(rewards) if bad_reward(r)]
    wf = planned_results(slots)
    if bad:
        with pytest.raises(WorkflowContractError, match=f"^slot {bad[0]}: 'rewards'"):
            await run_group(wf, ScriptedEngine(), {}, len(rewards), stats=StatsRecorder(), **options)
        return
    if options["reward_normalization"] and overflows(rewards, options["reward_normalization_use_std"]):
        with pytest.raises(WorkflowContractError, match=r"^slot \d+: 'rewards': .*beyond float32's range"):
            await run_group(wf, ScriptedEngine(), {}, len(rewards), stats=StatsRecorder(), **options)
        return
    out = await run_group(wf, ScriptedEngine(), {}, len(rewards), stats=StatsRecorder(), **options)
    got = out.rewards.tolist()
    if options["reward_normalization"]:
        assert out.original_rewards.tolist() == rewards
        check_normalized(got, rewards, options["reward_normalization_use_std"])
    else:
        assert got == rewards


def planned_results(results):
    async def wf(engine, data):
        await trio.sleep(0)
        return results[workflow_context.get().sample_idx]

    return wf


def _group_outcome(results, policy):
    """assemble_group's result as comparable values, or the error's type and message."""
    from rollout_trio._assemble import assemble_group

    try:
        out, stats = assemble_group(results, policy)
    except (WorkflowContractError, ValueError) as exc:
        return type(exc), str(exc)
    if out is None:
        return None, stats
    d = out.to_dict()
    return {k: (v.dtype, tuple(v.shape), v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in d.items()}, stats


@given(rst.trajectory_groups(max_rows=1, min_size=2, max_size=6), st.data())
def test_a_packed_group_equals_the_same_group_joined_slot_by_slot(trajs, data):
    """A group of plain one-row dicts (packed in bulk, checked once, normalized in place)
    gives exactly what the same slots give as Trajectory objects (validated and joined
    one by one): the batch, its references and statistics, or the same error. Rewards
    are drawn from any float a workflow might return, in float32 and float64 tensors."""
    from rollout_trio._assemble import GroupPolicy

    opts = data.draw(rst.group_options(len(trajs)))
    policy = GroupPolicy(
        len(trajs), opts["min_usable_group_size"], opts["drop_incomplete_group"],
        opts["reward_normalization"], opts.get("reward_normalization_use_std", True),
    )
    dicts = [t.to_dict() for t in trajs]
    if data.draw(st.booleans()) or data.draw(st.booleans()):  # mostly no padding of their own: packable
        for t, d in zip(trajs, dicts):
            w = int(t.attention_mask.sum())
            d.update({k: v[:, :w] for k, v in d.items() if isinstance(v, torch.Tensor) and v.ndim == 2})
    keep_references = data.draw(st.booleans()) and data.draw(st.booleans())  # mostly rows as references
    dtype = data.draw(st.sampled_from([torch.float32, torch.float32, torch.float64]))
    wild = data.draw(st.booleans())  # NaN, infinities and float32's edges too
    for d in dicts:
        d["rewards"] = torch.tensor([data.draw(rst.any_rewards() if wild else rst.rewards())], dtype=dtype)
        if not keep_references:
            d.pop("rollout_group", None)
            d.pop("rollout_reward", None)
    general = []
    for d in dicts:
        try:
            general.append(Trajectory.from_dict(d))
        except (WorkflowContractError, ValueError):
            general = None
            break
    packed = _group_outcome(dicts, policy)
    if general is None:  # a slot the contract rejects: the packed path must reject it too
        assert isinstance(packed[0], type) and issubclass(packed[0], ValueError), packed
        return
    assert packed == _group_outcome(general, policy)
