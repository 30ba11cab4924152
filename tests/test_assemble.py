"""Assembling a finished group, synchronously and without Trio (rollout_trio._assemble)."""

from __future__ import annotations

import threading

import pytest
import torch

from rollout_trio import GroupedRolloutWorkflow, RolloutGroup, Trajectory
from rollout_trio import _group
from rollout_trio._assemble import GroupPolicy, GroupStatistics, assemble_group, token_positions
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder

from .group_helpers import I, traj


def row(t: int, reward: float, width: int = 1) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.full((1, width), t),
        "attention_mask": torch.ones(1, width, dtype=torch.bool),
        "rewards": torch.tensor([reward]),
    }


def test_tensor_group_is_merged_and_normalized_outside_any_trio_run() -> None:
    out, stats = assemble_group([row(1, 1.0), None, row(2, 3.0, width=2)], GroupPolicy(3, 2, reward_normalization=True))
    assert isinstance(out, Trajectory)
    assert out.input_ids.tolist() == [[1, 0], [2, 2]]
    # mean 2, population std 1 over the two usable rollouts
    assert out.rewards.tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert out.original_rewards.tolist() == [1.0, 3.0]
    assert out.rollout_group == RolloutGroup((1, 1), (out.rewards[0].item(), out.rewards[1].item()))
    assert stats == GroupStatistics(3, 2, 2)


def test_interaction_group_gets_rollout_indices_in_slot_order() -> None:
    a, b = I(1.0), I(2.0)
    out, stats = assemble_group([{"b": b}, {}, {"a": a}], GroupPolicy(3))
    assert out == {"b": b, "a": a} and (b.rollout_index, a.rollout_index) == (0, 1)
    assert stats == GroupStatistics(3, 2, 2)


def test_dropped_groups_report_their_usable_slots() -> None:
    assert assemble_group([None, None], GroupPolicy(2)) == (None, GroupStatistics(2, 0, 0))
    policy = GroupPolicy(2, drop_incomplete_group=True)
    assert assemble_group([traj(1), None], policy) == (None, GroupStatistics(2, 1, 0))


def test_token_positions_counts_tensors_and_interactions() -> None:
    assert token_positions([row(1, 0.0, width=5), None, {"x": I(1.0)}]) == 5 + 2


@pytest.mark.parametrize(("threshold", "off_thread"), [(0, True), (10**9, False)])
async def test_large_groups_are_assembled_in_a_worker_thread(monkeypatch, threshold, off_thread) -> None:
    threads = []

    def spy(results, policy):
        threads.append(threading.get_ident())
        return assemble_group(results, policy)

    monkeypatch.setattr(_group, "assemble_group", spy)
    monkeypatch.setattr(_group, "INLINE_ASSEMBLY_POSITIONS", threshold)
    results = iter([row(1, 0.0), row(2, 1.0)])

    async def slot(engine, data):
        return next(results)

    out = await GroupedRolloutWorkflow(slot, 2, stats=StatsRecorder()).arun_episode(ScriptedEngine(), {})
    assert out.batch_size == 2
    assert (threads != [threading.get_ident()]) is off_thread and len(threads) == 1
