"""concat_trajectories and split_trajectories (spec/group.md §4 with DESIGN.md's padding)."""

import pytest
import torch

from rollout_trio import RolloutGroup, Trajectory, WorkflowContractError, concat_trajectories, split_trajectories


def traj(ids, *, prompt=1, reward=0.0, dtype=torch.int32, **extra):
    n = len(ids)
    return {
        "input_ids": torch.tensor([ids], dtype=dtype),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * prompt + [1] * (n - prompt)], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * prompt + [-1.0] * (n - prompt)]),
        "versions": torch.tensor([[-1] * prompt + [4] * (n - prompt)], dtype=torch.int32),
        "rewards": torch.tensor([reward]),
        **extra,
    }


def test_pads_each_key_with_its_own_value():
    out = concat_trajectories([traj([1, 2]), traj([3, 4, 5, 6])])
    assert out.input_ids.tolist() == [[1, 2, 0, 0], [3, 4, 5, 6]]
    assert out.attention_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert out.loss_mask.tolist() == [[0, 1, 0, 0], [0, 1, 1, 1]]
    assert out.logprobs.tolist() == [[0.0, -1.0, 0.0, 0.0], [0.0, -1.0, -1.0, -1.0]]
    assert out.versions.tolist() == [[-1, 4, -1, -1], [-1, 4, 4, 4]]  # -1 on padding, not 0
    assert out.rewards.tolist() == [0.0, 0.0]
    assert out.rollout_group == RolloutGroup((1, 1))


def test_versions_are_minus_one_wherever_loss_mask_is_zero():
    out = concat_trajectories([traj([1, 2, 3], prompt=2), traj([1]), traj([9, 9, 9, 9, 9], prompt=3)])
    assert bool((out.versions[out.loss_mask == 0] == -1).all())


def test_integer_dtypes_promote_to_the_widest():
    out = concat_trajectories([traj([1, 2]), traj([3], dtype=torch.int64)])
    assert out.input_ids.dtype == torch.int64


def test_lists_concatenate_and_equal_scalars_are_kept():
    out = concat_trajectories([traj([1], uid=["a"], task="t"), traj([2], uid=["b"], task="t")])
    assert out.extras["uid"] == ["a", "b"] and out.extras["task"] == "t"


def test_key_mismatch_names_the_slot_and_keys():
    with pytest.raises(WorkflowContractError, match=r"slot 1: has different keys.*missing \['rewards'\] and extra \['score'\]"):
        bad = traj([2])
        bad["score"] = bad.pop("rewards")
        concat_trajectories([traj([1]), bad])


def test_differing_non_tensor_values_are_an_error():
    with pytest.raises(WorkflowContractError, match="'task': non-tensor values must be equal.*slot 1 has 'u'"):
        concat_trajectories([traj([1], task="t"), traj([2], task="u")])


def test_dimension_mismatch_is_an_error():
    with pytest.raises(WorkflowContractError, match="'feat': dimension mismatch"):
        concat_trajectories([traj([1], feat=torch.zeros(1, 2)), traj([2], feat=torch.zeros(1, 2, 2))])


def test_empty_list_is_an_error():
    with pytest.raises(WorkflowContractError, match="empty list"):
        concat_trajectories([])


def test_bad_slot_is_named():
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'rewards'"):
        concat_trajectories([traj([1]), traj([2], rewards=torch.tensor(1.0))])


def test_rollout_references_travel_with_their_rows():
    a = Trajectory.from_dict(traj([1, 2], rollout_reward=1.5))
    two = concat_trajectories([traj([3]), traj([4])])  # already two logical rollouts
    out = concat_trajectories([a, two])
    assert out.rollout_group == RolloutGroup((1, 1, 1), (1.5, None, None))


def test_split_inverts_concat():
    items = [traj([1, 2]), traj([3, 4, 5, 6], reward=1.0), traj([7], reward=2.0)]
    out = concat_trajectories(items)
    pieces = split_trajectories(out, [1, 1, 1])
    for piece, item in zip(pieces, items):
        for key, value in item.items():
            assert torch.equal(piece.to_dict()[key], value), key


def test_split_with_widths_keeps_trailing_padding():
    a = traj([1, 2])
    a["attention_mask"] = torch.tensor([[True, False]])
    a["loss_mask"] = torch.tensor([[0, 0]], dtype=torch.int32)
    a["logprobs"] = torch.zeros(1, 2)
    a["versions"] = torch.tensor([[-1, -1]], dtype=torch.int32)
    out = concat_trajectories([a, traj([3, 4, 5])])
    assert split_trajectories(out, [1, 1])[0].seqlen == 1
    assert split_trajectories(out, [1, 1], widths=[2, 3])[0].seqlen == 2


def test_split_rejects_cuts_inside_a_rollout_and_bad_counts():
    out = concat_trajectories([traj([1]), traj([2])])
    grouped = Trajectory.from_dict({**out.to_dict(), "rollout_group": RolloutGroup((2,))})
    with pytest.raises(WorkflowContractError, match="cuts a logical rollout"):
        split_trajectories(grouped, [1, 1])
    with pytest.raises(WorkflowContractError, match="must sum to the rows; expected 2, got 3"):
        split_trajectories(out, [1, 2])
    with pytest.raises(WorkflowContractError, match="positive integers"):
        split_trajectories(out, [0, 2])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_non_finite_reward_in_any_slot_of_a_packed_group_is_named(bad, at):
    """Plain one-row dicts are packed in bulk and their rewards checked once over the
    packed rows: a NaN or infinity anywhere (not only where min/max would see it) still
    reaches the per-slot check, which names the slot."""
    from rollout_trio import RewardValueError

    items = [traj([1, 2, 3], reward=1.0), traj([4, 5]), traj([6, 7, 8, 9], reward=-1.0)]
    items[at] = {**items[at], "rewards": torch.tensor([bad])}
    with pytest.raises(RewardValueError, match=f"^slot {at}: 'rewards': values must be finite"):
        concat_trajectories(items)


def test_a_packed_group_is_what_joining_trajectory_objects_gives():
    """Unequal widths (padded) and equal widths (stacked), packed in bulk as dicts or
    joined one by one as Trajectory objects: the same tensors, dtypes and references."""
    for lengths in ([2, 4, 3], [3, 3, 3]):
        items = [traj(list(range(1, n + 1)), reward=float(n)) for n in lengths]
        fast = concat_trajectories(items)
        slow = concat_trajectories([Trajectory.from_dict(d) for d in items])
        for key in ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards"):
            a, b = getattr(fast, key), getattr(slow, key)
            assert a.dtype == b.dtype and torch.equal(a, b), key
        assert fast.rollout_group == slow.rollout_group
