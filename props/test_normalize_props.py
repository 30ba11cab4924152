"""Hypothesis properties of rollout_trio._normalize.

Values are multiples of 1/4 in [-100, 100] (exact in binary floating point), so no
property depends on catastrophic cancellation; comparisons allow 1e-4 relative error
(outputs are float32). Expected values come from an independent oracle written with
:mod:`statistics` over Python lists, never from the code under test.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollout_trio._normalize import (
    NormConfig,
    normalize_advantages,
    normalize_rewards,
    rollout_time_affine,
    rollout_time_apply,
)
from rollout_trio._rollout_group import RolloutGroup

VALUES = st.integers(-400, 400).map(lambda v: v / 4)
LEVELS = st.sampled_from(["batch", "group", None])
SETTINGS = settings(max_examples=200, deadline=None)


@dataclass(frozen=True)
class Rollout:
    """One logical rollout: its rows' rewards, its reference, and whether the reference is explicit."""

    rows: tuple[float, ...]
    ref: float
    explicit: bool


Batch = list[list[Rollout]]  # trajectories (prompt groups) of rollouts


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    explicit: st.SearchStrategy[bool] = st.booleans(),
    min_rollouts: int = 1,
    max_groups: int = 4,
    constant_groups: bool = False,
) -> Batch:
    """Trajectories of 1-5 rollouts of 1-3 rows; implicit references have equal rows."""
    batch: Batch = []
    for _ in range(draw(st.integers(1, max_groups))):
        group_ref = draw(VALUES)
        group = []
        for _ in range(draw(st.integers(min_rollouts, 5))):
            ref = group_ref if constant_groups else draw(VALUES)
            n = draw(st.integers(1, 3))
            if draw(explicit):
                group.append(Rollout(tuple(draw(st.lists(VALUES, min_size=n, max_size=n))), ref, True))
            else:
                group.append(Rollout((ref,) * n, ref, False))
        batch.append(group)
    return batch


def pack(batch: Batch) -> tuple[torch.Tensor, list[RolloutGroup]]:
    rows = [v for group in batch for r in group for v in r.rows]
    groups = [
        RolloutGroup(tuple(len(r.rows) for r in group), tuple(r.ref if r.explicit else None for r in group))
        for group in batch
    ]
    return torch.tensor(rows, dtype=torch.float64), groups


def run(batch: Batch, config: NormConfig, **kwargs: object) -> list[list[list[float]]]:
    """normalize_rewards on ``batch``, the output regrouped as [group][rollout][row]."""
    x, groups = pack(batch)
    flat = iter(normalize_rewards(x, config, rollout_groups=groups, **kwargs).tolist())  # type: ignore[arg-type]
    return [[[next(flat) for _ in r.rows] for r in group] for group in batch]


def map_batch(batch: Batch, f: Callable[[float], float]) -> Batch:
    return [[Rollout(tuple(f(v) for v in r.rows), f(r.ref), r.explicit) for r in g] for g in batch]


def flat(value: object) -> list[float]:
    """Nested lists of numbers, flattened in order (pytest.approx compares flat lists only)."""
    if isinstance(value, list):
        return [v for item in value for v in flat(item)]
    return [value]  # type: ignore[list-item]


def close(actual: object, expected: object) -> None:
    """Same nesting, and every number within 1e-4 relative (or absolute near 0)."""
    assert shape(actual) == shape(expected)
    assert flat(actual) == pytest.approx(flat(expected), rel=1e-4, abs=1e-4)


def shape(value: object) -> object:
    return [shape(v) for v in value] if isinstance(value, list) else None


def approx(expected: float) -> object:
    return pytest.approx(expected, rel=1e-4, abs=1e-4)


def std(values: list[float], unbiased: bool) -> float:
    return statistics.stdev(values) if unbiased else statistics.pstdev(values)


configs = st.builds(
    NormConfig,
    mean_level=LEVELS,
    std_level=LEVELS,
    leave_one_out=st.booleans(),
    std_unbiased=st.booleans(),
    eps=st.sampled_from([0.0, 1e-5, 0.5]),
)


