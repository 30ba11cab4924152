"""join_slots' bulk path for plain one-row dicts (the common shape of a group's results).

The bulk path builds its result without a second validation, so each value rule it skips
would let a broken trajectory through, and each dtype check it inverts would send every
group down the slow path. Both are observable: the bulk path must take the common shape
(``_join_one_row_dicts`` returns a trajectory) and give what the general path gives, and
must hand every rule-breaking or mixed input to the general path (mutation testing, issue 32).
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_trio import Trajectory, WorkflowContractError, concat_trajectories
from rollout_trio._padding import _join_one_row_dicts

from .group_helpers import assert_same_trajectory


def row(ids, *, prompt=1, reward=0.0, **extra):
    n = len(ids)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int64),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * prompt + [1] * (n - prompt)], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * prompt + [-0.5] * (n - prompt)]),
        "versions": torch.tensor([[-1] * prompt + [3] * (n - prompt)], dtype=torch.int32),
        "rewards": torch.tensor([reward]),
        **extra,
    }


def general(items):
    """The general path: Trajectory items never take the bulk path."""
    return concat_trajectories([Trajectory.from_dict(d) for d in items])


@pytest.mark.parametrize(
    "items",
    [
        [row([1, 2, 3], reward=1.0), row([4, 5, 6], reward=0.0)],  # equal widths: stacked
        [row([1, 2]), row([3, 4, 5, 6], prompt=2, reward=2.0), row([7])],  # padded
        [row([1, 2], is_truncated=torch.tensor([True]), original_rewards=torch.tensor([0.5]))] * 2,
        [row([1, 2], rollout_reward=1.0), row([3], rollout_reward=-1.0)],
        [row([5], logprobs=torch.tensor([[1e-7]]))],  # within the logprob tolerance
    ],
)
def test_the_common_shape_takes_the_bulk_path_and_matches_the_general_path(items) -> None:
    fast = _join_one_row_dicts(items)
    assert fast is not None
    assert_same_trajectory(fast, general(items))
    assert_same_trajectory(concat_trajectories(items), general(items))


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"input_ids": torch.tensor([[3, -1]])}, "input_ids"),
        ({"logprobs": torch.tensor([[0.0, 0.5]])}, "logprobs"),
        ({"logprobs": torch.tensor([[0.0, math.nan]])}, "logprobs"),
        ({"logprobs": torch.tensor([[-math.inf, -1.0]])}, "logprobs"),
        ({"rewards": torch.tensor([math.nan])}, "rewards"),
        ({"rewards": torch.tensor([math.inf])}, "rewards"),
        ({"rewards": torch.tensor([-math.inf])}, "rewards"),
        ({"original_rewards": torch.tensor([math.nan])}, "original_rewards"),
        ({"loss_mask": torch.tensor([[0, 2]], dtype=torch.int32)}, "loss_mask"),
        ({"loss_mask": torch.tensor([[-1, 1]], dtype=torch.int32)}, "loss_mask"),
        ({"versions": torch.tensor([[0, 3]], dtype=torch.int32)}, "versions"),
        ({"rollout_reward": math.nan}, "rollout_reward"),
    ],
)
def test_a_broken_rule_in_any_slot_is_reported_for_that_slot(bad, field) -> None:
    good = row([1, 2], original_rewards=torch.tensor([0.0]), rollout_reward=0.0)
    broken = {**good, **bad}
    items = [good, broken, good]
    assert _join_one_row_dicts(items) is None
    with pytest.raises(WorkflowContractError, match=rf"slot 1: .*{field}"):
        concat_trajectories(items)


@pytest.mark.parametrize(
    "change",
    [
        {"input_ids": torch.tensor([[1, 2]], dtype=torch.int32)},  # mixed integer widths: promoted
        {"loss_mask": torch.tensor([[0, 1]], dtype=torch.int64)},
        {"versions": torch.tensor([[-1, 3]], dtype=torch.int64)},
        {"logprobs": torch.tensor([[0.0, -0.5]], dtype=torch.float64)},
        {"rewards": torch.tensor([0.0], dtype=torch.float64)},
        {"attention_mask": torch.tensor([[True, False]])},  # a row with padding of its own
        {"attention_mask": torch.tensor([[1, 1]], dtype=torch.int32)},
        {"input_ids": torch.tensor([[1.0, 2.0]])},
        {"loss_mask": torch.tensor([[0.0, 1.0]])},
        {"versions": torch.tensor([[False, True]])},
        {"logprobs": torch.tensor([[0, -1]])},
        {"rewards": torch.tensor([0])},
        {"is_truncated": torch.tensor([1.0])},
        {"input_ids": torch.tensor([1, 2])},  # one-dimensional
        {"input_ids": torch.tensor([[1, 2], [3, 4]])},  # two rows
        {"rewards": torch.tensor([0.0, 1.0])},
        {"input_ids": [[1, 2]]},  # not a tensor
    ],
)
def test_mixed_or_other_dtypes_and_shapes_leave_it_to_the_general_path(change) -> None:
    base = row([1, 2], is_truncated=torch.tensor([False]))
    other = {**base, **change}
    items = [base, other]
    assert _join_one_row_dicts(items) is None
    try:
        expected = general(items)
    except WorkflowContractError:
        with pytest.raises(WorkflowContractError, match="slot 1"):
            concat_trajectories(items)
    else:
        assert_same_trajectory(concat_trajectories(items), expected)


def test_a_single_kind_of_dtype_everywhere_still_takes_the_bulk_path() -> None:
    # The same (non-default) dtype in every slot is not "mixed": int32 ids, float64 logprobs.
    items = [
        row([1, 2], input_ids=torch.tensor([[1, 2]], dtype=torch.int32), logprobs=torch.tensor([[0.0, -1.0]], dtype=torch.float64)),
        row([3], input_ids=torch.tensor([[3]], dtype=torch.int32), logprobs=torch.tensor([[0.0]], dtype=torch.float64)),
    ]
    fast = _join_one_row_dicts(items)
    assert fast is not None
    assert fast.input_ids.dtype == torch.int32 and fast.logprobs.dtype == torch.float64
    assert_same_trajectory(fast, general(items))


def test_the_dtype_kinds_the_bulk_path_accepts() -> None:
    # Cleared first: the table is memoised per process, and a wrong entry would send every
    # group of that dtype down the slow path (or a float mask down the bulk path).
    from rollout_trio import _padding

    _padding._KIND_OK.clear()
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    ints = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    for dtype in (*floats, *ints, torch.bool, torch.complex64):
        assert _padding._kind_ok("f", dtype) is (dtype in floats), dtype
        assert _padding._kind_ok("b", dtype) is (dtype is torch.bool), dtype
        assert _padding._kind_ok("i", dtype) is (dtype in ints), dtype
    # Memoised: asked again, the same answers.
    assert _padding._KIND_OK[("i", torch.int32)] is True and _padding._KIND_OK[("f", torch.int32)] is False
    assert _padding._kind_ok("i", torch.bool) is False
