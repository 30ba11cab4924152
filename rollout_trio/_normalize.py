"""Pure, synchronous reward and advantage normalization.

Three families of functions live here:

* :func:`normalize_rewards`: trainer-side reward normalization (one reference per
  logical rollout, bias / scaling / clipping, leave-one-out, the ``std <= eps`` rule).
  Statistics in float64, result float32.
* :func:`normalize_advantages`: the plain ``Normalization`` call used on ``[B, L]``
  advantages with a loss mask (masked token statistics, per-element leave-one-out,
  singleton fallbacks chosen by logical member counts, no ``std <= eps`` fallback).
* :func:`rollout_time_affine` / :func:`rollout_time_apply`: rollout-time (group)
  normalization, for the group layer. Statistics in float64, results float32.

Nothing here is async, touches global state or mutates its inputs.
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch

from ._errors import WorkflowContractError
from ._rollout_group import RolloutGroup
from ._validate import is_int, is_real

__all__ = [
    "NormConfig",
    "NormLevel",
    "group_mean_std",
    "normalize_advantages",
    "normalize_rewards",
    "rollout_time_affine",
    "rollout_time_apply",
]

#: Where a statistic is taken: over the whole batch, per prompt group, or not at all.
NormLevel = Literal["batch", "group"] | None

_LEVELS = ("batch", "group", None)
_F64 = torch.float64
#: Rollout-time epsilon (spec §7.2), a float32 constant.
_ROLLOUT_EPS = 1e-8
_ONE32 = torch.ones((), dtype=torch.float32)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_OVERFLOW_MARGIN = _FLOAT32_MAX * (1 + 2**-20)  # well past float32 rounding (2**-24)
_SPLIT_ROWS_MESSAGE = (
    "Split rollout row rewards differ; supply an explicit rollout_reward for reward normalization."
)


# --------------------------------------------------------------------------- config


def _level(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or value not in _LEVELS:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be 'batch', 'group' or None, got {value!r}"
        )


def _flag(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be a bool, got {type(value).__name__} {value!r}"
        )


def _eps(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not is_real(value) or value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}: must be a finite real number >= 0, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class NormConfig:
    """How to normalize: where the mean and the std come from, and their details.

    Attributes:
        mean_level: ``"batch"``, ``"group"`` or ``None`` (no centering).
        std_level: ``"batch"``, ``"group"`` or ``None`` (no scaling; eps unused).
        leave_one_out: Centre each value on the mean of the *others* (its group's or
            the batch's) instead of the mean including itself.
        std_unbiased: Divide the squared deviations by ``n - 1`` instead of ``n``.
        eps: Added to the std in the divisor; must be finite and ``>= 0``.
        group_size: Fixed group size, used for group levels when no explicit
            ``group_sizes`` are passed at call time; must be an integer ``>= 1``.

    Raises:
        ValueError: a field breaks its rule (named with the field).
    """

    mean_level: NormLevel = attrs.field(default="batch", validator=_level)
    std_level: NormLevel = attrs.field(default="batch", validator=_level)
    leave_one_out: bool = attrs.field(default=False, validator=_flag)
    std_unbiased: bool = attrs.field(default=True, validator=_flag)
    eps: float = attrs.field(default=1e-5, validator=_eps)
    group_size: int = attrs.field(default=1)

    @group_size.validator
    def _check_group_size(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not is_int(value) or value < 1:
            used = " (a group level is used)" if self.uses_group_level else ""
            raise ValueError(f"NormConfig.group_size: must be an integer >= 1{used}, got {value!r}")

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "eps", float(self.eps))
        object.__setattr__(self, "group_size", int(self.group_size))

    @property
    def uses_group_level(self) -> bool:
        """True if the mean or the std is taken per group."""
        return self.mean_level == "group" or self.std_level == "group"

    @property
    def is_identity(self) -> bool:
        """True if neither a mean nor a std is taken (values pass through)."""
        return self.mean_level is None and self.std_level is None


# --------------------------------------------------------------------------- argument checks


def _positive_ints(name: str, value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: must be a sequence of positive integers, got {type(value).__name__}")
    out = list(value)
    if any(not is_int(v) or v < 1 for v in out):
        raise ValueError(f"{name}: must be positive integers, got {out!r}")
    return [int(v) for v in out]


def _real_tensor(name: str, value: Any) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t is not value and t.is_floating_point():  # Python floats are float64: keep them so
        t = torch.as_tensor(value, dtype=_F64)
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name}: must hold real numbers (float or integer dtype), got dtype {t.dtype}")
    return t


def _finite_real(name: str, value: Any) -> float:
    if not is_real(value):
        raise ValueError(f"{name}: must be a finite real number, got {value!r}")
    return float(value)


def _group_sizes(n: int, config: NormConfig, group_sizes: Sequence[int] | None, *, what: str) -> list[int] | None:
    """Sizes of the contiguous groups, or None when no level is per group (sizes still checked)."""
    if group_sizes is not None:
        sizes = _positive_ints("group_sizes", group_sizes)
        if sum(sizes) != n:
            raise ValueError(
                f"group_sizes: sizes sum to {sum(sizes)}, which must equal the number of {what} ({n})"
            )
    elif config.uses_group_level:
        if n % config.group_size:
            raise ValueError(
                f"NormConfig.group_size: {n} {what} do not split into groups of {config.group_size}; "
                "pass group_sizes= for variable-size groups"
            )
        sizes = [config.group_size] * (n // config.group_size)
    else:
        return None
    return sizes if config.uses_group_level else None


# --------------------------------------------------------------------------- statistics core
#
# Statistics are segment reductions: per-row sums (over any trailing dims) are added into
# their group's bucket with one ``index_add_``, then gathered back per row. One pass per
# statistic whatever the number of groups; a level of "batch" is one bucket.


class _Segments:
    """Rows of ``x`` (dim 0) assigned to contiguous groups; ``sizes=None`` means one group."""

    def __init__(self, x: torch.Tensor, sizes: list[int] | None) -> None:
        rows = x.shape[0]
        self.count = 1 if sizes is None else len(sizes)
        if sizes is None:
            self.row_group: torch.Tensor | None = None
        elif all(s == sizes[0] for s in sizes):
            self.row_group = torch.arange(rows, device=x.device) // sizes[0]
        else:
            self.row_group = torch.repeat_interleave(
                torch.arange(len(sizes), device=x.device), torch.tensor(sizes, device=x.device)
            )
        self._shape = (rows,) + (1,) * (x.ndim - 1)  # a per-row value, broadcastable over x
        self._sizes = sizes
        self._numel_per_row = x[0].numel()  # never empty: the public calls return an empty batch at once
        self._dtype, self._device = x.dtype, x.device

    def elements(self, m: torch.Tensor | None) -> torch.Tensor:
        """Elements counted per group (masked ones only), gathered back per row."""
        if m is not None:
            return self.total(m)
        if self._sizes is None:  # known without a reduction
            n = float(self._numel_per_row * self._shape[0])
            return torch.full((1,) * len(self._shape), n, dtype=self._dtype, device=self._device)
        per_group = torch.tensor(self._sizes, dtype=self._dtype, device=self._device) * self._numel_per_row
        assert self.row_group is not None
        return per_group[self.row_group].reshape(self._shape)

    def total(self, v: torch.Tensor) -> torch.Tensor:
        """Sum of ``v`` over each group, gathered back to one value per row (broadcastable)."""
        per_row = v.reshape(v.shape[0], -1).sum(dim=1) if v.ndim > 1 else v
        if self.row_group is None:
            return per_row.sum().reshape((1,) * v.ndim)
        sums = torch.zeros(self.count, dtype=v.dtype, device=v.device).index_add_(0, self.row_group, per_row)
        return sums[self.row_group].reshape(self._shape)

    def per_row(self, values: list[int]) -> torch.Tensor:
        """One integer per group, gathered back to one value per row (broadcastable); for
        segments with sizes (the only ones that ask)."""
        assert self.row_group is not None
        return torch.tensor(values, dtype=torch.long)[self.row_group].reshape(self._shape)


def _mean(x: torch.Tensor, m: torch.Tensor | None, seg: _Segments, leave_one_out: bool) -> torch.Tensor:
    """Per-element baseline over each group (masked by ``m``), shaped like ``x``.

    ``x`` must be 0 wherever ``m`` is 0 (the caller zeroes masked-out values), so plain
    sums of ``x`` are masked sums. Under leave-one-out a masked-out element's baseline is
    the group's masked mean (nothing of its own is left out: ``m`` is 0 there)."""
    n = seg.elements(m)
    total = seg.total(x)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if leave_one_out:
        others = n - 1 if m is None else torch.clamp(n - m, min=1.0)
        return torch.where(n <= 1, zero, (total - x) / others).expand_as(x)
    return torch.where(n == 0, zero, total / n).expand_as(x)


def _std(x: torch.Tensor, m: torch.Tensor | None, seg: _Segments, base: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Std of each group around the per-element ``base``; 1 where it is undefined."""
    dev = x - base
    n = seg.elements(m)
    if m is not None:
        dev = dev * m
    r = seg.total(dev * dev)
    one = torch.ones((), dtype=x.dtype, device=x.device)
    if unbiased:
        return torch.where(n <= 1, one, torch.sqrt(r / (n - 1)))
    return torch.where(n == 0, one, torch.sqrt(r / n))


def _baseline_std(
    x: torch.Tensor,
    m: torch.Tensor | None,
    config: NormConfig,
    sizes: list[int] | None,
    member_counts: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element baseline (shaped like ``x``) and std (float64, broadcastable to ``x``:
    one value per row or per batch, so arithmetic on it stays small); std is 1 without a
    std level."""
    loo = config.leave_one_out
    groups = _Segments(x, sizes) if config.uses_group_level else None
    # A group of one logical rollout: under leave-one-out it is its own baseline (output 0),
    # and an unbiased std of one member is 1.
    single = None
    if groups is not None and ((loo and config.mean_level == "group") or config.std_unbiased):
        assert sizes is not None
        single = groups.per_row(member_counts if member_counts is not None else sizes) == 1
    if config.mean_level is None:
        mean = torch.zeros_like(x)
    else:
        seg = groups if config.mean_level == "group" else _Segments(x, None)
        assert seg is not None
        mean = _mean(x, m, seg, loo)
        if loo and config.mean_level == "group":
            assert single is not None
            mean = torch.where(single, x, mean)
    if config.std_level is None:
        std = torch.ones((1,) * x.ndim, dtype=x.dtype, device=x.device)
    else:
        seg = groups if config.std_level == "group" else _Segments(x, None)
        assert seg is not None
        std = _std(x, m, seg, mean, config.std_unbiased)
        if config.std_level == "group" and config.std_unbiased:
            assert single is not None
            std = torch.where(single, torch.ones((), dtype=std.dtype), std)
    return mean, std


# --------------------------------------------------------------------------- public: building blocks


def group_mean_std(
    values: torch.Tensor | Sequence[float],
    group_sizes: Sequence[int] | None = None,
    *,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of each contiguous group of a 1-D tensor, in float64.

    Args:
        values: 1-D real values.
        group_sizes: Positive sizes summing to ``len(values)``; ``None`` means one group.
        unbiased: Divide by ``n - 1`` (a singleton then has std 1.0, not NaN) or by ``n``.

    Returns:
        ``(means, stds)``, each of shape ``[n_groups]`` and dtype float64.
    """
    x = _real_tensor("values", values).to(_F64)
    if x.ndim != 1 or x.numel() == 0:
        raise ValueError(f"values: must be a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    sizes = [x.numel()] if group_sizes is None else _positive_ints("group_sizes", group_sizes)
    if sum(sizes) != x.numel():
        raise ValueError(f"group_sizes: sizes sum to {sum(sizes)}, which must equal the number of values ({x.numel()})")
    seg = _Segments(x, sizes)
    mean = _mean(x, None, seg, False)
    std = _std(x, None, seg, mean, unbiased)
    firsts = torch.tensor([0, *sizes[:-1]], dtype=torch.long).cumsum(0)
    return mean[firsts].clone(), std[firsts].clone()


def rollout_time_affine(references: torch.Tensor | Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline and divisor of rollout-time (group) normalization.

    Over the ``u`` references of a group's usable rollouts: ``mean`` is their average,
    ``std`` their population std (1.0 when ``u == 1``), and the divisor is 1 when
    ``std <= 1e-8``, else ``std + 1e-8``. The statistics are computed in float64 (so
    rewards near float32's range neither overflow nor vanish) and returned as float32;
    constant references give exactly 0 after :func:`rollout_time_apply`.

    Args:
        references: One finite reference reward per usable rollout (at least one).

    Returns:
        ``(mean, scale)`` as 0-d float32 tensors.

    Raises:
        ValueError: no references, or one that is not finite or beyond float32's range.
    """
    if isinstance(references, torch.Tensor):
        r = _real_tensor("references", references)
        if r.ndim != 1 or r.numel() == 0:
            raise ValueError(f"references: must be a non-empty 1-D sequence, got shape {tuple(r.shape)}")
        values = r.tolist()
    else:
        values = [float(v) for v in references]
        if not values:
            raise ValueError("references: must be a non-empty 1-D sequence, got shape (0,)")
    mean, scale = rollout_time_stats(values)
    return torch.tensor(mean, dtype=torch.float32), (_ONE32 if scale == 1.0 else torch.tensor(scale, dtype=torch.float32))


def rollout_time_stats(values: list[float]) -> tuple[float, float]:
    """:func:`rollout_time_affine` on Python floats: ``(mean, divisor)``, each a float32 value.

    A group holds a few references, so plain float64 arithmetic (``math.fsum``, exactly
    rounded) beats a dozen tensor ops; the results are the float32 values the tensors hold.

    Raises:
        ValueError: a reference that is not finite or beyond float32's range.
    """
    total = sum(values)  # NaN or an infinity anywhere makes it non-finite
    if not (math.isfinite(total) and -_FLOAT32_MAX <= min(values) and max(values) <= _FLOAT32_MAX):
        raise ValueError(f"references: must be finite and within float32's range, got {values!r}")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return _to_float32(mean), 1.0
    std = math.sqrt(math.fsum([(v - mean) * (v - mean) for v in values]) / n)
    return _to_float32(mean), (1.0 if std <= _ROLLOUT_EPS else _to_float32(std + _ROLLOUT_EPS))


def _to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (as a Python float)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def rollout_time_apply_floats(values: list[float], mean: float, scale: float) -> list[float] | None:
    """:func:`rollout_time_apply` on float32 values as Python floats, in float64.

    Returns None when a result lies beyond float32's range (the tensor version then
    saturates or raises, as it documents); the caller rounds the results to float32.
    """
    out = [(v - mean) / scale for v in values]
    if not (-_FLOAT32_MAX <= min(out) and max(out) <= _FLOAT32_MAX):
        return None
    return out


def rollout_time_apply(values: Any, mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / scale``, computed in float64 and returned as float32.

    Use it for each row reward and cached ``rewards`` tensor with the pair from
    :func:`rollout_time_affine`. ``values`` is first rounded to float32 (the dtype
    rewards have in a batch), so equal references give exactly 0.

    Args:
        values: rewards: a number, a sequence or a tensor.
        mean: the baseline from :func:`rollout_time_affine`.
        scale: the divisor from :func:`rollout_time_affine`.

    Returns:
        A float32 tensor shaped like ``values`` (0-d for a Python number).

    Raises:
        ValueError: a normalized value lies beyond float32's range by more than rounding
            can carry it (``2**-20`` of the largest float32, relative; up to that it saturates).
    """
    v = torch.as_tensor(values).to(torch.float32).to(_F64)
    out = (v - mean.to(_F64)) / scale.to(_F64)
    over = out.abs() > _FLOAT32_MAX
    if bool(over.any()):
        # Rounding the inputs to float32 can carry a result a hair past float32's range:
        # that saturates. A result truly beyond it (centring, without the std divisor,
        # rewards near the limit) cannot be returned and is an error, never an infinity.
        if bool((out.abs() > _OVERFLOW_MARGIN).any()):
            raise ValueError(f"normalized rewards {out[over].tolist()!r} lie beyond float32's range")
        out = out.clamp(-_FLOAT32_MAX, _FLOAT32_MAX)
    return out.to(torch.float32)


# --------------------------------------------------------------------------- public: advantages


def normalize_advantages(
    x: torch.Tensor,
    config: NormConfig,
    *,
    mask: torch.Tensor | None = None,
    group_sizes: Sequence[int] | None = None,
    member_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """The plain ``Normalization`` call: ``(x - baseline) * mask / (std + eps)``.

    Statistics are taken over masked elements (token-weighted), in float64. Groups
    are contiguous row ranges along dim 0. With ``leave_one_out`` each element's
    baseline is the masked mean of the *other* elements of its group (or batch); a
    batch with at most one masked element has baseline 0. A group whose member count
    is 1 gets itself as baseline under leave-one-out (output 0) and std 1 when
    unbiased. There is no ``std <= eps`` fallback here: a constant group gives
    ``0 / eps``.

    Args:
        x: Real tensor, rows along dim 0 (``[B]`` or ``[B, L]``).
        config: The normalization settings.
        mask: 0/1 (or bool) tensor shaped like ``x``; ``None`` means every element.
            If it is all 0, ``x`` is returned unchanged (as float32).
        group_sizes: Rows per group (positive, summing to ``B``); default: fixed
            ``config.group_size`` slices, which must divide ``B``.
        member_counts: Logical rollouts per group (``>= 1``, one per group). They only
            select the singleton fallbacks; they never reweight statistics.

    Returns:
        float32 tensor shaped like ``x``; 0 wherever ``mask`` is 0.

    Raises:
        ValueError: ``x`` is 0-d or not finite where ``mask`` is 1; ``mask`` is not shaped
            like ``x`` or holds values other than 0 and 1; ``group_sizes`` or
            ``member_counts`` do not fit the batch.
    """
    t = _real_tensor("x", x)
    if t.ndim < 1:
        raise ValueError("x: must have a batch dimension (ndim >= 1), got a 0-d tensor")
    m: torch.Tensor | None = None
    if mask is not None:
        mt = mask if isinstance(mask, torch.Tensor) else torch.as_tensor(mask)
        if tuple(mt.shape) != tuple(t.shape):
            raise ValueError(f"mask: must have the shape of x {tuple(t.shape)}, got {tuple(mt.shape)}")
        m = mt.to(_F64)
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("mask: must hold only 0 and 1 (or False and True)")
    sizes = _group_sizes(t.shape[0], config, group_sizes, what="rows")
    counts: list[int] | None = None
    if member_counts is not None:
        counts = _positive_ints("member_counts", member_counts)
        if sizes is not None and len(counts) != len(sizes):
            raise ValueError(
                f"member_counts: must give one count per group ({len(sizes)} groups), got {len(counts)}"
            )
        if sizes is not None and any(c > n for c, n in zip(counts, sizes)):
            raise ValueError(
                f"member_counts: a group cannot hold more logical rollouts than rows; counts {counts}, rows {sizes}"
            )
    if t.numel() == 0 or (m is not None and float(m.sum().item()) == 0):
        return t.to(torch.float32).clone()  # nothing to normalize (an empty batch, or all masked)

    xf = t.to(_F64)
    live = torch.ones_like(xf, dtype=torch.bool) if m is None else m > 0
    if not bool(torch.isfinite(xf[live]).all()):
        raise ValueError("x: must be finite where mask is 1")
    if m is not None:
        xf = torch.where(live, xf, torch.zeros_like(xf))  # masked-out garbage never leaks
    mean, std = _baseline_std(xf, m, config, sizes, counts)
    eps = config.eps if config.std_level is not None else 0.0
    out = (xf - mean) / (std + eps)
    if m is not None:
        out = torch.where(live, out, torch.zeros_like(out))
    return out.to(torch.float32)


# --------------------------------------------------------------------------- public: rewards


def _logical_rollouts(
    n_rows: int,
    rollout_groups: Sequence[RolloutGroup | None],
    trajectory_rows: Sequence[int] | None,
) -> tuple[list[int], list[float | None], list[int], list[tuple[int, int]]]:
    """Row counts, explicit references, logical sizes per trajectory, (trajectory, index) labels."""
    if isinstance(rollout_groups, RolloutGroup):
        raise TypeError(
            "rollout_groups: must be a sequence with one RolloutGroup (or None) per trajectory, "
            "got a single RolloutGroup (wrap it in a list)"
        )
    if isinstance(rollout_groups, (str, bytes)) or not isinstance(rollout_groups, Sequence):
        raise TypeError(f"rollout_groups: must be a sequence, got {type(rollout_groups).__name__}")
    groups = list(rollout_groups)
    for t, g in enumerate(groups):
        if g is not None and not isinstance(g, RolloutGroup):
            raise TypeError(f"rollout_groups[{t}]: must be a RolloutGroup or None, got {type(g).__name__}")
    rows: list[int] | None = None
    if trajectory_rows is not None:
        rows = _positive_ints("trajectory_rows", trajectory_rows)
        if len(rows) != len(groups):
            raise ValueError(
                f"trajectory_rows: must give one row count per trajectory ({len(groups)}), got {len(rows)}"
            )
    elif any(g is None for g in groups):
        raise ValueError(
            "trajectory_rows: required when rollout_groups holds None (each row of such a "
            "trajectory is its own rollout, so its row count must be given)"
        )
    counts: list[int] = []
    refs: list[float | None] = []
    logical: list[int] = []
    labels: list[tuple[int, int]] = []
    for t, g in enumerate(groups):
        if g is None:
            assert rows is not None
            counts += [1] * rows[t]
            refs += [None] * rows[t]
            logical.append(rows[t])
            labels += [(t, k) for k in range(rows[t])]
        else:
            if rows is not None:
                try:
                    g.validate_rows(rows[t])
                except WorkflowContractError as exc:
                    raise WorkflowContractError(f"rollout_groups[{t}]: {exc}") from None
            counts += list(g.row_counts)
            refs += list(g.rewards)
            logical.append(g.n_rollouts)
            labels += [(t, k) for k in range(g.n_rollouts)]
    if sum(counts) != n_rows:
        raise ValueError(
            f"rewards: has {n_rows} rows but rollout_groups cover {sum(counts)} rows; "
            "they must be equal (rows of each trajectory, in order)"
        )
    return counts, refs, logical, labels


def normalize_rewards(
    rewards: torch.Tensor | Sequence[float],
    config: NormConfig,
    *,
    rollout_groups: Sequence[RolloutGroup | None] | None = None,
    trajectory_rows: Sequence[int] | None = None,
    group_sizes: Sequence[int] | None = None,
    reward_bias: float = 0.0,
    reward_scaling: float = 1.0,
    reward_clip: float = math.inf,
    unpenalized: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Trainer-side reward normalization against one reference per logical rollout.

    Each row's score is ``clamp((reward + bias) * scaling, -clip, clip)``. Statistics
    come from one reference per logical rollout (its explicit ``rollout_reward``, else
    its rows' common reward, transformed the same way), so rows never reweight them;
    each row is then ``(score - baseline) / divisor`` with its rollout's baseline and
    divisor. Leave-one-out leaves out the row's whole rollout. With a std level, a
    std ``<= eps`` gives divisor 1 (centering only), else ``std + eps``. float64
    inside, float32 out.

    Args:
        rewards: 1-D row rewards (after any overlong penalty), all trajectories
            concatenated in order.
        config: The normalization settings. With both levels ``None`` the scores are
            returned and no reference is needed.
        rollout_groups: One entry per trajectory (= prompt group), in row order: a
            :class:`RolloutGroup` (its rollouts and references) or ``None`` (each row
            of that trajectory is its own rollout). ``None`` for the whole argument:
            every row is its own rollout.
        trajectory_rows: Rows of each trajectory; required when ``rollout_groups``
            holds ``None``, and checked against each group's ``row_counts`` if given.
        group_sizes: Logical rollouts per group, used only when ``rollout_groups`` is
            not given (with it the sizes are its ``n_rollouts``, and a ``group_sizes``
            that differs is an error). Default: fixed ``config.group_size``.
        reward_bias: Added to every reward and reference before scaling.
        reward_scaling: Multiplies every biased reward and reference.
        reward_clip: Scores and references are clipped to ``[-clip, clip]``; ``> 0``.
        unpenalized: Optional pre-penalty row rewards; rows of a rollout without an
            explicit reference must agree there too, so a length penalty cannot hide
            different raw rewards.

    Returns:
        float32 tensor shaped like ``rewards``.

    Raises:
        WorkflowContractError: A rollout without an explicit reference has rows with
            different rewards ("supply an explicit rollout_reward"), or a group's row
            counts do not match ``trajectory_rows``.
        ValueError: Shapes, sizes or numbers are invalid (message names the argument).
    """
    x = _real_tensor("rewards", rewards)
    if x.ndim != 1:
        raise ValueError(f"rewards: must be 1-D (one reward per row), got shape {tuple(x.shape)}")
    x = x.to(_F64)
    # A sum is finite when every term is (the elementwise check runs only if it is not,
    # which overflow alone can also cause).
    if not math.isfinite(float(x.sum())) and not bool(torch.isfinite(x).all()):
        raise ValueError("rewards: must be finite")
    unp: torch.Tensor | None = None
    if unpenalized is not None:
        unp = _real_tensor("unpenalized", unpenalized).to(_F64)
        if tuple(unp.shape) != tuple(x.shape):
            raise ValueError(f"unpenalized: must have the shape of rewards {tuple(x.shape)}, got {tuple(unp.shape)}")
    bias = _finite_real("reward_bias", reward_bias)
    scaling = _finite_real("reward_scaling", reward_scaling)
    if isinstance(reward_clip, bool) or not isinstance(reward_clip, numbers.Real) or not reward_clip > 0:
        raise ValueError(f"reward_clip: must be a real number > 0 (inf for no clipping), got {reward_clip!r}")
    clip = float(reward_clip)

    def transform(v: torch.Tensor) -> torch.Tensor:
        if bias == 0.0 and scaling == 1.0 and clip == math.inf:
            return v
        return ((v + bias) * scaling).clamp(min=-clip, max=clip)

    scores = transform(x)
    if rollout_groups is None:
        # Every row is its own rollout and its own reference: nothing to check per rollout.
        if trajectory_rows is not None:
            raise ValueError("trajectory_rows: only meaningful together with rollout_groups")
        sizes = _group_sizes(x.numel(), config, group_sizes, what="logical rollouts")
        if config.is_identity or x.numel() == 0:
            return scores.to(torch.float32)
        mean, std = _baseline_std(scores, None, config, sizes, None)
        return ((scores - mean) / _divisor(std, config)).to(torch.float32)

    counts, refs, logical, labels = _logical_rollouts(x.numel(), rollout_groups, trajectory_rows)
    if group_sizes is not None and _positive_ints("group_sizes", group_sizes) != logical:
        raise ValueError(
            f"group_sizes: must equal the logical rollouts per trajectory {logical} "
            f"(taken from rollout_groups), got {list(group_sizes)!r}; pass only one of them"
        )
    sizes = logical if config.uses_group_level else None  # they sum to len(counts) by construction
    if config.is_identity or x.numel() == 0:
        return scores.to(torch.float32)

    count_t = torch.tensor(counts, dtype=torch.long)
    starts = torch.cumsum(count_t, 0) - count_t
    member = torch.repeat_interleave(count_t)  # each row's rollout index
    supplied = torch.tensor([r is not None for r in refs], dtype=torch.bool)
    explicit = torch.tensor([0.0 if r is None else r for r in refs], dtype=_F64)
    reference = torch.where(supplied, explicit, x[starts])

    differs = x != reference[member]
    if unp is not None:
        differs |= unp != unp[starts][member]
    bad = differs & ~supplied[member]
    if bool(bad.any()):
        k = int(member[int(torch.nonzero(bad)[0])])
        a, b = int(starts[k]), int(starts[k]) + counts[k]
        t, local = labels[k]
        detail = f"rows {a}..{b - 1} have rewards {x[a:b].tolist()}"
        if unp is not None:
            detail += f" (unpenalized {unp[a:b].tolist()})"
        raise WorkflowContractError(f"rollout_reward: rollout {local} of trajectory {t}: {detail}. {_SPLIT_ROWS_MESSAGE}")

    mean, std = _baseline_std(transform(reference), None, config, sizes, None)
    divisor = _divisor(std, config).expand(reference.shape)
    return ((scores - mean[member]) / divisor[member]).to(torch.float32)


def _divisor(std: torch.Tensor, config: NormConfig) -> torch.Tensor:
    """``std + eps``, or 1 where ``std <= eps`` (and everywhere without a std level)."""
    if config.std_level is None:
        return torch.ones_like(std)
    return torch.where(std <= config.eps, torch.ones_like(std), std + config.eps)
