"""Where group statistics go: per key and scope aggregates a trainer reads and resets.

Memory is O(keys): each ``"scope/name"`` keeps a count, sum, sum of squares, min and
max, whatever the number of records, so a recorder nobody exports never grows.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import attrs

__all__ = ["StatSummary", "StatsRecorder"]


@attrs.frozen
class StatSummary:
    """The aggregate of every value recorded under one ``"scope/name"``.

    Attributes:
        count: how many values were recorded.
        total: their sum.
        sum_of_squares: the sum of their squares.
        min: the smallest.
        max: the largest.

    Raises:
        TypeError: a field left out (:meth:`StatsRecorder.summaries` makes these; the fields are
            not validated).
    """

    count: int
    total: float
    sum_of_squares: float
    min: float
    max: float

    @property
    def mean(self) -> float:
        """The average value."""
        return self.total / self.count

    @property
    def std(self) -> float:
        """The population standard deviation (from the sums, clamped at 0 against rounding)."""
        return math.sqrt(max(self.sum_of_squares / self.count - self.mean**2, 0.0))


class _Aggregate:
    __slots__ = ("count", "max", "min", "sum_of_squares", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.sum_of_squares = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.sum_of_squares += value * value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value

    def summary(self) -> StatSummary:
        return StatSummary(self.count, self.total, self.sum_of_squares, self.min, self.max)


class StatsRecorder:
    """Aggregates scalar statistics under scopes (``"rollout"``, ``"eval-rollout"``).

    Thread-safe, so a trainer on another thread can :meth:`export` while rollouts run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._aggregates: dict[str, _Aggregate] = {}

    def record(self, scope: str, values: Mapping[str, float]) -> None:
        """Add ``values`` (one value per name) to the aggregates of ``scope``.

        Args:
            scope: the prefix of the keys (``"rollout"``, ``"eval-rollout"``).
            values: name -> value; each is read as a float.

        Raises:
            TypeError, ValueError: a value ``float()`` refuses (nothing is recorded then).
        """
        items = [(f"{scope}/{name}", float(value)) for name, value in values.items()]
        with self._lock:
            aggregates = self._aggregates
            for key, value in items:
                agg = aggregates.get(key)
                if agg is None:
                    agg = aggregates[key] = _Aggregate()
                agg.add(value)

    def summaries(self, *, reset: bool = False) -> dict[str, StatSummary]:
        """Each ``"scope/name"``'s aggregate so far.

        Args:
            reset: also forget them (the next call starts from nothing).

        Returns:
            ``"scope/name"`` -> :class:`StatSummary`.
        """
        with self._lock:
            aggregates = self._aggregates
            if reset:
                self._aggregates = {}
            return {key: agg.summary() for key, agg in aggregates.items()}

    def export(self, *, reset: bool = True) -> dict[str, float]:
        """The mean of each ``"scope/name"``.

        Args:
            reset: forget the aggregates (the default), as a trainer reading once per step wants.

        Returns:
            ``"scope/name"`` -> the mean of its values.
        """
        return {key: s.mean for key, s in self.summaries(reset=reset).items()}
