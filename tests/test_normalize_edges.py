"""rollout_trio._normalize at the edges the example tests left open (found by mutation testing).

Each test compares against an oracle written out here in plain Python floats (float64,
``math.fsum``), or against the same call through another documented path: statistics
in float64 whatever the input dtype, results in float32 whatever torch's default dtype,
masked leave-one-out per element, 2-D groups counted by element, the reward transform's
parts one at a time, the float32 fast path of group normalization against the tensor
path, and the saturation at float32's edge.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_trio import Trajectory
from rollout_trio._assemble import GroupPolicy, assemble_group
from rollout_trio._errors import WorkflowContractError
from rollout_trio._normalize import (
    NormConfig,
    group_mean_std,
    normalize_advantages,
    normalize_rewards,
    rollout_time_affine,
    rollout_time_apply,
    rollout_time_apply_floats,
)
from rollout_trio._rollout_group import RolloutGroup

F32_MAX = float(torch.finfo(torch.float32).max)
GROUPS = NormConfig(mean_level="group", std_level="group", std_unbiased=False, eps=0.0, group_size=2)
BATCH = NormConfig(std_unbiased=False, eps=0.0)
IDENTITY = NormConfig(mean_level=None, std_level=None)


def pop_normalized(values: list[float]) -> list[float]:
    """(v - mean) / population std, in float64."""
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / std for v in values]


# --------------------------------------------------------------------------- group_mean_std


def test_group_mean_std_of_one_group_by_default_and_of_one_value() -> None:
    """No sizes: one group of all values. One value: its mean, std 1 (unbiased) or 0 (population)."""
    mean, std = group_mean_std([1.0, 2.0, 6.0])
    assert mean.tolist() == [3.0] and std.tolist() == pytest.approx([math.sqrt(7.0)])
    assert [t.tolist() for t in group_mean_std([3.0])] == [[3.0], [1.0]]
    assert [t.tolist() for t in group_mean_std([3.0], unbiased=False)] == [[3.0], [0.0]]


def test_group_mean_std_reads_each_group_at_its_own_start() -> None:
    """Three groups of sizes 1, 2, 3: each group's own statistics, in order."""
    mean, std = group_mean_std([5.0, 1.0, 3.0, 2.0, 4.0, 9.0], [1, 2, 3], unbiased=False)
    assert mean.tolist() == [5.0, 2.0, 5.0]
    assert std.tolist() == pytest.approx([0.0, 1.0, math.sqrt(26 / 3)])


def test_group_mean_std_takes_sizes_as_a_tensor() -> None:
    assert group_mean_std([1.0, 3.0], torch.tensor([1, 1]))[0].tolist() == [1.0, 3.0]


# --------------------------------------------------------------------------- advantages


def test_an_empty_batch_is_returned_empty_at_every_level() -> None:
    """Zero rows normalize to zero rows (float32), with batch or group levels, 1-D or 2-D
    (before, a group level raised IndexError from inside the statistics)."""
    for config in (NormConfig(), GROUPS):
        for x in (torch.zeros(0), torch.zeros(0, 3)):
            out = normalize_advantages(x, config)
            assert out.shape == x.shape and out.dtype == torch.float32