@SETTINGS
@given(batch=batches(explicit=st.just(False)), unbiased=st.booleans(), eps=st.sampled_from([0.0, 1e-5]))
def test_group_levels_give_mean_zero_and_unit_std_per_group(batch: Batch, unbiased: bool, eps: float) -> None:
    """With group mean and std, each group's normalized references have mean 0 and std 1 (std / (std + eps)) where std > eps."""
    cfg = NormConfig(mean_level="group", std_level="group", std_unbiased=unbiased, eps=eps)
    for group, out in zip(batch, run(batch, cfg), strict=True):
        normalized = [rows[0] for rows in out]  # every row of a rollout equals its reference here
        assert all(v == rows[0] for rows in out for v in rows)
        assert statistics.fmean(normalized) == approx(0.0)
        if len(group) >= 2:
            s = std([r.ref for r in group], unbiased)
            if s > eps:
                assert std(normalized, unbiased) == approx(s / (s + eps))
            else:
                assert normalized == [0.0] * len(group)


@SETTINGS
@given(batch=batches())
def test_leave_one_out_baseline_is_the_mean_of_the_other_rollouts(batch: Batch) -> None:
    """Group leave-one-out: each row minus the mean of the *other* rollouts' references (itself for a singleton)."""
    cfg = NormConfig(mean_level="group", std_level=None, leave_one_out=True)
    for group, out in zip(batch, run(batch, cfg), strict=True):
        for k, (rollout, rows) in enumerate(zip(group, out, strict=True)):
            others = [r.ref for j, r in enumerate(group) if j != k]
            baseline = statistics.fmean(others) if others else rollout.ref
            close(rows, [v - baseline for v in rollout.rows])


@SETTINGS
@given(batch=batches(), cfg=configs, shift=VALUES)
def test_adding_a_constant_to_every_reward_leaves_the_output_unchanged(batch: Batch, cfg: NormConfig, shift: float) -> None:
    """With centering, adding c to every row reward and reference changes nothing."""
    assume(cfg.mean_level is not None)
    # A batch-level leave-one-out over a single rollout has baseline 0 by definition.
    assume(not (cfg.mean_level == "batch" and cfg.leave_one_out and sum(map(len, batch)) < 2))
    close(run(map_batch(batch, lambda v: v + shift), cfg), run(batch, cfg))


@SETTINGS
@given(batch=batches(), scale=st.sampled_from([0.25, 0.5, 2.0, 3.0, 10.0]), loo=st.booleans(), mean=LEVELS)
def test_positive_scaling_scales_the_output_when_there_is_no_std(
    batch: Batch, scale: float, loo: bool, mean: str | None
) -> None:
    """Without a std level, scaling every reward and reference by a > 0 scales the output by a (reward_scaling=a likewise)."""
    cfg = NormConfig(mean_level=mean, std_level=None, leave_one_out=loo)
    base = run(batch, cfg)
    expected = [[[scale * v for v in rows] for rows in group] for group in base]
    close(run(map_batch(batch, lambda v: v * scale), cfg), expected)
    close(run(batch, cfg, reward_scaling=scale), expected)


@SETTINGS
@given(batch=batches(), scale=st.sampled_from([0.25, 0.5, 2.0, 3.0, 10.0]), unbiased=st.booleans())
def test_positive_scaling_cancels_where_the_group_std_is_positive(batch: Batch, scale: float, unbiased: bool) -> None:
    """Group mean and std, eps 0: scaling by a > 0 leaves groups with std > 0 unchanged and scales std-0 groups by a (divisor 1)."""
    cfg = NormConfig(mean_level="group", std_level="group", std_unbiased=unbiased, eps=0.0)
    base = run(batch, cfg)
    scaled = run(map_batch(batch, lambda v: v * scale), cfg)
    for group, before, after in zip(batch, base, scaled, strict=True):
        # Equal references (a singleton included) give std 0, or 1 for an unbiased singleton: divisor 1.
        factor = scale if len({r.ref for r in group}) == 1 else 1.0
        close(after, [[factor * v for v in rows] for rows in before])


@st.composite
def permuted(draw: st.DrawFn) -> tuple[Batch, list[list[int]]]:
    batch = draw(batches())
    return batch, [draw(st.permutations(range(len(group)))) for group in batch]


