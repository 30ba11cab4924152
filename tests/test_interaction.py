"""Interaction tensors and interactions_to_trajectory (spec/executor.md §1.3, spec/group.md §5.3)."""

import pytest
import torch

from rollout_trio import Interaction, ModelResponse, RolloutGroup, WorkflowContractError, interactions_to_trajectory


def resp(inp, out, stop="stop", version=0):
    return ModelResponse(
        input_tokens=inp, output_tokens=out, output_logprobs=[-0.5] * len(out), output_versions=[version] * len(out), stop_reason=stop
    )


def test_hf_row_layout_and_defaults():
    i = Interaction(model_response=resp([1, 2], [3, 4], stop="length"), reward=None)
    t = i.to_trajectory()
    assert t.input_ids.tolist() == [[1, 2, 3, 4]]
    assert t.loss_mask.tolist() == [[0, 0, 1, 1]]
    assert t.versions.tolist() == [[-1, -1, 0, 0]]
    assert t.rewards.tolist() == [0.0] and t.original_rewards.tolist() == [0.0]
    assert t.is_truncated.tolist() == [True]
    assert i.to_trajectory() is t and i.cache is t and i.has_tensor_data


def test_original_reward_is_kept_in_the_row():
    t = Interaction(model_response=resp([1], [2]), reward=0.5, original_reward=2.0).to_trajectory()
    assert t.rewards.tolist() == [0.5] and t.original_rewards.tolist() == [2.0]


def test_concat_mode_extends_the_parent_row():
    parent = Interaction(model_response=resp([1, 2], [3], version=1))
    child = Interaction(model_response=resp([1, 2, 3, 9], [5, 6], version=2), parent=parent, chat_template_type="concat")
    t = child.to_trajectory()
    assert t.input_ids.tolist() == [[1, 2, 3, 9, 5, 6]]
    assert t.loss_mask.tolist() == [[0, 0, 1, 0, 1, 1]]
    assert t.versions.tolist() == [[-1, -1, 1, -1, 2, 2]]


def test_model_response_is_required_for_tensors():
    i = Interaction(reward=1.0)
    assert not i.has_tensor_data
    with pytest.raises(WorkflowContractError, match="model_response"):
        i.to_trajectory()


def test_rollouts_are_bucketed_by_rollout_index_with_their_references():
    """spec/group.md case 18: rows [1, 2, 3], groups (2, 1), reference 1.0 for the first rollout."""
    a = Interaction(model_response=resp([1], [2]), reward=1.0, rollout_index=0)
    c = Interaction(model_response=resp([1], [2]), reward=3.0, rollout_index=1)
    b = Interaction(model_response=resp([1], [2]), reward=2.0, rollout_reward=1.0, rollout_index=0)
    t = interactions_to_trajectory({"a": a, "c": c, "b": b})
    assert t.rewards.tolist() == [1.0, 2.0, 3.0]  # rows of one rollout are contiguous
    assert t.rollout_group == RolloutGroup((2, 1), (1.0, None))


def test_conflicting_references_in_one_rollout():
    a = Interaction(model_response=resp([1], [2]), reward=1.0, rollout_reward=1.0)
    b = Interaction(model_response=resp([1], [2]), reward=2.0, rollout_reward=2.0)
    with pytest.raises(WorkflowContractError, match="must share rollout_reward"):
        interactions_to_trajectory({"a": a, "b": b})


def test_bad_inputs():
    with pytest.raises(WorkflowContractError, match="empty dict"):
        interactions_to_trajectory({})
    with pytest.raises(WorkflowContractError, match=r"interactions\['x'\]: must be an Interaction"):
        interactions_to_trajectory({"x": {"input_ids": torch.zeros(1, 1)}})
