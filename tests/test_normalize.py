"""Example tests for rollout_trio._normalize: spec/group.md §14 cases 15-16, 24-31, 35-42.

Unless a test says otherwise the config is the spec's ``_norm``: group mean, group std,
biased, eps 0. Expected numbers are the spec's, written out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout_trio._errors import WorkflowContractError
from rollout_trio._normalize import (
    NormConfig,
    group_mean_std,
    normalize_advantages,
    normalize_rewards,
    rollout_time_affine,
    rollout_time_apply,
)
from rollout_trio._rollout_group import RolloutGroup

SQRT_HALF = math.sqrt(0.5)


def norm(**changes: object) -> NormConfig:
    """The spec's ``_norm`` (group/group, biased, eps 0) with ``changes``."""
    fields: dict[str, object] = {"mean_level": "group", "std_level": "group", "std_unbiased": False, "eps": 0.0}
    fields.update(changes)
    return NormConfig(**fields)  # type: ignore[arg-type]


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-4) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == (len(expected),)
    assert actual.tolist() == pytest.approx(expected, abs=tol)


# --------------------------------------------------------------------------- NormConfig


def test_norm_config_defaults_follow_the_spec_table() -> None:
    cfg = NormConfig()
    assert (cfg.mean_level, cfg.std_level) == ("batch", "batch")
    assert (cfg.leave_one_out, cfg.std_unbiased, cfg.eps, cfg.group_size) == (False, True, 1e-5, 1)
    assert not cfg.uses_group_level and not cfg.is_identity
    assert NormConfig(mean_level=None, std_level=None).is_identity
    assert NormConfig(std_level="group").uses_group_level


