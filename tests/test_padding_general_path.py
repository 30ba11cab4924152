"""join_slots' general path and split_trajectories: multi-row items, non-tensor values
compared across slots, devices, and what a split piece keeps (mutation testing, issue 32)."""

from __future__ import annotations

import pytest
import torch

from rollout_trio import RolloutGroup, Trajectory, WorkflowContractError, concat_trajectories, split_trajectories


def rows(ids_rows, **extra):
    ids = torch.tensor(ids_rows, dtype=torch.int64)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "rewards": torch.zeros(ids.shape[0]),
        **extra,
    }


def test_multi_row_items_land_at_their_row_offsets() -> None:
    items = [rows([[1, 2], [3, 4]]), rows([[5], [6]]), rows([[7, 8, 9], [1, 1, 1]])]
    out = concat_trajectories(items)
    assert out.input_ids.tolist() == [[1, 2, 0], [3, 4, 0], [5, 0, 0], [6, 0, 0], [7, 8, 9], [1, 1, 1]]
    assert out.attention_mask.sum(dim=1).tolist() == [2, 2, 1, 1, 3, 3]
    assert out.rollout_group == RolloutGroup((2, 2, 2))


def test_three_dimensional_values_pad_every_dimension() -> None:
    a = rows([[1, 2]], feat=torch.ones(1, 2, 3, dtype=torch.int32))
    b = rows([[3]], feat=torch.full((1, 1, 1), 5, dtype=torch.int32))
    out = concat_trajectories([a, b])
    feat = out.extras["feat"]
    assert feat.shape == (2, 2, 3) and feat.dtype == torch.int32
    assert feat[0].tolist() == [[1, 1, 1], [1, 1, 1]] and feat[1].tolist() == [[5, 0, 0], [0, 0, 0]]


def test_zero_dim_tensor_values_must_be_equal_in_every_slot() -> None:
    same = concat_trajectories([rows([[1]], temp=torch.tensor(0.5)), rows([[2]], temp=torch.tensor(0.5))])
    assert torch.equal(same.extras["temp"], torch.tensor(0.5))
    for other in (torch.tensor(0.7), 0.5, torch.tensor([0.5])):
        with pytest.raises(WorkflowContractError, match="'temp': .*must be equal in every slot; slot 0 has"):
            concat_trajectories([rows([[1]], temp=torch.tensor(0.5)), rows([[2]], temp=other)])


class _NoBoolEq:
    def __eq__(self, other: object) -> bool:
        raise ValueError("ambiguous")

    __hash__ = object.__hash__


def test_values_whose_equality_is_not_a_bool_compare_by_identity() -> None:
    shared = _NoBoolEq()
    out = concat_trajectories([rows([[1]], meta=shared), rows([[2]], meta=shared)])
    assert out.extras["meta"] is shared
    with pytest.raises(WorkflowContractError, match="'meta': non-tensor values must be equal"):
        concat_trajectories([rows([[1]], meta=shared), rows([[2]], meta=_NoBoolEq())])


def test_a_tensor_or_list_in_slot_0_only_is_named() -> None:
    with pytest.raises(WorkflowContractError, match="'feat': a tensor in slot 0 but not in every slot"):
        concat_trajectories([rows([[1]], feat=torch.zeros(1, 2)), rows([[2]], feat=3)])
    with pytest.raises(WorkflowContractError, match="'uid': a list in slot 0 but not in every slot"):
        concat_trajectories([rows([[1]], uid=["a"]), rows([[2]], uid="b")])


def test_a_slot_on_another_device_is_named_before_validation() -> None:
    foreign = rows([[2]])
    foreign["input_ids"] = foreign["input_ids"].to("meta")
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'input_ids': every slot's tensors must be on one device; expected cpu \(slot 0\), got meta"):
        concat_trajectories([rows([[1]]), foreign])


def test_differing_keys_name_the_first_slot() -> None:
    with pytest.raises(WorkflowContractError, match="slot 2: has different keys than slot 0"):
        concat_trajectories([rows([[1]]), rows([[2]]), rows([[3]], extra=1)])


def test_split_pieces_keep_their_rollout_references() -> None:
    joined = concat_trajectories(
        [Trajectory.from_dict(rows([[1, 2]], rollout_reward=1.5)), Trajectory.from_dict(rows([[3]], rollout_reward=2.5)),
         Trajectory.from_dict(rows([[4]], rollout_reward=-1.0))]
    )  # fmt: skip
    one, two = split_trajectories(joined, [1, 2])
    assert one.rollout_reward == 1.5 and one.rollout_group is None and one.extras == {}
    assert one.input_ids.tolist() == [[1, 2]]
    assert two.rollout_group == RolloutGroup((1, 1), (2.5, -1.0)) and two.extras == {}
    assert two.input_ids.tolist() == [[3], [4]]  # trimmed to the last attended position
    assert [p.input_ids.tolist() for p in split_trajectories(joined, [1, 2], widths=[2, 2])] == [[[1, 2]], [[3, 0], [4, 0]]]


@pytest.mark.parametrize("counts", [[2, 0], [3, -1], [True, 1], [1.0, 1], []])
def test_split_counts_must_be_positive_integers(counts) -> None:
    joined = concat_trajectories([rows([[1]]), rows([[2]])])
    with pytest.raises(WorkflowContractError, match="row_counts: must be positive integers"):
        split_trajectories(joined, counts)


def test_split_widths_one_per_piece() -> None:
    joined = concat_trajectories([rows([[1]]), rows([[2]])])
    with pytest.raises(WorkflowContractError, match="widths: one per piece; expected 2, got 1"):
        split_trajectories(joined, [1, 1], widths=[1])


def test_a_piece_trimmed_to_nothing_is_named_in_the_error() -> None:
    joined = concat_trajectories([rows([[1, 2]]), rows([[3]])])
    with pytest.raises(WorkflowContractError, match=r"^piece 1: 'input_ids': must hold at least one position"):
        split_trajectories(joined, [1, 1], widths=[2, 0])


def test_a_single_rollout_of_several_rows_splits_whole_and_keeps_its_reference() -> None:
    traj = Trajectory.from_dict(rows([[1, 2], [3, 4]], rollout_reward=0.25, uid=["a", "b"]))
    assert traj.rollout_group is None
    (piece,) = split_trajectories(traj, [2])
    assert piece.rollout_reward == 0.25 and piece.extras["uid"] == ["a", "b"]
    assert piece.input_ids.tolist() == [[1, 2], [3, 4]]


def test_split_slices_list_values_with_their_rows() -> None:
    joined = concat_trajectories([rows([[1]], uid=["a"]), rows([[2]], uid=["b"]), rows([[3]], uid=["c"])])
    assert [p.extras["uid"] for p in split_trajectories(joined, [2, 1])] == [["a", "b"], ["c"]]


def test_an_empty_list_is_reported_by_name() -> None:
    with pytest.raises(WorkflowContractError, match=r"^concat_trajectories: needs at least one trajectory, got an empty list$"):
        concat_trajectories([])