@SETTINGS
@given(case=permuted(), cfg=configs)
def test_permuting_rollouts_within_a_group_permutes_the_output(case: tuple[Batch, list[list[int]]], cfg: NormConfig) -> None:
    """Reordering the rollouts of a group (rows travel with their rollout) reorders the output the same way."""
    batch, orders = case
    shuffled = [[group[i] for i in order] for group, order in zip(batch, orders, strict=True)]
    base = run(batch, cfg)
    expected = [[out[i] for i in order] for out, order in zip(base, orders, strict=True)]
    close(run(shuffled, cfg), expected)


@st.composite
def duplicated(draw: st.DrawFn) -> tuple[Batch, int, int, int]:
    batch = draw(batches())
    g = draw(st.integers(0, len(batch) - 1))
    k = draw(st.integers(0, len(batch[g]) - 1))
    j = draw(st.integers(0, len(batch[g][k].rows) - 1))
    return batch, g, k, j


@SETTINGS
@given(case=duplicated(), cfg=configs)
def test_duplicating_a_row_of_a_rollout_changes_no_statistic(case: tuple[Batch, int, int, int], cfg: NormConfig) -> None:
    """A logical rollout counts once: an extra copy of one of its rows leaves every other output unchanged."""
    batch, g, k, j = case
    r = batch[g][k]
    grown = [list(group) for group in batch]
    grown[g][k] = Rollout(r.rows[: j + 1] + r.rows[j:], r.ref, r.explicit)
    base, after = run(batch, cfg), run(grown, cfg)
    copy = after[g][k].pop(j + 1)
    close(after, base)
    assert copy == approx(base[g][k][j])


@SETTINGS
@given(
    batch=batches(constant_groups=True, min_rollouts=2),  # an unbiased singleton has std 1, not 0
    loo=st.booleans(),
    unbiased=st.booleans(),
    std_level=st.sampled_from(["group", "batch"]),
    eps=st.sampled_from([1e-5, 0.5]),
)
def test_std_at_most_eps_gives_centering_only_for_constant_groups(
    batch: Batch, loo: bool, unbiased: bool, std_level: str, eps: float
) -> None:
    """Equal references in every group (std 0 <= eps): each row is only centred on its group reference, divisor 1."""
    cfg = NormConfig(mean_level="group", std_level=std_level, leave_one_out=loo, std_unbiased=unbiased, eps=eps)
    for group, out in zip(batch, run(batch, cfg), strict=True):
        assert out == [[v - group[0].ref for v in r.rows] for r in group]


@SETTINGS
@given(batch=batches(), loo=st.booleans(), unbiased=st.booleans())
def test_std_at_most_eps_gives_centering_only_for_a_large_eps(batch: Batch, loo: bool, unbiased: bool) -> None:
    """eps = 1000 exceeds every std of references in [-100, 100]: outputs are rows minus the group baseline, undivided."""
    cfg = NormConfig(mean_level="group", std_level="group", leave_one_out=loo, std_unbiased=unbiased, eps=1000.0)
    for group, out in zip(batch, run(batch, cfg), strict=True):
        for k, (rollout, rows) in enumerate(zip(group, out, strict=True)):
            peers = [r.ref for j, r in enumerate(group) if j != k or not loo]
            baseline = statistics.fmean(peers) if peers else rollout.ref
            close(rows, [v - baseline for v in rollout.rows])


@st.composite
def token_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    sizes = draw(st.lists(st.integers(2, 3), min_size=1, max_size=4))  # 1-row groups: singleton fallbacks
    width = draw(st.integers(1, 4))
    rows = sum(sizes)
    x = torch.tensor(draw(st.lists(VALUES, min_size=rows * width, max_size=rows * width))).reshape(rows, width)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=rows * width, max_size=rows * width))).reshape(rows, width)
    return x, mask, sizes


