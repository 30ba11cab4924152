"""Grouped rollouts: spec/group.md §3 and cases 1-23, adapted to DESIGN.md's decisions."""

import logging

import pytest
import torch
import trio
import trio.testing

from rollout_trio import (
    GroupedRolloutWorkflow,
    RolloutGroup,
    Trajectory,
    WorkflowContractError,
    interactions_to_trajectory,
    run_group,
    workflow_context,
)
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder, WorkflowContext

from .group_helpers import I, scripted, traj


def stats_tuple(recorder):
    summaries = recorder.summaries()
    assert {s.count for s in summaries.values()} == {1}  # one group recorded
    v = {key.split("/", 1)[1]: s.total for key, s in summaries.items()}
    return (
        v["target_slot_count"], v["usable_slot_count"], v["trainable_slot_count"], bool(v["fully_masked_group"]),
        bool(v["singleton_slot_group"]), pytest.approx(v["pre_filter_usable_slot_yield"]),
        pytest.approx(v["pre_filter_trainable_slot_yield"]),
    )


async def run(results, recorder=None, **options):
    recorder = recorder if recorder is not None else StatsRecorder()
    wf = scripted(results)
    out = await run_group(wf, ScriptedEngine(), {"prompt": "x"}, len(results), stats=recorder, **options)
    return out, wf.calls, recorder


# -- case 1: sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(("g", "m"), [(0, 1), (2, 0), (2, 3)])
def test_case_1_invalid_sizes(g, m):
    with pytest.raises(ValueError, match="must be"):
        GroupedRolloutWorkflow(scripted([None]), g, min_usable_group_size=m)


def test_case_1_message_names_the_bounds():
    with pytest.raises(ValueError, match=r"min_usable_group_size must be between 1 and group_size \(2\), got 3"):
        GroupedRolloutWorkflow(scripted([None]), 2, min_usable_group_size=3)
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        GroupedRolloutWorkflow(scripted([None]), 0)


def test_reward_normalization_minimum_is_two():
    """DESIGN.md decision 6: default 2, an explicit value below 2 rejected, G == 1 rejected."""
    assert GroupedRolloutWorkflow(scripted([None]), 4, reward_normalization=True).min_usable_group_size == 2
    assert GroupedRolloutWorkflow(scripted([None]), 4).min_usable_group_size == 1
    with pytest.raises(ValueError, match="at least 2"):
        GroupedRolloutWorkflow(scripted([None]), 4, reward_normalization=True, min_usable_group_size=1)
    with pytest.raises(ValueError, match="group_size > 1"):
        GroupedRolloutWorkflow(scripted([None]), 1, reward_normalization=True)


# -- cases 2-8: classification and statistics -----------------------------------------------


async def test_case_2_partial_group_kept():
    out, calls, rec = await run([traj(11), None, traj(22)])
    assert out.input_ids.tolist() == [[11], [22]]
    assert sorted(calls) == [0, 1, 2]
    assert out.rollout_group == RolloutGroup((1, 1))
    assert stats_tuple(rec) == (3, 2, 2, False, False, 2 / 3, 2 / 3)


async def test_case_3_complete_group():
    out, _, rec = await run([traj(11), traj(22), traj(33)])
    assert out.input_ids.tolist() == [[11], [22], [33]]
    assert stats_tuple(rec) == (3, 3, 3, False, False, 1, 1)


async def test_case_4_all_unusable():
    out, _, rec = await run([None, None, None])
    assert out is None
    assert stats_tuple(rec) == (3, 0, 0, True, False, 0, 0)


async def test_case_5_below_minimum():
    out, calls, rec = await run([None, traj(11), None], min_usable_group_size=2)
    assert out is None and len(calls) == 3
    assert stats_tuple(rec) == (3, 1, 0, False, True, 1 / 3, 0)


async def test_case_6_singleton_kept_by_default():
    out, _, _ = await run([None, traj(11)])
    assert out.input_ids.tolist() == [[11]]


async def test_case_7_drop_incomplete_group(caplog):
    with caplog.at_level(logging.WARNING, logger="rollout_trio.group"):
        out, _, rec = await run([{"a": I(1.0)}, None], drop_incomplete_group=True)
    assert out is None
    assert "dropping entire group" in caplog.records[0].getMessage()
    assert stats_tuple(rec) == (2, 1, 0, False, True, 0.5, 0)