@pytest.mark.parametrize(
    ("changes", "field", "rule"),
    [
        ({"mean_level": "none"}, "NormConfig.mean_level", "'batch', 'group' or None"),
        ({"std_level": "token"}, "NormConfig.std_level", "'batch', 'group' or None"),
        ({"std_level": True}, "NormConfig.std_level", "'batch', 'group' or None"),
        ({"leave_one_out": 1}, "NormConfig.leave_one_out", "must be a bool"),
        ({"std_unbiased": "yes"}, "NormConfig.std_unbiased", "must be a bool"),
        ({"eps": -1e-5}, "NormConfig.eps", ">= 0"),
        ({"eps": float("nan")}, "NormConfig.eps", "finite"),
        ({"mean_level": "group", "group_size": 0}, "NormConfig.group_size", "integer >= 1 (a group level is used)"),
        ({"group_size": 2.0}, "NormConfig.group_size", "integer >= 1"),
        ({"group_size": True}, "NormConfig.group_size", "integer >= 1"),
    ],
)
def test_norm_config_rejects_invalid_fields_naming_them(changes: dict[str, object], field: str, rule: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        NormConfig(**changes)  # type: ignore[arg-type]
    assert rule in str(info.value)


def test_norm_config_is_frozen_and_stores_plain_numbers() -> None:
    cfg = NormConfig(eps=0, group_size=4)
    assert type(cfg.eps) is float and type(cfg.group_size) is int
    with pytest.raises(AttributeError):
        cfg.eps = 1.0  # type: ignore[misc]


# --------------------------------------------------------------------------- trainer reward normalization


@pytest.mark.parametrize("counts", [(1, 1), (3, 1), (1, 4)])
def test_case_24_row_counts_do_not_reweight(counts: tuple[int, int]) -> None:
    c0, c1 = counts
    out = normalize_rewards(torch.tensor([1.0] * c0 + [3.0] * c1), norm(), rollout_groups=[RolloutGroup(counts)])
    assert out.tolist() == [-1.0] * c0 + [1.0] * c1


@pytest.mark.parametrize(
    ("loo", "unbiased", "expected"),
    [
        (False, False, [-1.0, 0.0, 1.0]),
        (False, True, [-SQRT_HALF, 0.0, SQRT_HALF]),
        (True, False, [-1.0, -0.5, 1.0]),  # centres 3, 3, 1; scale 2
        (True, True, [-SQRT_HALF, -SQRT_HALF / 2, SQRT_HALF]),  # scale 2*sqrt(2)
    ],
)
def test_case_25_explicit_reference_loo_and_bias_matrix(loo: bool, unbiased: bool, expected: list[float]) -> None:
    out = normalize_rewards(
        torch.tensor([1.0, 2.0, 3.0]),
        norm(leave_one_out=loo, std_unbiased=unbiased),
        rollout_groups=[RolloutGroup((2, 1), (1.0, None))],
    )
    close(out, expected, 1e-5)


@pytest.mark.parametrize(
    ("mean_level", "std_level", "expected"),
    [
        ("batch", "group", [-1.2649, -0.9487, -0.6325, 0.2774, 1.3868, 1.6641]),
        ("group", "batch", [-0.6325, 0.0, 0.6325, -1.2649, 1.2649, 1.8974]),
        ("batch", "batch", [-1.1795, -0.8847, -0.5898, 0.2949, 1.4744, 1.7693]),
    ],
)
def test_case_26_mixed_levels(mean_level: str, std_level: str, expected: list[float]) -> None:
    out = normalize_rewards(
        torch.tensor([1.0, 2.0, 3.0, 6.0, 10.0, 11.0]),
        norm(mean_level=mean_level, std_level=std_level),
        rollout_groups=[RolloutGroup((2, 1), (1, 3)), RolloutGroup((1, 2), (6, 10))],
    )
    close(out, expected)


def test_case_26_logical_group_sizes_come_from_the_groups() -> None:
    rows = torch.tensor([1.0, 2.0, 3.0, 6.0, 10.0, 11.0])
    groups = [RolloutGroup((2, 1), (1, 3)), RolloutGroup((1, 2), (6, 10))]
    same = normalize_rewards(rows, norm(), rollout_groups=groups, group_sizes=[2, 2])
    assert torch.equal(same, normalize_rewards(rows, norm(), rollout_groups=groups))
    with pytest.raises(ValueError, match=r"group_sizes: must equal the logical rollouts per trajectory \[2, 2\]"):
        normalize_rewards(rows, norm(), rollout_groups=groups, group_sizes=[3, 3])


def test_case_27_differing_rows_without_reference_is_a_contract_error() -> None:
    with pytest.raises(WorkflowContractError, match="supply an explicit rollout_reward") as info:
        normalize_rewards(torch.tensor([1.0, 2.0, 3.0]), norm(), rollout_groups=[RolloutGroup((2, 1))])
    assert isinstance(info.value, ValueError)  # DESIGN decision 5; the reference raised RuntimeError
    message = str(info.value)
    assert "Split rollout row rewards differ" in message
    assert "rollout 0 of trajectory 0" in message and "[1.0, 2.0]" in message


@pytest.mark.parametrize("std_level", ["group", "batch"])
@pytest.mark.parametrize("d", [0.0, 2.0**-10, 2.0**-9])
def test_case_28_degenerate_scale_is_exact(std_level: str, d: float) -> None:
    eps = 2.0**-10
    rows = [-1.0, -d, d]
    out = normalize_rewards(
        torch.tensor(rows),
        norm(std_level=std_level, eps=eps),
        rollout_groups=[RolloutGroup((2, 1), (-d, d))],
    )
    div = 1.0 if d <= eps else d + eps
    assert out.tolist() == [torch.tensor(r / div, dtype=torch.float32).item() for r in rows]


@pytest.mark.parametrize(
    ("mean_level", "std_level", "expected"),
    [
        ("group", "group", [-1.0, 0.0, 0.0, -1.0, 0.0, 0.0]),  # rows - [1,1,1,5,5,5], divisor 1
        ("group", "batch", [-1.0, 0.0, 0.0, -1.0, 0.0, 0.0]),
        ("batch", "group", [-1.5, -1.0, -1.0, 0.5, 1.0, 1.0]),  # (rows - 3) / 2
    ],
)
def test_case_29_tied_references(mean_level: str, std_level: str, expected: list[float]) -> None:
    out = normalize_rewards(
        torch.tensor([0.0, 1.0, 1.0, 4.0, 5.0, 5.0]),
        norm(mean_level=mean_level, std_level=std_level),
        rollout_groups=[RolloutGroup((2, 1), (1, 1)), RolloutGroup((2, 1), (5, 5))],
    )
    assert out.tolist() == expected


def test_case_32_reward_part_bias_scaling_clip_and_references() -> None:
    # Penalized rows [0, 2, 3.5] (the actor's overlong penalty is out of scope), bias 1,
    # scaling 2, clip 8: scores [2, 6, 8]; references (1, 4) -> [4, 8]; mean 6, std 2.
    out = normalize_rewards(
        torch.tensor([0.0, 2.0, 3.5]),
        norm(),
        rollout_groups=[RolloutGroup((2, 1), (1, 4))],
        reward_bias=1.0,
        reward_scaling=2.0,
        reward_clip=8.0,
        unpenalized=torch.tensor([1.0, 2.0, 4.0]),
    )
    assert out.tolist() == [-2.0, 0.0, 1.0]


def test_case_35_statistics_disabled_returns_scores_unchanged() -> None:
    rows = torch.tensor([1.0, 2.0, 7.0])
    off = NormConfig(mean_level=None, std_level=None)
    out = normalize_rewards(rows, off, rollout_groups=[RolloutGroup((2, 1))])  # rows may differ, no ref needed
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 2.0, 7.0]
    scored = normalize_rewards(rows, off, reward_bias=1.0, reward_scaling=2.0, reward_clip=10.0)
    assert scored.tolist() == [4.0, 6.0, 10.0]


