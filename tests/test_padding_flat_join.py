"""The packed path's flat join of integer and bool rows (issue 31): rows of unequal widths
are flattened and joined in one C++ call instead of ``torch.cat`` along dim 1. The values,
dtypes and padding must be what joining Trajectory objects one by one (the general path)
gives, for every integer dtype, for rows that are views of larger tensors, and the
packed batch must own its memory (never a view of a slot's tensor)."""

import pytest
import torch

from rollout_trio import Trajectory, concat_trajectories

KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards")


def row(n, *, prompt=1, dtype=torch.int32):
    return {
        "input_ids": torch.arange(1, n + 1, dtype=dtype).view(1, n),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * prompt + [1] * (n - prompt)], dtype=dtype),
        "logprobs": torch.tensor([[0.0] * prompt + [-0.5] * (n - prompt)]),
        "versions": torch.tensor([[-1] * prompt + [3] * (n - prompt)], dtype=dtype),
        "rewards": torch.tensor([float(n)]),
    }


def assert_same(fast, slow):
    for key in KEYS:
        a, b = getattr(fast, key), getattr(slow, key)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    assert fast.rollout_group == slow.rollout_group


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_every_integer_dtype_packs_as_the_general_path_joins(dtype):
    items = [row(n, dtype=dtype) for n in (3, 7, 2, 5)]
    fast = concat_trajectories(items)
    assert_same(fast, concat_trajectories([Trajectory.from_dict(d) for d in items]))
    if dtype.is_signed:  # (uint8 holds -1 as 255 in both paths)
        assert fast.versions.tolist()[2] == [-1, 3, -1, -1, -1, -1, -1]  # -1 on padding


def test_rows_that_are_strided_views_pack_by_value():
    items = [row(n) for n in (4, 6, 3)]
    for d in items:  # every second column of a row twice as wide: non-contiguous [1, n] views
        for key in ("input_ids", "loss_mask", "versions", "attention_mask"):
            wide = d[key].repeat_interleave(2, dim=1)
            d[key] = wide[:, ::2]
            assert not d[key].is_contiguous()
    fast = concat_trajectories(items)
    assert_same(fast, concat_trajectories([Trajectory.from_dict(d) for d in items]))


def test_the_packed_batch_shares_no_memory_with_the_slots():
    items = [row(n) for n in (2, 5)]
    fast = concat_trajectories(items)
    before = fast.input_ids.clone()
    for d in items:
        d["input_ids"].fill_(9)
        d["loss_mask"].zero_()
    assert torch.equal(fast.input_ids, before) and int(fast.loss_mask.sum()) == 5