def test_two_dim_groups_count_every_element() -> None:
    """Without a mask a group of ``[rows, L]`` has ``rows * L`` elements in its statistics."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0], [0.0, 0.0, 6.0], [2.0, 2.0, 2.0]])
    out = normalize_advantages(x, GROUPS)
    for g in range(2):
        flat = x[2 * g : 2 * g + 2].flatten().tolist()
        assert out[2 * g : 2 * g + 2].flatten().tolist() == pytest.approx(pop_normalized(flat), rel=1e-6)


def test_masked_leave_one_out_is_the_mean_of_the_other_masked_elements() -> None:
    """Each masked element's baseline is the mean of its group's *other* masked elements
    (a group with two masked elements: each is centred on the other); unmasked ones give 0."""
    x = torch.tensor([[1.0, 7.0, 100.0], [3.0, 50.0, 5.0], [2.0, 4.0, 8.0], [6.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1], [0, 1, 0]])
    config = NormConfig(mean_level="group", std_level=None, leave_one_out=True, group_size=2)
    out = normalize_advantages(x, config, mask=mask)
    for g in range(2):
        rows = range(2 * g, 2 * g + 2)
        live = [(r, c) for r in rows for c in range(3) if mask[r, c]]
        for r in rows:
            for c in range(3):
                if not mask[r, c]:
                    assert out[r, c] == 0.0
                    continue
                others = [float(x[i, j]) for i, j in live if (i, j) != (r, c)]
                assert float(out[r, c]) == pytest.approx(float(x[r, c]) - sum(others) / len(others))
    assert out[0, 0] == -2.0 and out[1, 0] == 2.0  # the group of two masked elements


def test_a_mask_may_be_a_nested_list() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = [[1, 0, 1], [1, 1, 0]]
    assert torch.equal(normalize_advantages(x, BATCH, mask=mask), normalize_advantages(x, BATCH, mask=torch.tensor(mask)))


def test_group_sizes_may_be_a_tensor() -> None:
    x = torch.tensor([1.0, 2.0, 4.0, 8.0, 3.0])
    by_list = normalize_advantages(x, GROUPS, group_sizes=[3, 2])
    assert torch.equal(normalize_advantages(x, GROUPS, group_sizes=torch.tensor([3, 2])), by_list)


def test_member_counts_up_to_the_rows_change_nothing_and_are_ignored_without_group_levels() -> None:
    """A member count equal to its group's rows is allowed (one row per rollout) and gives the
    plain result; without a group level the counts select nothing and are not matched to groups."""
    x = torch.tensor([1.0, 2.0, 4.0, 8.0])
    assert torch.equal(normalize_advantages(x, GROUPS, member_counts=[2, 2]), normalize_advantages(x, GROUPS))
    assert torch.equal(
        normalize_advantages(x, BATCH, group_sizes=[2, 2], member_counts=[1]), normalize_advantages(x, BATCH)
    )


def test_population_std_of_a_single_element_is_taken_around_the_baseline() -> None:
    """Biased std over one element is its distance from the baseline (here 0: no mean level),
    not the unbiased rule's 1: 3 / (3 + eps)."""
    config = NormConfig(mean_level=None, std_level="batch", std_unbiased=False, eps=0.5)
    assert normalize_advantages(torch.tensor([3.0]), config).tolist() == pytest.approx([3.0 / 3.5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_advantage_statistics_are_float64_whatever_the_input_dtype(dtype: torch.dtype) -> None:
    """Values near 2**24 in float32 (or as integers): float32 sums would round the mean."""
    values = [16777216.0, 16777218.0, 16777220.0, 16777222.0, 16777230.0]
    out = normalize_advantages(torch.tensor(values, dtype=dtype), BATCH)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx(pop_normalized(values), rel=1e-6)


# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_reward_statistics_are_float64_whatever_the_input_dtype(dtype: torch.dtype) -> None:
    values = [16777216.0, 16777218.0, 16777220.0, 16777222.0, 16777230.0]
    out = normalize_rewards(torch.tensor(values, dtype=dtype), BATCH)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx(pop_normalized(values), rel=1e-6)


def test_python_float_rewards_keep_their_float64_precision() -> None:
    """A list of Python floats is read as float64 (torch would make it float32): two rewards
    float32 cannot tell apart still normalize to -1 and 1, and 1e308 stays finite."""
    assert normalize_rewards([1e8 + 0.5, 1e8 + 1.5], BATCH).tolist() == [-1.0, 1.0]
    assert normalize_advantages([1e8 + 0.5, 1e8 + 1.5], BATCH).tolist() == [-1.0, 1.0]  # type: ignore[arg-type]
    assert group_mean_std([1e8 + 0.5, 1e8 + 1.5], unbiased=False)[1].tolist() == [0.5]


def test_explicit_references_are_kept_in_float64() -> None:
    """Two references float32 cannot tell apart still have std 0.5 (not 0)."""
    refs = (1e8 + 0.5, 1e8 + 1.5)
    out = normalize_rewards(torch.tensor(refs, dtype=torch.float64), BATCH, rollout_groups=[RolloutGroup((1, 1), refs)])
    assert out.tolist() == [-1.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"reward_bias": 0.5}, [-1.5, 0.5, 3.5]),
        ({"reward_bias": 1.0}, [-1.0, 1.0, 4.0]),
        ({"reward_scaling": 2.0}, [-4.0, 0.0, 6.0]),
        ({"reward_clip": 1.0}, [-1.0, 0.0, 1.0]),
        ({"reward_clip": 0.5}, [-0.5, 0.0, 0.5]),
        ({}, [-2.0, 0.0, 3.0]),
    ],
)
def test_each_part_of_the_reward_transform_applies_alone(kwargs: dict[str, float], expected: list[float]) -> None:
    """Bias, scaling and clipping (both signs) each apply on their own; the scores come back float32."""
    for groups in (None, [None]):
        rows = None if groups is None else [3]
        out = normalize_rewards([-2.0, 0.0, 3.0], IDENTITY, rollout_groups=groups, trajectory_rows=rows, **kwargs)
        assert out.dtype == torch.float32 and out.tolist() == expected


