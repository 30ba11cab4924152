"""Trajectory validation, conversion and the single-turn row."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_trio import (
    ModelResponse,
    RolloutGroup,
    Trajectory,
    WorkflowContractError,
    check_trajectory_format,
)


def row(**kw):
    d = {
        "input_ids": torch.tensor([[5, 6, 7, 0]], dtype=torch.int32),
        "attention_mask": torch.tensor([[True, True, True, False]]),
        "loss_mask": torch.tensor([[0, 1, 1, 0]], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0, -0.5, -0.25, 0.0]]),
        "versions": torch.tensor([[-1, 3, 3, -1]], dtype=torch.int32),
        "rewards": torch.tensor([1.0]),
    }
    d.update(kw)
    return d


def test_from_dict_and_to_dict_keep_every_key():
    d = row(is_truncated=torch.tensor([False]), rollout_reward=0.5, turn_ids=torch.zeros(1, 4, dtype=torch.int32), uid=["x"])
    t = Trajectory.from_dict(d)
    out = t.to_dict()
    assert set(out) == set(d)
    assert out["rollout_reward"] == 0.5 and out["uid"] == ["x"]
    assert all(out[k] is d[k] for k in ("input_ids", "loss_mask", "turn_ids"))
    assert t.batch_size == 1 and t.seqlen == 4


@pytest.mark.parametrize(
    ("change", "pieces"),
    [
        ({"input_ids": torch.tensor([[5.0, 6.0, 7.0, 0.0]])}, ["'input_ids'", "wrong dtype", "an integer dtype", "torch.float32"]),
        ({"input_ids": torch.tensor([5, 6])}, ["'input_ids'", "2-D", "shape (2,)"]),
        ({"attention_mask": torch.ones(1, 3, dtype=torch.bool)}, ["'attention_mask'", "shape [1, 4]", "shape [1, 3]"]),
        ({"attention_mask": torch.ones(1, 4)}, ["'attention_mask'", "torch.bool", "torch.float32"]),
        ({"attention_mask": torch.tensor([[1, 2, 1, 0]])}, ["'attention_mask'", "only 0 and 1", "[0, 1, 2]"]),
        ({"logprobs": torch.tensor([[0, -1, -1, 0]])}, ["'logprobs'", "a floating dtype", "torch.int64"]),
        ({"logprobs": torch.tensor([[0.0, 0.5, -0.25, 0.0]])}, ["'logprobs'", "<= 0", "max 0.5"]),
        ({"versions": torch.tensor([[-1.0, 3, 3, -1]])}, ["'versions'", "an integer dtype"]),
        ({"loss_mask": torch.tensor([[0, 2, 1, 0]], dtype=torch.int32)}, ["'loss_mask'", "0 or 1", "[0, 1, 2]"]),
        ({"loss_mask": torch.tensor([[0, 1, 1, 1]], dtype=torch.int32)}, ["'loss_mask'", "attention_mask is False"]),
        ({"rewards": torch.tensor(1.0)}, ["'rewards'", "shape [1]", "shape []"]),
        ({"rewards": torch.tensor([float("nan")])}, ["'rewards'", "finite"]),
        ({"rewards": [1.0]}, ["'rewards'", "torch.Tensor", "list"]),
        ({"is_truncated": torch.tensor([1])}, ["'is_truncated'", "torch.bool", "torch.int64"]),
        ({"original_rewards": torch.tensor([[1.0]])}, ["'original_rewards'", "shape [1]"]),
        ({"rollout_reward": True}, ["rollout_reward", "not a bool"]),
        ({"rollout_reward": float("inf")}, ["rollout_reward", "finite"]),
        ({"rollout_reward": np.zeros(2)}, ["rollout_reward", "scalar"]),
        ({"rollout_group": (1,)}, ["'rollout_group'", "RolloutGroup", "tuple"]),
        ({"rollout_group": RolloutGroup((2,))}, ["'rollout_group'", "sum 1", "sum 2"]),
        ({"extra": torch.zeros(2)}, ["'extra'", "leading dim 1"]),
        ({"names": ["a", "b"]}, ["'names'", "length 1", "length 2"]),
    ],
)
def test_every_violation_names_key_rule_and_values(change, pieces):
    with pytest.raises(WorkflowContractError) as info:
        Trajectory.from_dict(row(**change))
    for piece in pieces:
        assert piece in str(info.value)


def test_missing_required_keys_are_named():
    with pytest.raises(WorkflowContractError, match=r"missing required keys \['attention_mask'\]"):
        Trajectory.from_dict({"input_ids": torch.zeros(1, 2, dtype=torch.int64)})


def test_where_prefix_names_the_slot():
    with pytest.raises(WorkflowContractError, match=r"^slot 3: 'rewards'"):
        Trajectory.from_dict(row(rewards=torch.tensor([1])), where="slot 3: ")


def test_accepted_conversions_only():
    t = Trajectory.from_dict(row(attention_mask=torch.tensor([[1, 1, 1, 0]], dtype=torch.int8)))
    assert t.attention_mask.dtype == torch.bool
    t = Trajectory.from_dict(row(input_ids=torch.tensor([[5, 6, 7, 0]], dtype=torch.int16), rollout_reward=np.float64(2.5)))
    assert t.input_ids.dtype == torch.int16  # any integer dtype is kept as is
    assert t.rollout_reward == 2.5 and type(t.rollout_reward) is float
    assert Trajectory.from_dict(row(rollout_reward=torch.tensor(3))).rollout_reward == 3.0


def test_from_response_builds_the_standard_row():
    resp = ModelResponse(
        input_tokens=[1, 2, 3], output_tokens=[4, 5], output_logprobs=[-0.5, -1.5], output_versions=[2, 3], stop_reason="length"
    )
    t = Trajectory.from_response(resp, reward=1.0)
    assert t.input_ids.tolist() == [[1, 2, 3, 4, 5]] and t.input_ids.dtype == torch.int32
    assert t.loss_mask.tolist() == [[0, 0, 0, 1, 1]]
    assert t.logprobs.tolist() == [[0.0, 0.0, 0.0, -0.5, -1.5]] and t.logprobs.dtype == torch.float32
    assert t.versions.tolist() == [[-1, -1, -1, 2, 3]]
    assert t.attention_mask.all() and t.rewards.tolist() == [1.0]
    assert t.is_truncated.tolist() == [True]
    with pytest.raises(WorkflowContractError, match="reward"):
        Trajectory.from_response(resp, reward=float("nan"))


def test_from_response_checks_a_look_alike_response_it_cannot_trust():
    """Only a real ModelResponse skips re-validation: a duck-typed one (an AReaL response,
    a test double) goes through the checking constructor, which names the bad field."""
    fake = SimpleNamespace(
        input_tokens=(1, -2), output_tokens=(3,), output_logprobs=(-0.5,), output_versions=(0,),
        input_len=2, output_len=1, stop_reason="stop",
    )  # fmt: skip
    with pytest.raises(WorkflowContractError, match="'input_ids': token ids must be non-negative"):
        Trajectory.from_response(fake, reward=1.0)  # type: ignore[arg-type]


def test_logical_group_defaults_to_one_rollout_of_all_rows():
    t = Trajectory.from_dict(row(rollout_reward=2.0))
    assert t.logical_group() == RolloutGroup((1,), (2.0,))
    with pytest.raises(WorkflowContractError, match="not both"):
        Trajectory.from_dict(row(rollout_reward=2.0, rollout_group=RolloutGroup((1,))))


def test_check_trajectory_format():
    assert check_trajectory_format(None) is True
    assert check_trajectory_format(row(), batch_size=1, expected_keys={"rewards"}) is True
    with pytest.raises(WorkflowContractError, match="expected None, a dict or a Trajectory"):
        check_trajectory_format([1])
    with pytest.raises(WorkflowContractError, match="empty"):
        check_trajectory_format({})
    with pytest.raises(WorkflowContractError, match="expected 2 rows, got 1"):
        check_trajectory_format(row(), batch_size=2)
    with pytest.raises(WorkflowContractError, match=r"keys \['is_truncated'\] are missing"):
        check_trajectory_format(row(), expected_keys={"is_truncated", "rewards"})