def test_case_36_penalty_cannot_hide_different_raw_rewards() -> None:
    penalized = torch.tensor([0.0, 0.0, 3.0])
    groups = [RolloutGroup((2, 1))]
    normalize_rewards(penalized, norm(), rollout_groups=groups)  # equal penalized rows alone are fine
    with pytest.raises(WorkflowContractError, match="explicit rollout_reward") as info:
        normalize_rewards(penalized, norm(), rollout_groups=groups, unpenalized=torch.tensor([1.0, 0.0, 3.0]))
    assert "unpenalized [1.0, 0.0]" in str(info.value)


def test_case_37_integer_rows_keep_a_fractional_reference() -> None:
    out = normalize_rewards(torch.tensor([1, 2, 3]), norm(), rollout_groups=[RolloutGroup((2, 1), (1.5, None))])
    close(out, [-5 / 3, -1 / 3, 1.0], 1e-6)


def test_rewards_std_at_most_eps_keeps_centering_with_divisor_one() -> None:
    # One group, references 2 and 2 (explicit), rows differ: std 0 <= eps -> divisor 1.
    out = normalize_rewards(
        torch.tensor([1.0, 4.0, 2.0]),
        NormConfig(mean_level="group", std_level="group", eps=1e-5),
        rollout_groups=[RolloutGroup((2, 1), (2.0, None))],
    )
    assert out.tolist() == [-1.0, 2.0, 0.0]


def test_rewards_trajectory_without_group_is_one_rollout_per_row() -> None:
    rows = torch.tensor([1.0, 3.0, 5.0, 5.0, 9.0])
    out = normalize_rewards(
        rows, norm(), rollout_groups=[None, RolloutGroup((2, 1))], trajectory_rows=[2, 3]
    )  # groups: refs [1, 3] and [5, 9]
    assert out.tolist() == [-1.0, 1.0, -1.0, -1.0, 1.0]
    with pytest.raises(ValueError, match="trajectory_rows: required when rollout_groups holds None"):
        normalize_rewards(rows, norm(), rollout_groups=[None, RolloutGroup((2, 1))])


def test_rewards_without_groups_use_group_sizes_or_the_fixed_group_size() -> None:
    rows = torch.tensor([0.0, 3.0, 6.0, 10.0, 20.0, 1.0, 2.0, 3.0])
    close(
        normalize_rewards(rows, norm(), group_sizes=[3, 2, 3]),
        [-1.2247, 0.0, 1.2247, -1.0, 1.0, -1.2247, 0.0, 1.2247],
    )
    four = torch.tensor([1.0, 3.0, 10.0, 20.0])
    assert torch.equal(
        normalize_rewards(four, norm(group_size=2)), normalize_rewards(four, norm(), group_sizes=[2, 2])
    )
    with pytest.raises(ValueError, match="NormConfig.group_size: 4 logical rollouts do not split into groups of 3"):
        normalize_rewards(four, norm(group_size=3))