def test_finite_rewards_whose_sum_overflows_are_not_called_infinite() -> None:
    """The finiteness check looks at each reward when the sum is not finite: huge finite
    rewards (Python floats, kept in float64 rather than rounded to float32's infinity)
    scaled down normalize like their scaled values."""
    out = normalize_rewards([1e308, 1e308, -1e308], BATCH, reward_scaling=1e-300)
    assert out.tolist() == pytest.approx(normalize_rewards([1e8, 1e8, -1e8], BATCH).tolist())


def test_plain_rows_after_a_group_are_rollouts_of_their_own() -> None:
    """A group's two rollouts, then a trajectory of two plain rows: four references."""
    groups = [RolloutGroup((1, 1), (None, None)), None]
    out = normalize_rewards([1.0, 2.0, 3.0, 4.0], BATCH, rollout_groups=groups, trajectory_rows=[2, 2])
    assert out.tolist() == pytest.approx(pop_normalized([1.0, 2.0, 3.0, 4.0]))


def test_unpenalized_rewards_that_agree_do_not_hide_rewards_that_differ() -> None:
    """Rows of a rollout must agree in their rewards *and* their unpenalized rewards; rows
    that agree in both normalize per rollout."""
    groups = [RolloutGroup((2, 1), (None, None))]
    out = normalize_rewards([1.0, 1.0, 3.0], BATCH, rollout_groups=groups, unpenalized=[2.0, 2.0, 3.0])
    assert out.tolist() == [-1.0, -1.0, 1.0]
    with pytest.raises(WorkflowContractError, match=r"rows 0\.\.1 have rewards \[1\.0, 0\.5\]"):
        normalize_rewards([1.0, 0.5, 3.0], BATCH, rollout_groups=groups, unpenalized=[2.0, 2.0, 3.0])


# --------------------------------------------------------------------------- rollout time


@pytest.mark.parametrize(
    "references", [[1.0, 3.5e38], [-3.5e38, 1.0], [1.0, math.nan], [math.nan, 1.0], [1.0, math.inf]]
)
def test_references_beyond_float32_or_not_finite_are_rejected(references: list[float]) -> None:
    with pytest.raises(ValueError, match="^references: must be finite and within float32's range"):
        rollout_time_affine(references)


def test_rollout_time_std_stays_exact_far_from_zero() -> None:
    """References around 1e9 whose mean is not a float: deviations are taken from the mean
    (not ``v**2 - mean**2``, which cancels to noise at that scale)."""
    refs = [1e9, 1e9 + 1.0, 1e9 + 1.0]
    mean, scale = rollout_time_affine(refs)
    assert float(mean) == float(torch.tensor(1e9 + 2 / 3, dtype=torch.float32))
    assert float(scale) == float(torch.tensor(math.sqrt(2 / 9) + 1e-8, dtype=torch.float32))


@pytest.mark.parametrize(("refs", "scale"), [([0.0, 4.0], 2.0), ([0.0, 2.0], 1.0), ([-3.0, 3.0], 3.0), ([5.0, 5.0], 1.0)])
def test_rollout_time_scale_is_the_rounded_std_whatever_its_value(refs: list[float], scale: float) -> None:
    """The divisor is ``float32(std + 1e-8)`` for a std of any size (a std of 2 rounds to
    exactly 2.0, a std of 1 to 1.0), and 1 for constant references."""
    mean, got = rollout_time_affine(refs)
    assert float(got) == scale
    assert float(mean) == sum(refs) / 2


def test_rollout_time_results_are_float32_whatever_the_default_dtype() -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        mean, scale = rollout_time_affine([1.0, 2.0, 4.0])
        one_mean, one_scale = rollout_time_affine([1.0])
    finally:
        torch.set_default_dtype(previous)
    assert {mean.dtype, scale.dtype, one_mean.dtype, one_scale.dtype} == {torch.float32}