async def test_case_8_empty_dict_is_unusable():
    out, _, rec = await run([{}, traj(1)])
    assert out.input_ids.tolist() == [[1]]
    assert rec.export()["rollout/usable_slot_count"] == 1


@pytest.mark.parametrize(
    ("slots", "options", "expected"),
    [
        ([True, None, True], {"min_usable_group_size": 1}, (3, 2, 2, False, False, 2 / 3, 2 / 3)),
        ([None, True, None], {"min_usable_group_size": 1}, (3, 1, 1, False, True, 1 / 3, 1 / 3)),
        ([True, None, True], {"min_usable_group_size": 3}, (3, 2, 0, False, False, 2 / 3, 0)),
        ([True, None, True], {"drop_incomplete_group": True}, (3, 2, 0, False, False, 2 / 3, 0)),
    ],
)
async def test_worked_statistics_examples(slots, options, expected):
    """spec/group.md §11.2."""
    out, _, rec = await run([traj(7) if s else None for s in slots], **options)
    assert stats_tuple(rec) == expected
    assert (out is None) == (expected[2] == 0)


async def test_statistics_go_to_the_eval_scope_and_the_context_recorder():
    rec = StatsRecorder()
    with workflow_context.use_stats_recorder(rec), workflow_context.use(WorkflowContext(is_eval=True)):
        await run_group(scripted([traj(1), traj(2)]), ScriptedEngine(), {}, 2)
    assert {key.split("/")[0] for key in rec.summaries()} == {"eval-rollout"}
    exported = rec.export()
    assert exported["eval-rollout/usable_slot_count"] == 2 and exported["eval-rollout/pre_filter_trainable_slot_yield"] == 1
    assert rec.summaries() == {}  # export() reset it


# -- cases 9-16: rollout-time normalization ------------------------------------------------


async def test_case_9_two_rollouts_are_normalized_in_place():
    a, b = I(1.0), I(3.0)
    out, _, _ = await run([{"a": a}, {"b": b}], reward_normalization=True)
    assert out["a"] is a and out["b"] is b
    assert a.reward == pytest.approx(-1.0) and b.reward == pytest.approx(1.0)
    assert (a.original_reward, b.original_reward) == (1.0, 3.0)
    assert a.cache.rewards.tolist() == pytest.approx([-1.0]) and b.cache.rewards.tolist() == pytest.approx([1.0])
    assert a.cache.original_rewards.tolist() == [1.0] and b.cache.original_rewards.tolist() == [3.0]


async def test_case_10_partial_group_below_the_normalization_minimum_is_dropped():
    """Adapted: DESIGN.md decision 6 makes the minimum 2, so the singleton is dropped, not zeroed."""
    out, _, rec = await run([{"a": I(1.0)}, None], reward_normalization=True)
    assert out is None
    assert stats_tuple(rec) == (2, 1, 0, False, True, 0.5, 0)


async def test_case_10b_partial_group_normalizes_across_usable_rollouts():
    a, c = I(1.0), I(3.0)
    out, _, _ = await run([{"a": a}, None, {"c": c}], reward_normalization=True)
    assert set(out) == {"a", "c"} and a.reward == pytest.approx(-1.0) and c.reward == pytest.approx(1.0)


async def test_case_11_missing_reward_drops_the_group(caplog):
    with caplog.at_level(logging.WARNING, logger="rollout_trio.group"):
        out, _, rec = await run([{"a": I(1.0)}, {"b": I(None)}], reward_normalization=True)
    assert out is None
    assert "reward_normalization: dropping group (1/2 usable rollouts have None reward)" in caplog.text
    assert stats_tuple(rec) == (2, 2, 0, False, False, 1, 0)


async def test_case_12_duplicate_ids():
    rec = StatsRecorder()
    with pytest.raises(WorkflowContractError, match=r"must be unique: duplicate interaction IDs \['duplicate'\] in slots 0 and 1"):
        await run([{"duplicate": I(1.0)}, {"duplicate": I(2.0)}], rec)
    assert rec.summaries() == {}