def test_rewards_singleton_group_with_loo_normalizes_to_zero() -> None:
    out = normalize_rewards(
        torch.tensor([4.0, 4.0, 1.0, 3.0]),
        NormConfig(mean_level="group", std_level="group", leave_one_out=True),
        rollout_groups=[RolloutGroup((2,)), RolloutGroup((1, 1))],
    )
    close(out, [0.0, 0.0, -SQRT_HALF, SQRT_HALF], 1e-5)  # pair: LOO centres 3, 1; unbiased std sqrt(8)


def test_rewards_result_is_float32_and_inputs_are_not_mutated() -> None:
    rows = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    before = rows.clone()
    out = normalize_rewards(rows, norm(), rollout_groups=[RolloutGroup((2, 1), (1.0, None))])
    assert out.dtype == torch.float32 and torch.equal(rows, before)
    assert normalize_rewards(torch.zeros(0), norm()).shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"rewards": torch.ones(2, 1)}, ValueError, r"rewards: must be 1-D"),
        ({"rewards": torch.tensor([1.0, float("nan")])}, ValueError, "rewards: must be finite"),
        ({"rewards": torch.tensor([True, False])}, ValueError, "rewards: must hold real numbers"),
        ({"unpenalized": torch.ones(3)}, ValueError, r"unpenalized: must have the shape of rewards \(2,\)"),
        ({"reward_clip": 0.0}, ValueError, "reward_clip: must be a real number > 0"),
        ({"reward_scaling": float("inf")}, ValueError, "reward_scaling: must be a finite real number"),
        ({"reward_bias": None}, ValueError, "reward_bias: must be a finite real number"),
        ({"rollout_groups": RolloutGroup((2,))}, TypeError, "got a single RolloutGroup"),
        ({"rollout_groups": [(1, 1)]}, TypeError, r"rollout_groups\[0\]: must be a RolloutGroup or None"),
        ({"rollout_groups": [RolloutGroup((1, 2))]}, ValueError, "rewards: has 2 rows but rollout_groups cover 3 rows"),
        ({"rollout_groups": [RolloutGroup((2,))], "trajectory_rows": [3]}, WorkflowContractError, "expected 3"),
        ({"rollout_groups": [RolloutGroup((2,))], "trajectory_rows": [1, 1]}, ValueError, "one row count per trajectory"),
        ({"trajectory_rows": [2]}, ValueError, "trajectory_rows: only meaningful together with rollout_groups"),
    ],
)
def test_rewards_reject_bad_arguments_naming_them(kwargs: dict[str, object], error: type, pattern: str) -> None:
    call: dict[str, object] = {"rewards": torch.tensor([1.0, 1.0])}
    call.update(kwargs)
    rewards = call.pop("rewards")
    with pytest.raises(error, match=pattern):
        normalize_rewards(rewards, norm(), **call)  # type: ignore[arg-type]


@pytest.mark.parametrize("fn", ["rewards", "advantages"])
def test_case_41_bad_group_sizes(fn: str) -> None:
    call = normalize_rewards if fn == "rewards" else normalize_advantages
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="must equal") as info:
        call(x, norm(), group_sizes=[2, 3])
    assert "group_sizes" in str(info.value)
    with pytest.raises(ValueError, match="group_sizes: must be positive"):
        call(x, norm(), group_sizes=[4, 0])


# --------------------------------------------------------------------------- advantages (plain Normalization call)


def test_case_30_advantages_stay_token_weighted() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0], [4.0, 5.0, 6.0]])
    mask = x < 100
    out = normalize_advantages(x, norm(leave_one_out=True), mask=mask, group_sizes=[3], member_counts=[2])
    assert out.dtype == torch.float32 and out.shape == (3, 3)
    assert out[mask].tolist() == pytest.approx([-1.46385, -0.87831, -0.29277, 0.29277, 0.87831, 1.46385], abs=1e-5)
    assert (out[~mask] == 0).all()
    # baseline (21 - x)/5 and scale sqrt(4.2), checked against the mask-free formula:
    xs = x[mask].double()
    assert out[mask].double().tolist() == pytest.approx(((xs - (21 - xs) / 5) / math.sqrt(4.2)).tolist(), abs=1e-6)