@SETTINGS
@given(case=token_batches(), unbiased=st.booleans())
def test_advantages_have_masked_mean_zero_and_unit_std_per_group(
    case: tuple[torch.Tensor, torch.Tensor, list[int]], unbiased: bool
) -> None:
    """Plain call, group mean and std, eps 0: per group the masked tokens have mean 0 and std 1 (if not constant); masked-out tokens are 0."""
    x, mask, sizes = case
    assume(bool(mask.any()))
    cfg = NormConfig(mean_level="group", std_level="group", std_unbiased=unbiased, eps=0.0)
    out = normalize_advantages(x, cfg, mask=mask, group_sizes=sizes)
    assert (out[~mask] == 0).all()
    for xs, ms, os in zip(x.split(sizes), mask.split(sizes), out.split(sizes), strict=True):
        tokens, normalized = xs[ms].tolist(), os[ms].tolist()
        if len(set(tokens)) >= 2:
            assert statistics.fmean(normalized) == approx(0.0)
            assert std(normalized, unbiased) == approx(1.0)


def plain_oracle(values: list[float], sizes: list[int], cfg: NormConfig) -> list[float]:
    """Per-element normalization written from the definitions, over Python lists: the
    baseline is the mean of the level's pool (of the others under leave-one-out; a
    singleton group is its own baseline), the std is taken around the baselines over
    the std level's pool (1 when undefined), the divisor is std + eps."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    group_of = [range(a, a + n) for a, n in zip(starts, sizes) for _ in range(n)]
    everything = range(len(values))

    def pool(j: int, level: str) -> range:
        return everything if level == "batch" else group_of[j]

    base = []
    for j in everything:
        if cfg.mean_level is None:
            base.append(0.0)
            continue
        idx = pool(j, cfg.mean_level)
        if not cfg.leave_one_out:
            base.append(statistics.fmean(values[i] for i in idx))
        elif cfg.mean_level == "group" and len(idx) == 1:
            base.append(values[j])
        else:
            others = [values[i] for i in idx if i != j]
            base.append(statistics.fmean(others) if others else 0.0)
    out = []
    for j in everything:
        divisor = 1.0
        if cfg.std_level is not None:
            idx = pool(j, cfg.std_level)
            k = len(idx)
            squares = math.fsum((values[i] - base[i]) ** 2 for i in idx)
            if cfg.std_unbiased:
                s = 1.0 if k <= 1 else math.sqrt(squares / (k - 1))
            else:
                s = math.sqrt(squares / k)
            divisor = s + cfg.eps
        out.append((values[j] - base[j]) / divisor)
    return out


@SETTINGS
@given(
    values=st.lists(VALUES, min_size=2, max_size=12),
    data=st.data(),
    cfg=configs.filter(lambda c: c.std_level is None or c.eps < 0.5),
)
def test_one_row_rollouts_match_the_plain_call(values: list[float], data: st.DataObject, cfg: NormConfig) -> None:
    """With one row per rollout and no std <= eps fallback in play, normalize_rewards and
    normalize_advantages both equal the per-element oracle written from the definitions."""
    cut = sorted(set(data.draw(st.lists(st.integers(1, len(values) - 1), max_size=3))))
    sizes = [b - a for a, b in zip([0, *cut], [*cut, len(values)])]
    if cfg.std_level is not None:  # every group must have a std above eps
        assume(all(len(set(values[a:b])) >= 2 for a, b in zip([0, *cut], [*cut, len(values)])))
        assume(len(set(values)) >= 2)
    x = torch.tensor(values)
    expected = plain_oracle(values, sizes, cfg)
    assert normalize_advantages(x, cfg, group_sizes=sizes).tolist() == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert normalize_rewards(x, cfg, group_sizes=sizes).tolist() == pytest.approx(expected, rel=1e-4, abs=1e-4)


@SETTINGS
@given(refs=st.lists(VALUES, min_size=1, max_size=8))
def test_rollout_time_output_has_mean_zero_and_unit_population_std(refs: list[float]) -> None:
    """Rollout-time: normalized references have mean 0 and population std 1, or are exactly 0 when constant."""
    mean, scale = rollout_time_affine(refs)
    out = rollout_time_apply(refs, mean, scale).tolist()
    if len(set(refs)) == 1:
        assert out == [0.0] * len(refs)
    else:
        assert statistics.fmean(out) == approx(0.0)
        assert statistics.pstdev(out) == approx(1.0)
