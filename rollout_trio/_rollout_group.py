"""``RolloutGroup``: which rows of a trajectory belong to which logical rollout."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import attrs

from ._errors import RewardValueError, WorkflowContractError

__all__ = ["FLOAT32_MAX", "RolloutGroup", "as_reward_scalar"]

#: The largest finite float32: rewards are float32 in training batches, so a reward
#: beyond it would silently become an infinity there.
FLOAT32_MAX = 3.4028234663852886e38


def as_reward_scalar(value: Any, *, what: str = "rollout_reward") -> float:
    """``value`` as a Python float, if it is one finite real scalar.

    Accepts Python and NumPy reals and 0-d (or one-element 1-d) tensors and arrays;
    rejects bools, NaN, infinities, values float32 cannot hold and anything else with
    :class:`WorkflowContractError`.
    """
    if type(value) is float and -FLOAT32_MAX <= value <= FLOAT32_MAX:  # the common case, without ABC checks
        return value
    if isinstance(value, bool) or (hasattr(value, "dtype") and str(value.dtype) == "bool"):
        raise RewardValueError(f"{what}: must be a finite real number, not a bool, got {value!r}")
    if hasattr(value, "ndim") and hasattr(value, "item"):  # torch tensor or numpy array/scalar
        if value.ndim != 0:
            raise RewardValueError(
                f"{what}: must be a scalar (0-d), got an array of shape {tuple(value.shape)}"
            )
        value = value.item()
        if isinstance(value, bool):
            raise RewardValueError(f"{what}: must be a finite real number, not a bool, got {value!r}")
    if not isinstance(value, numbers.Real):
        raise RewardValueError(
            f"{what}: must be a finite real number, got {type(value).__name__} {value!r}"
        )
    out = float(value)
    if not math.isfinite(out):
        raise RewardValueError(f"{what}: rollout_reward must be finite, got {out!r}")
    if abs(out) > FLOAT32_MAX:
        raise RewardValueError(
            f"{what}: must fit in float32 (|reward| <= {FLOAT32_MAX:.7g}), got {out!r}"
        )
    return out


def _row_counts(value: Any) -> tuple[int, ...]:
    if type(value) is tuple and value and all(type(c) is int for c in value) and min(value) >= 1:
        return value  # the common case, without ABC checks
    try:
        counts = tuple(value)
    except TypeError:
        raise WorkflowContractError(
            f"RolloutGroup.row_counts: rollout row_counts must be positive integers, got {value!r}"
        ) from None
    if not counts or any(
        isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1 for c in counts
    ):
        raise WorkflowContractError(
            f"RolloutGroup.row_counts: rollout row_counts must be positive integers, got {list(counts)!r}"
        )
    return tuple(int(c) for c in counts)


def _references(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)  # checked (and made floats) in __attrs_post_init__


@attrs.frozen
class RolloutGroup:
    """Row counts (and optional reward references) of the logical rollouts in a trajectory.

    One logical rollout is one workflow call; it may export several rows.
    ``row_counts[k]`` is the number of rows of rollout ``k`` (rows are contiguous, in
    order) and ``rewards[k]`` its reference reward or ``None``. An empty ``rewards``
    means no references.

    Args:
        row_counts: rows per logical rollout (ints >= 1).
        rewards: one reference reward (a finite real) or None per rollout, or empty.

    Raises:
        WorkflowContractError: a count is not a positive int, a reward is not a finite
            real, or ``rewards`` does not give one per rollout.
    """

    row_counts: tuple[int, ...] = attrs.field(converter=_row_counts)
    rewards: tuple[float | None, ...] = attrs.field(default=(), converter=_references)

    def __attrs_post_init__(self) -> None:
        rewards = self.rewards or (None,) * len(self.row_counts)
        if len(rewards) != len(self.row_counts):
            raise WorkflowContractError(
                f"RolloutGroup.rewards: rollout rewards must match row_counts "
                f"({len(self.row_counts)} rollouts), got {len(rewards)} rewards"
            )
        rewards = tuple(
            None if r is None else as_reward_scalar(r, what=f"RolloutGroup.rewards[{k}]")
            for k, r in enumerate(rewards)
        )
        object.__setattr__(self, "rewards", rewards)

    @classmethod
    def unchecked(cls, row_counts: tuple[int, ...], rewards: tuple[float | None, ...]) -> RolloutGroup:
        """Build from values the library produced and checked itself (no conversion, no checks)."""
        self = object.__new__(cls)
        object.__setattr__(self, "row_counts", row_counts)
        object.__setattr__(self, "rewards", rewards)
        return self

    @property
    def n_rollouts(self) -> int:
        """Number of logical rollouts."""
        return len(self.row_counts)

    @property
    def n_rows(self) -> int:
        """Total number of rows."""
        return sum(self.row_counts)

    def validate_rows(self, rows: int) -> RolloutGroup:
        """Return ``self`` if the row counts add up to ``rows``, else raise."""
        if self.n_rows != rows:
            raise WorkflowContractError(
                f"rollout_group: rollout row_counts sum to {self.n_rows}, expected {rows} (the trajectory's rows)"
            )
        return self

    def member_index(self) -> list[int]:
        """For each row, the index of the logical rollout it belongs to."""
        return [k for k, c in enumerate(self.row_counts) for _ in range(c)]
