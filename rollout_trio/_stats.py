"""Where group statistics go: a recorder a trainer reads and resets."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import attrs

__all__ = ["StatsRecorder"]


@attrs.frozen
class StatsRecord:
    """One call of :meth:`StatsRecorder.record`: a scope and its scalars."""

    scope: str
    values: Mapping[str, float]


class StatsRecorder:
    """Collects scalar statistics under scopes (``"rollout"``, ``"eval-rollout"``).

    Thread-safe, so a trainer on another thread can :meth:`export` while rollouts run.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[StatsRecord] = []

    def record(self, scope: str, values: Mapping[str, float]) -> None:
        """Append one record of ``values`` under ``scope``."""
        rec = StatsRecord(scope, dict(values))
        with self._lock:
            self._records.append(rec)

    @property
    def records(self) -> list[StatsRecord]:
        """Every record so far, oldest first (a copy)."""
        with self._lock:
            return list(self._records)

    def export(self, *, reset: bool = True) -> dict[str, float]:
        """The mean of each ``"scope/name"`` over the records, and (by default) forget them."""
        with self._lock:
            records = self._records
            if reset:
                self._records = []
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for rec in records:
            for name, value in rec.values.items():
                key = f"{rec.scope}/{name}"
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
        return {key: sums[key] / counts[key] for key in sums}
