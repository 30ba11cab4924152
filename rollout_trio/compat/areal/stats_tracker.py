"""``areal.utils.stats_tracker``: ``get(scope).scalar(...)`` into the workflow's statistics.

Values go to :func:`rollout_trio.workflow_context.stats_recorder` (the run's recorder),
aggregated as count/mean/min/max; AReaL's distributed reductions do not apply.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ... import workflow_context
from ._errors import ArealCompatError

__all__ = ["StatsTracker", "export_all", "get"]


class StatsTracker:
    """Records named scalars under a scope (``"rollout"``, ``"rollout/sub"``, ...)."""

    def __init__(self, name: str = "") -> None:
        self._scopes = [name] if name else []

    def _scope(self) -> str:
        return "/".join(self._scopes)

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Record inside ``name`` (nested under the current scope) for the block."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def scalar(self, **values: float) -> None:
        """Record one value per name.

        Raises:
            ArealCompatError: a value is not a real number (AReaL's tensors go through ``stat``).
        """
        for key, value in values.items():
            if not isinstance(value, (int, float)):
                raise ArealCompatError(f"stats_tracker.scalar({key}=...): must be a number, got {type(value).__name__}")
        workflow_context.stats_recorder().record(self._scope() or "rollout", values)

    def stat(self, **_: Any) -> None:
        """Not served: per-token tensor statistics belong to the trainer.

        Raises:
            ArealCompatError: always.
        """
        raise ArealCompatError("stats_tracker.stat: tensor statistics with denominators are a trainer feature; use scalar()")

    def export(self, reset: bool = True, **_: Any) -> dict[str, float]:
        """Means of what was recorded, by ``"scope/name"`` (see ``StatsRecorder.export``)."""
        return workflow_context.stats_recorder().export(reset=reset)


def get(name: str = "") -> StatsTracker:
    """A tracker recording under scope ``name``."""
    return StatsTracker(name)


def export_all(reduce_group: Any = None, reset: bool = True) -> dict[str, float]:
    """Means of everything recorded (``reduce_group`` must be None: no distributed reduction)."""
    if reduce_group is not None:
        raise ArealCompatError("stats_tracker.export_all(reduce_group=...): no distributed reduction in rollout_trio")
    return workflow_context.stats_recorder().export(reset=reset)
