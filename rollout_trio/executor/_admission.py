"""Admission: which queued task starts next, under capacity and the staleness budget.

A queued task waits in one of four FIFO queues, by (training or evaluation) and (the
common pool's, i.e. ``submit``'s, or owned by a call). A task starts when:

* the executor is not paused, and fewer than ``max_concurrent_rollouts`` tasks run;
* a common-pool task: its running tasks plus the results waiting for ``wait()`` are below
  ``queue_size`` (only the pool's work counts: a call's own results never hold anything up);
* a training task: the staleness budget has room (:class:`StalenessManager`).

Within those rules the oldest submitted task goes first; evaluation tasks are not held by
the budget. A training call checks its size against :meth:`Admission.budget_for_new`: the
budget left once every training task queued ahead of it has started.
"""

from __future__ import annotations

import collections

from ._staleness import StalenessManager
from ._store import Task

__all__ = ["Admission"]


class Admission:
    """The queues, the running set and the gates of one executor."""

    def __init__(self, staleness: StalenessManager, queue_size: int) -> None:
        self.staleness = staleness
        self.queue_size = queue_size
        self.paused = False
        self.running: set[Task] = set()
        self.running_common = 0  # of them, the common pool's
        self.pool_buffered = 0  # the common pool's accepted results waiting for wait()
        # (training?, common?) -> FIFO of queued tasks
        self._queues: dict[tuple[bool, bool], collections.deque[Task]] = {
            key: collections.deque() for key in ((True, True), (True, False), (False, True), (False, False))
        }

    # -- the queues ------------------------------------------------------------------------

    def _queue_of(self, task: Task) -> collections.deque[Task]:
        return self._queues[(not task.is_eval, task.owner.kind == "common")]

    def queue(self, task: Task) -> None:
        self._queue_of(task).append(task)
        if not task.is_eval:
            self.staleness.on_rollout_enqueued()

    def unqueue(self, task: Task) -> None:
        """Drop a queued task (cancelled before it started)."""
        self._queue_of(task).remove(task)
        if not task.is_eval:
            self.staleness.on_rollout_dequeued()

    def drain(self) -> list[Task]:
        """Take every queued task out (the executor closes), oldest first."""
        tasks = sorted((t for q in self._queues.values() for t in q), key=lambda t: t.order)
        for task in tasks:
            self.unqueue(task)
        return tasks

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    @property
    def queued_training(self) -> int:
        return len(self._queues[(True, True)]) + len(self._queues[(True, False)])

    # -- the gates -------------------------------------------------------------------------

    def _concurrency_room(self) -> bool:
        return not self.paused and len(self.running) < max(1, self.staleness.max_concurrent_rollouts)

    def _pool_room(self) -> bool:
        return self.running_common + self.pool_buffered < self.queue_size

    def _head(self, training: bool) -> Task | None:
        """The oldest queued task of one kind that its own gates let start, or None."""
        owned = self._queues[(training, False)]
        common = self._queues[(training, True)]
        candidates = [owned[0]] if owned else []
        if common and self._pool_room():
            candidates.append(common[0])
        return min(candidates, key=lambda t: t.order, default=None)

    def next_task(self) -> Task | None:
        """Pop the next task to start now (evaluation first), or None."""
        if not self._concurrency_room():
            return None
        task = self._head(training=False)
        if task is None and self.staleness.get_capacity() > 0:
            task = self._head(training=True)
        if task is not None:
            self._queue_of(task).popleft()
        return task

    def started(self, task: Task) -> None:
        self.running.add(task)
        if task.owner.kind == "common":
            self.running_common += 1
        if not task.is_eval:
            self.staleness.on_rollout_submitted()

    def ended(self, task: Task, accepted: bool) -> None:
        self.running.discard(task)
        if task.owner.kind == "common":
            self.running_common -= 1
        if not task.is_eval:
            if accepted:
                self.staleness.on_rollout_accepted()
            else:
                self.staleness.on_rollout_rejected()

    def starved(self) -> bool:
        """Training work waits on the budget alone (only a version bump, which the trainer
        may make on the engine directly, can open it)."""
        return self.queued_training > 0 and self._concurrency_room() and self._head(training=True) is not None

    # -- the budget ------------------------------------------------------------------------

    def budget_left(self) -> int:
        """Training starts the budget allows before the next version bump."""
        return self.staleness.get_capacity(include_concurrency=False)

    def budget_for_new(self) -> int:
        """What is left of it for a new call, once the training tasks queued ahead have started."""
        return self.budget_left() - self.queued_training

    def budget_text(self, version: int) -> str:
        st = self.staleness.get_stats()
        return (
            f"(max_head_offpolicyness {self.staleness.max_staleness} + version {version} + 1) "
            f"* consumer_batch_size {self.staleness.consumer_batch_size} - accepted {st.accepted} - running {st.running}"
            f" - queued ahead {self.queued_training}"
        )

    def waiting_on(self, version: int) -> str:
        """What holds queued work back now, in words (for the stall warning)."""
        if self.paused:
            return "the executor is paused (resume() starts work again)"
        parts = [f"{len(self.running)} running"]
        if self.queued:
            parts.append(f"{self.queued} queued")
        if self.queued_training and self.budget_left() <= 0:
            parts.append(f"the staleness budget is spent ({self.budget_text(version)} <= 0: a version bump opens it)")
        if self._queues[(True, True)] or self._queues[(False, True)]:
            if not self._pool_room():
                parts.append(
                    f"the common pool is full ({self.pool_buffered} results wait for wait() + "
                    f"{self.running_common} running >= queue_size {self.queue_size})"
                )
        return ", ".join(parts)