def test_rollout_time_apply_saturates_a_hair_past_float32_on_both_sides() -> None:
    one = torch.ones((), dtype=torch.float32)
    hair = torch.tensor(1.5e32, dtype=torch.float32)  # past half a float32 step at the top, within the margin
    assert rollout_time_apply([F32_MAX], -hair, one).tolist() == [F32_MAX]
    assert rollout_time_apply([-F32_MAX], hair, one).tolist() == [-F32_MAX]


def test_rollout_time_apply_saturates_up_to_its_margin_and_raises_past_it() -> None:
    """A result at most 2**-20 (relative) past float32's largest value is rounding and
    saturates, the margin itself included; the next result past it is an error."""
    one = torch.ones((), dtype=torch.float32)
    step = F32_MAX * 2.0**-20  # a float32: F32_MAX + step is exact in float64
    at_margin = torch.tensor(-step, dtype=torch.float32)
    assert F32_MAX - float(at_margin) == F32_MAX * (1 + 2.0**-20)
    assert rollout_time_apply([F32_MAX], at_margin, one).tolist() == [F32_MAX]
    assert rollout_time_apply([-F32_MAX], -at_margin, one).tolist() == [-F32_MAX]
    past = torch.nextafter(at_margin, torch.tensor(-math.inf))
    with pytest.raises(ValueError, match="beyond float32"):
        rollout_time_apply([F32_MAX], past, one)
    with pytest.raises(ValueError, match="beyond float32"):
        rollout_time_apply([-F32_MAX], -past, one)


def test_rollout_time_apply_floats_declines_only_results_beyond_float32() -> None:
    """The plain-float fast path answers every in-range group itself and hands back None
    (so the caller takes the tensor path) when any result, on either side, lies beyond
    float32's range."""
    assert rollout_time_apply_floats([0.0, 1.0, 3.0], 1.0, 2.0) == [-0.5, 0.0, 1.0]
    assert rollout_time_apply_floats([F32_MAX], 0.0, 1.0) == [F32_MAX]  # the edges themselves are in range
    assert rollout_time_apply_floats([-F32_MAX], 0.0, 1.0) == [-F32_MAX]
    assert rollout_time_apply_floats([F32_MAX, 0.0], -F32_MAX, 1.0) is None  # past the top only
    assert rollout_time_apply_floats([-F32_MAX, 0.0], F32_MAX, 1.0) is None  # past the bottom only


def rows_group(rewards: list[float]) -> list[dict[str, torch.Tensor]]:
    return [
        {"input_ids": torch.tensor([[i + 1]]), "attention_mask": torch.ones(1, 1, dtype=torch.bool),
         "rewards": torch.tensor([r], dtype=torch.float32)}
        for i, r in enumerate(rewards)
    ]  # fmt: skip


@pytest.mark.parametrize("use_std", [True, False])
@pytest.mark.parametrize(
    "rewards",
    [
        [0.0, 1.0, 3.0],
        [2.5, -1.0, 7.0, 7.0],
        [1.7014117838986642e38, 1.7014118853107118e38, -3.402823364973241e38],  # centred a hair past float32
        [-1.7014117838986642e38, -1.7014118853107118e38, 3.402823364973241e38],
    ],
)
def test_group_normalization_of_float32_rows_equals_the_tensor_path(rewards: list[float], use_std: bool) -> None:
    """One float32 row per rollout (normalized in plain floats) gives exactly what
    rollout_time_affine and rollout_time_apply give on the same references: finite,
    saturated at float32's edge where rounding carries a value past it."""
    policy = GroupPolicy(len(rewards), 2, reward_normalization=True, reward_normalization_use_std=use_std)
    out, _ = assemble_group(rows_group(rewards), policy)
    assert isinstance(out, Trajectory) and out.rewards is not None
    refs = torch.tensor(rewards, dtype=torch.float32)
    mean, scale = rollout_time_affine(refs)
    expected = rollout_time_apply(refs, mean, scale if use_std else torch.ones((), dtype=torch.float32))
    assert out.rewards.dtype == torch.float32
    assert out.rewards.tolist() == expected.tolist()
    assert all(math.isfinite(v) for v in out.rewards.tolist())
