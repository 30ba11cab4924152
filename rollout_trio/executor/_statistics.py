"""``ExecutorStatistics``: the executor's counters at one instant."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["ExecutorStatistics"]


@attrs.frozen(kw_only=True)
class ExecutorStatistics:
    """A snapshot of the executor (see the module docstring for the invariant).

    ``accepted`` counts trajectories handed to the trainer; ``buffered`` those waiting
    for the call that owns them; ``stale`` those dropped for exceeding the staleness
    bound before any call took them; ``discarded`` evaluation results of cancelled
    ``rollout_batch`` calls. ``capacity`` is the staleness manager's;
    ``oldest_buffered_version`` is the oldest token version of any buffered result
    (its start version when it has none; None when nothing is buffered).
    ``stale_tokens`` counts the generated tokens of the ``stale`` results (the cost of the
    per-trajectory bound: work generated, then not used); ``stalled_calls`` the consumer
    calls waiting past ``stall_warning_s`` without progress, by call.
    """

    submitted: int
    queued: int
    running: int
    buffered: int
    accepted: int
    rejected: int
    rejected_by_reason: Mapping[str, int]
    failed: int
    failed_by_reason: Mapping[str, int]
    cancelled: int
    version: int
    capacity: int
    oldest_buffered_version: int | None
    paused: bool
    stale: int = 0
    discarded: int = 0
    stale_tokens: int = 0
    stalled_calls: Mapping[str, int] = attrs.field(factory=dict)

    def balanced(self) -> bool:
        """Whether every submitted task is accounted for exactly once."""
        return self.submitted == (
            self.accepted + self.rejected + self.failed + self.cancelled + self.stale + self.discarded
            + self.queued + self.running + self.buffered
        )