def test_case_31_logical_singleton_gives_zeros() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = normalize_advantages(
        x, norm(leave_one_out=True, std_unbiased=True), mask=torch.ones(2, 2), group_sizes=[2], member_counts=[1]
    )
    assert out.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    # Without the member count the two rows are two members: not zero.
    assert normalize_advantages(x, norm(leave_one_out=True, std_unbiased=True), group_sizes=[2]).abs().sum() > 0


def test_case_38_variable_group_sizes() -> None:
    x = torch.tensor([0.0, 3.0, 6.0, 10.0, 20.0, 1.0, 2.0, 3.0])
    out = normalize_advantages(x, norm(), group_sizes=[3, 2, 3])
    close(out, [-1.2247, 0.0, 1.2247, -1.0, 1.0, -1.2247, 0.0, 1.2247])
    for part in torch.split(out, [3, 2, 3]):
        assert abs(part.double().mean().item()) < 1e-6
    four = torch.tensor([1.0, 3.0, 10.0, 20.0])
    assert torch.equal(normalize_advantages(four, norm(group_size=2)), normalize_advantages(four, norm(), group_sizes=[2, 2]))


def test_case_39_zero_variance_group_has_no_eps_fallback() -> None:
    out = normalize_advantages(torch.tensor([0.0, 3.0, 6.0, 5.0, 5.0]), norm(eps=1e-5), group_sizes=[3, 2])
    assert torch.isfinite(out).all()
    assert out[3].item() == 0.0 and out[4].item() == 0.0


def test_plain_call_divides_by_std_plus_eps_while_rewards_fall_back_to_one() -> None:
    eps, h = 2.0**-10, 2.0**-21  # values 0 and 2h: std h <= eps
    x = torch.tensor([0.0, 2 * h])
    plain = normalize_advantages(x, norm(eps=eps), group_sizes=[2])
    assert plain.tolist() == pytest.approx([-h / (h + eps), h / (h + eps)], rel=1e-6)
    assert normalize_rewards(x, norm(eps=eps), group_sizes=[2]).tolist() == [-h, h]


def test_case_40_loo_singleton_group() -> None:
    out = normalize_advantages(
        torch.tensor([7.0, 1.0, 5.0]), norm(leave_one_out=True, std_unbiased=True, eps=1e-5), group_sizes=[1, 2]
    )
    assert out[0].item() == 0.0
    assert out[1:].tolist() == pytest.approx([-SQRT_HALF, SQRT_HALF], abs=1e-5)


def test_case_42_batch_leave_one_out() -> None:
    cfg = NormConfig(mean_level="batch", std_level=None, leave_one_out=True)
    out = normalize_advantages(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), cfg)
    assert out[0, 0].item() == 1.0 - 4.0
    assert out[1, 2].item() == 6.0 - 3.0
    assert normalize_advantages(torch.tensor([[5.0]]), cfg).tolist() == [[5.0]]  # baseline 0
    both = NormConfig(mean_level="batch", std_level="batch", leave_one_out=True)
    assert normalize_advantages(torch.zeros(2, 3), both).tolist() == [[0.0] * 3] * 2


def test_advantages_mask_all_zero_returns_x_unchanged() -> None:
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    out = normalize_advantages(x, norm(), mask=torch.zeros(2, 2, dtype=torch.bool), group_sizes=[2])
    assert out.dtype == torch.float32 and out.tolist() == x.tolist()


def test_advantages_masked_out_values_never_leak() -> None:
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    out = normalize_advantages(x, norm(), mask=mask, group_sizes=[2])
    assert out.tolist() == [[-1.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="x: must be finite where mask is 1"):
        normalize_advantages(x, norm(), group_sizes=[2])


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"mask": torch.ones(2, 3)}, r"mask: must have the shape of x \(2, 2\)"),
        ({"mask": torch.full((2, 2), 0.5)}, "mask: must hold only 0 and 1"),
        ({"group_sizes": [2], "member_counts": [1, 1]}, r"member_counts: must give one count per group \(1 groups\)"),
        ({"group_sizes": [1, 1], "member_counts": [1, 2]}, "member_counts: a group cannot hold more logical rollouts"),
        ({"group_sizes": [2], "member_counts": [0]}, "member_counts: must be positive integers"),
        ({"group_sizes": "22"}, "group_sizes: must be a sequence of positive integers"),
    ],
)
def test_advantages_reject_bad_arguments_naming_them(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises((ValueError, TypeError), match=pattern):
        normalize_advantages(torch.ones(2, 2), norm(), **kwargs)  # type: ignore[arg-type]


def test_advantages_zero_dim_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="x: must have a batch dimension"):
        normalize_advantages(torch.tensor(1.0), norm())