async def test_case_13_explicit_reference_required_then_used():
    with pytest.raises(WorkflowContractError, match="explicit rollout_reward"):
        await run([{"a": I(1.0), "b": I(2.0)}, {"c": I(3.0)}], reward_normalization=True)
    out, _, _ = await run([{"a": I(1.0), "b": I(2.0, rollout_reward=1.0)}, {"c": I(3.0)}], reward_normalization=True)
    t = interactions_to_trajectory(out)
    assert t.rewards.tolist() == pytest.approx([-1.0, 0.0, 1.0])
    assert t.original_rewards.tolist() == [1.0, 2.0, 3.0]
    assert t.rollout_group.row_counts == (2, 1)
    assert t.rollout_group.rewards == pytest.approx((-1.0, 1.0))


async def test_case_14_cached_split_rows_differ():
    with pytest.raises(WorkflowContractError, match="explicit rollout_reward"):
        await run([{"a": I(1.0, cache_rewards=[1.0, 2.0])}, {"b": I(3.0)}], reward_normalization=True)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float64])
async def test_case_15_constant_non_binary_reward_gives_exact_zeros(cache_dtype):
    a, b = I(0.1, cache_dtype=cache_dtype), I(0.1)
    b.cache = None
    await run([{"a": a}, {"b": b}], reward_normalization=True)
    assert (a.reward, b.reward, a.rollout_reward, b.rollout_reward) == (0.0, 0.0, 0.0, 0.0)
    assert a.cache.rewards.tolist() == [0.0]


@pytest.mark.parametrize("d", [0.0, 1e-8, 2e-8])
async def test_case_16_scale_fallback(d):
    first = I(-1.0, rollout_reward=-d, cache_rewards=[-1.0, -0.5])
    last = I(d, rollout_reward=d)
    last.cache = None
    await run([{"first": first}, {"last": last}], reward_normalization=True)
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    div = 1.0 if f32(d) <= f32(1e-8) else f32(f32(d) + f32(1e-8))
    assert first.reward == pytest.approx(-1 / div, rel=1e-5)
    assert last.reward == pytest.approx(d / div, rel=1e-5, abs=1e-12)
    assert first.rollout_reward == pytest.approx(-d / div, rel=1e-5, abs=1e-12)
    assert first.cache.rewards.tolist() == pytest.approx([-1 / div, -0.5 / div], rel=1e-5)


async def test_normalization_without_std_only_centres():
    a, b = I(1.0), I(5.0)
    await run([{"a": a}, {"b": b}], reward_normalization=True, reward_normalization_use_std=False)
    assert (a.reward, b.reward) == (-2.0, 2.0)


async def test_tensor_groups_are_normalized_row_by_row():
    """DESIGN.md: normalization applies to tensor groups too, keeping original_rewards."""
    def row(r, n=1, ref=None):
        d = {"input_ids": torch.ones(n, 2, dtype=torch.int32), "attention_mask": torch.ones(n, 2, dtype=torch.bool),
             "rewards": torch.tensor([r] * n if not isinstance(r, list) else r)}
        if ref is not None:
            d["rollout_reward"] = ref
        return d

    out, _, _ = await run([row([1.0, 2.0], 2, ref=1.0), row(3.0)], reward_normalization=True)
    assert out.rewards.tolist() == pytest.approx([-1.0, 0.0, 1.0])
    assert out.original_rewards.tolist() == [1.0, 2.0, 3.0]
    assert out.rollout_group.row_counts == (2, 1) and out.rollout_group.rewards == pytest.approx((-1.0, 1.0))
    with pytest.raises(WorkflowContractError, match="explicit rollout_reward"):
        await run([row([1.0, 2.0], 2), row(3.0)], reward_normalization=True)
    with pytest.raises(WorkflowContractError, match="needs a rewards tensor"):
        await run([traj(1), traj(2)], reward_normalization=True)


# -- case 18: multi-row metadata -----------------------------------------------------------


async def test_case_18_rollout_index_and_logical_groups():
    a, b, c = I(1.0), I(2.0, rollout_reward=1.0), I(3.0)
    out, _, _ = await run([{"a": a, "b": b}, None, {"c": c}], min_usable_group_size=2)
    assert list(out) == ["a", "b", "c"]
    assert [x.rollout_index for x in (a, b, c)] == [0, 0, 1]  # index among usable results
    t = interactions_to_trajectory(out)
    assert t.rollout_group == RolloutGroup((2, 1), (1.0, None))
    assert t.rewards.tolist() == [1.0, 2.0, 3.0]


