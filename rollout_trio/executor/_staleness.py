"""The staleness budget: how many rollouts may start before the trainer's next version.

Pure, synchronous and thread-safe (one lock), so it can be tested alone and shared
with a trainer thread. The formula is the reference's (``areal/infra/staleness_manager.py``).
"""

from __future__ import annotations

import threading
from typing import Protocol

import attrs

__all__ = ["RolloutStat", "StalenessManager", "VersionProvider"]


class VersionProvider(Protocol):
    """Anything with ``get_version()`` (an inference engine)."""

    def get_version(self) -> int: ...


@attrs.frozen
class RolloutStat:
    """The manager's counters (they may go negative on misuse; nothing is validated)."""

    enqueued: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0


class StalenessManager:
    """Bounds rollouts so the oldest unconsumed one lags the trainer by at most ``max_staleness``.

    With version ``V``, ``C = max(1, max_concurrent_rollouts)``, ``b = max(1,
    consumer_batch_size)``, ``s = max_staleness``::

        capacity = min(C - running, (s + V + 1) * b - (accepted + running))

    Rejected rollouts never consume budget; consuming a batch changes nothing; only a
    version bump opens budget (or :meth:`on_version_recovered` after a checkpoint resume).
    """

    def __init__(
        self,
        version_provider: VersionProvider,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_staleness: int,
    ) -> None:
        self.version_provider = version_provider
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._enqueued = 0
        self._running = 0
        self._accepted = 0
        self._rejected = 0

    @classmethod
    def for_data_parallel(
        cls,
        version_provider: VersionProvider,
        *,
        max_concurrent_rollouts: int | None,
        consumer_batch_size: int,
        max_staleness: int,
        dp_size: int = 1,
    ) -> StalenessManager:
        """The manager of one of ``dp_size`` trainer ranks: concurrency and batch size divided.

        ``max_concurrent_rollouts`` defaults to ``consumer_batch_size``; ``max_staleness``
        is not scaled.
        """
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size: must be an integer >= 1, got {dp_size!r}")
        m = max_concurrent_rollouts or consumer_batch_size
        return cls(version_provider, max(1, m // dp_size), max(1, consumer_batch_size // dp_size), max_staleness)

    # -- transitions --------------------------------------------------------------------

    def on_rollout_enqueued(self) -> None:
        """An input was queued."""
        with self._lock:
            self._enqueued += 1

    def on_rollout_dequeued(self) -> None:
        """A queued input was dropped before it started (cancelled)."""
        with self._lock:
            self._enqueued -= 1

    def on_rollout_submitted(self) -> None:
        """A queued input started running."""
        with self._lock:
            self._enqueued -= 1
            self._running += 1

    def on_rollout_accepted(self) -> None:
        """A running rollout finished and was accepted."""
        with self._lock:
            self._running -= 1
            self._accepted += 1

    def on_rollout_rejected(self) -> None:
        """A running rollout finished without a trajectory (rejected, failed or cancelled)."""
        with self._lock:
            self._running -= 1
            self._rejected += 1

    def on_rollout_discarded(self) -> None:
        """An accepted rollout was dropped before the trainer took it (stale): its budget returns."""
        with self._lock:
            self._accepted -= 1
            self._rejected += 1

    def on_version_recovered(self, version: int) -> None:
        """After resuming from a checkpoint at ``version``: count its batches as accepted."""
        with self._lock:
            self._accepted = version * max(1, self.consumer_batch_size)

    # -- queries ------------------------------------------------------------------------

    def get_stats(self) -> RolloutStat:
        """A copy of the counters."""
        with self._lock:
            return RolloutStat(self._enqueued, self._running, self._accepted, self._rejected)

    def get_capacity(self, include_concurrency: bool = True) -> int:
        """How many more rollouts may start now (may be negative)."""
        with self._lock:
            version = self.version_provider.get_version()
            b = max(1, self.consumer_batch_size)
            staleness = (self.max_staleness + version + 1) * b - (self._accepted + self._running)
            if not include_concurrency:
                return staleness
            return min(max(1, self.max_concurrent_rollouts) - self._running, staleness)

    def get_pending_limit(self) -> int:
        """The most inputs ``prepare_batch`` keeps queued ahead: ``(s + 1) * consumer_batch_size``."""
        return (self.max_staleness + 1) * self.consumer_batch_size