# --------------------------------------------------------------------------- building blocks


def test_group_mean_std_per_group() -> None:
    means, stds = group_mean_std(torch.tensor([1.0, 3.0, 2.0, 4.0, 9.0]), [2, 3], unbiased=False)
    assert means.dtype == torch.float64 and means.tolist() == [2.0, 5.0]
    assert stds.tolist() == pytest.approx([1.0, math.sqrt(26 / 3)])
    _, unbiased = group_mean_std([1.0, 3.0, 7.0], [2, 1])
    assert unbiased.tolist() == pytest.approx([math.sqrt(2.0), 1.0])  # singleton: 1, not NaN
    with pytest.raises(ValueError, match="group_sizes: sizes sum to 2"):
        group_mean_std([1.0, 2.0, 3.0], [1, 1])


# --------------------------------------------------------------------------- rollout-time arithmetic (§7.2)


def test_case_9_two_rollouts_rollout_time() -> None:
    mean, scale = rollout_time_affine([1.0, 3.0])
    assert mean.dtype == scale.dtype == torch.float32
    assert rollout_time_apply([1.0, 3.0], mean, scale).tolist() == pytest.approx([-1.0, 1.0], abs=1e-7)


def test_case_13_explicit_reference_rollout_time() -> None:
    # refs (1.0 explicit, 3) for rows [1, 2] and [3]: rows -> [-1, 0, 1], refs -> (-1, 1)
    mean, scale = rollout_time_affine([1.0, 3.0])
    assert rollout_time_apply(torch.tensor([1.0, 2.0, 3.0]), mean, scale).tolist() == pytest.approx([-1, 0, 1])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float64])
def test_case_15_constant_non_binary_reward_is_exactly_zero(cache_dtype: torch.dtype) -> None:
    mean, scale = rollout_time_affine([0.1, 0.1])
    assert scale.item() == 1.0
    assert rollout_time_apply(0.1, mean, scale).item() == 0.0
    cache = rollout_time_apply(torch.tensor([0.1], dtype=cache_dtype), mean, scale)
    assert cache.dtype == torch.float32 and cache.tolist() == [0.0]


@pytest.mark.parametrize("d", [0.0, 1e-8, 2e-8])
def test_case_16_rollout_time_scale_fallback(d: float) -> None:
    mean, scale = rollout_time_affine([-d, d])
    assert mean.item() == 0.0
    first = rollout_time_apply(-1.0, mean, scale).item()
    last = rollout_time_apply(d, mean, scale).item()
    refs = rollout_time_apply([-d, d], mean, scale).tolist()
    cache = rollout_time_apply(torch.tensor([-1.0, -0.5]), mean, scale).tolist()
    if d <= 1e-8:
        assert scale.item() == 1.0  # boundary: std == 1e-8 (in float32) still falls back
        assert (first, cache) == (-1.0, [-1.0, -0.5])
        assert last == torch.tensor(d, dtype=torch.float32).item() and refs == [-last, last]
    else:
        div = d + 1e-8
        assert scale.item() == pytest.approx(div, rel=1e-6)
        assert first == pytest.approx(-1 / div, rel=1e-6) and last == pytest.approx(d / div, rel=1e-6)
        assert refs == pytest.approx([-d / div, d / div], rel=1e-6)
        assert cache == pytest.approx([-1 / div, -0.5 / div], rel=1e-6)


def test_rollout_time_singleton_and_validation() -> None:
    mean, scale = rollout_time_affine(torch.tensor([3.5]))
    assert (mean.item(), scale.item()) == (3.5, 1.0)  # u == 1: std 1.0, output 0
    assert rollout_time_apply(3.5, mean, scale).item() == 0.0
    with pytest.raises(ValueError, match="references: must be a non-empty 1-D sequence"):
        rollout_time_affine([])
    with pytest.raises(ValueError, match="references: must be finite"):
        rollout_time_affine([1.0, float("inf")])