# -- contract errors -----------------------------------------------------------------------


async def test_mixed_result_kinds_are_a_contract_error():
    with pytest.raises(WorkflowContractError, match="same kind of result; got slot 0: interaction, slot 1: tensor"):
        await run([{"a": I(1.0)}, traj(1)])


async def test_key_mismatch_between_slots_is_a_contract_error():
    bad = traj(2)
    bad["rewards"] = torch.tensor([1.0])
    with pytest.raises(WorkflowContractError, match="slot 1: has different keys"):
        await run([traj(1), bad])


async def test_non_dict_result_is_a_contract_error():
    with pytest.raises(WorkflowContractError, match="slot 1: a workflow must return a Trajectory, a dict or None; got list"):
        await run([traj(1), [1, 2]])


async def test_bad_slot_tensors_name_the_slot():
    with pytest.raises(WorkflowContractError, match="^slot 1: 'input_ids'"):
        await run([traj(1), {"input_ids": torch.tensor([[1.5]]), "attention_mask": torch.tensor([[True]])}])


async def test_a_slot_is_one_logical_rollout():
    two = Trajectory.from_dict({**traj(1), "input_ids": torch.tensor([[1], [2]]), "attention_mask": torch.ones(2, 1, dtype=torch.bool),
                                "rollout_group": RolloutGroup((1, 1))})
    with pytest.raises(WorkflowContractError, match="one workflow call is one logical rollout"):
        await run([two, traj(3)])


async def test_trajectory_objects_and_multi_row_slots_are_accepted():
    two = Trajectory.from_dict({"input_ids": torch.tensor([[1, 2], [3, 4]]), "attention_mask": torch.ones(2, 2, dtype=torch.bool)})
    out, _, _ = await run([two, traj(5)])
    assert out.rollout_group == RolloutGroup((2, 1)) and out.batch_size == 3


# -- slots, context and the processor cache -----------------------------------------------


async def test_each_slot_has_its_own_context_and_shares_one_cache():
    seen = []

    async def wf(engine, data):
        ctx = workflow_context.get()
        await trio.sleep(0)
        seen.append((ctx.sample_idx, ctx.group_size, ctx.task_id, ctx.processor_cache))
        return traj(ctx.sample_idx)

    with workflow_context.use(WorkflowContext(task_id=9)):
        out = await run_group(wf, ScriptedEngine(), {}, 4, stats=StatsRecorder())
    assert sorted(s[0] for s in seen) == [0, 1, 2, 3]
    assert {s[1] for s in seen} == {4} and {s[2] for s in seen} == {9}
    assert len({id(s[3]) for s in seen}) == 1 and seen[0][3] is not None
    assert seen[0][3].closed  # finalized when the group ended
    assert out.input_ids.tolist() == [[0], [1], [2], [3]]  # results land by slot index
    assert workflow_context.get().sample_idx is None


async def test_results_land_by_slot_index_whatever_the_finishing_order():
    async def wf(engine, data):
        i = workflow_context.get().sample_idx
        await trio.sleep(0.01 * (3 - i))  # slot 3 finishes first
        return traj(i)

    out = await run_group(wf, ScriptedEngine(), {}, 4, stats=StatsRecorder())
    assert out.input_ids.flatten().tolist() == [0, 1, 2, 3]


async def test_bad_slot_values_name_the_slot():
    """Values are checked once on the joined batch; a failure is traced back to its slot."""
    bad = {"input_ids": torch.tensor([[-3]]), "attention_mask": torch.tensor([[True]])}
    with pytest.raises(WorkflowContractError, match="^slot 2: 'input_ids': token ids must be non-negative"):
        await run([traj(1), traj(2), bad])
    nan = {**traj(1), "rewards": torch.tensor([float("nan")])}
    with pytest.raises(WorkflowContractError, match="^slot 0: 'rewards': values must be finite"):
        await run([nan, {**traj(2), "rewards": torch.tensor([1.0])}])
