"""A reference model of the executor, in plain Python: what each call must do.

The model runs one rollout at a time (``max_concurrent_rollouts=1``), where the order of
events is fully determined: a task started at ``t`` with duration ``d`` ends at the first
instant ``>= t + d`` the clock reaches, and the next starts then. Its rules are the
executor's, written again from the issue's statement of them:

* admission: not paused; one running at most; a common-pool (``submit``) task only while
  its running tasks plus the pool's waiting results are below ``queue_size``; a training
  task only while ``(s + V + 1) * b - (accepted + running)`` is positive; evaluation before
  training, else the oldest submitted first;
* ownership: a result goes to its owner (the pool, one batch call, the feed); a call takes
  its results in one step when it returns; a cancelled batch call's unfinished tasks are
  cancelled and its accepted training results go to the pool (evaluation ones are dropped);
* staleness: an untaken training result whose tokens are more than ``s`` versions behind is
  dropped (and its budget returned) before any take, and before anything is started;
* liveness: a training ``rollout_batch`` larger than the budget left after the training
  work queued ahead is refused at once; a call whose owner's tasks end ``max_rejections``
  times in a row without a trajectory raises ``ExecutorStalled``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

DURATION = {"ok": 1.0, "slow": 5.0, "fail": 1.0, "none": 1.0}
REASON = {"fail": "workflow_exception", "none": "returned_none"}


@dataclass(eq=False)
class MTask:
    tid: int
    kind: str
    owner: MOwner
    is_eval: bool
    order: int
    state: str = "queued"  # queued running ended taken
    status: str | None = None  # accepted rejected failed cancelled
    dropped: str | None = None  # stale abandoned
    seq: int = 0
    end: float = 0.0
    version: int = 0

    @property
    def deliverable(self) -> bool:
        return self.status == "accepted" and self.dropped is None


@dataclass(eq=False)
class MOwner:
    kind: str  # common batch feed
    finished: dict[int, MTask] = field(default_factory=dict)
    unfinished: int = 0
    abandoned: bool = False
    run: int = 0  # ended in a row without a trajectory
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(eq=False)
class MCall:
    """A consumer call in flight: ``outcome`` is None while it waits."""

    kind: str  # wait wait_for batch prepare
    arg: Any
    owner: MOwner
    tasks: list[MTask] = field(default_factory=list)
    outcome: tuple[str, Any] | None = (
        None  # ("ok", [tids]) | ("raise", name) | ("cancelled", None)
    )


class Model:
    def __init__(
        self,
        *,
        batch: int,
        staleness: int,
        queue_size: int,
        max_rejections: int,
        source: list[str],
    ) -> None:
        self.b, self.s, self.q, self.max_rejections = (
            batch,
            staleness,
            queue_size,
            max_rejections,
        )
        self.now = 0.0
        self.version = 0
        self.paused = False
        self.accepted_mgr = 0  # the staleness manager's accepted count
        self.common = MOwner("common")
        self.tasks: dict[int, MTask] = {}
        self.queue: list[MTask] = []
        self.running: MTask | None = None
        self.calls: list[MCall] = []
        self.next_id = self.order = self.seq = 0
        self.counts: collections.Counter[str] = (
            collections.Counter()
        )  # submitted accepted stale discarded cancelled
        self.rejected: collections.Counter[str] = collections.Counter()
        self.failed: collections.Counter[str] = collections.Counter()
        self.delivered: list[int] = []
        self.feed = MOwner("feed")
        self.feed_tasks: list[MTask] = []
        self.source = source
        self.source_pos = 0

    # -- admission ---------------------------------------------------------------------------

    def running_training(self) -> int:
        return int(self.running is not None and not self.running.is_eval)

    def budget_left(self) -> int:
        return (self.s + self.version + 1) * self.b - (
            self.accepted_mgr + self.running_training()
        )

    def pool(self) -> int:
        return sum(1 for t in self.common.finished.values() if t.deliverable)

    def queued_training(self) -> int:
        return sum(1 for t in self.queue if not t.is_eval)

    def _startable(self, task: MTask) -> bool:
        if task.owner is self.common:
            running_common = int(
                self.running is not None and self.running.owner is self.common
            )
            if running_common + self.pool() >= self.q:
                return False
        return task.is_eval or self.budget_left() > 0

    def _next(self) -> MTask | None:
        if self.paused or self.running is not None:
            return None
        for want_eval in (True, False):
            for task in self.queue:  # in submission order
                if task.is_eval == want_eval and self._startable(task):
                    return task
        return None

    # -- events ------------------------------------------------------------------------------

    def enqueue(self, kind: str, owner: MOwner, is_eval: bool) -> MTask:
        while self.next_id in self.tasks:
            self.next_id += 1
        self.order += 1
        task = MTask(self.next_id, kind, owner, is_eval, self.order)
        self.next_id += 1
        self.tasks[task.tid] = task
        owner.unfinished += 1
        self.queue.append(task)
        self.counts["submitted"] += 1
        return task

    def _conclude(self, task: MTask, status: str, reason: str | None) -> None:
        task.state, task.status = "ended", status
        owner = task.owner
        owner.unfinished -= 1
        if status == "accepted":
            owner.run = 0
            owner.reasons.clear()
        elif status != "cancelled":
            owner.run += 1
            owner.reasons[reason or status] += 1
        if status == "rejected":
            self.rejected[reason or "rejected"] += 1
        elif status == "failed":
            self.failed[reason or "failed"] += 1
        elif status == "cancelled":
            self.counts["cancelled"] += 1
        if owner.abandoned:
            self._hand_on(task)
        elif owner is self.common and status != "accepted":
            self._forget(task)
        else:
            owner.finished[task.tid] = task

    def _forget(self, task: MTask) -> None:
        self.tasks.pop(task.tid, None)
        task.owner.finished.pop(task.tid, None)
        task.state = "taken"

    def _hand_on(self, task: MTask) -> None:
        task.owner.finished.pop(task.tid, None)
        if task.deliverable and task.is_eval:
            task.dropped = "abandoned"
            self.counts["discarded"] += 1
        task.owner = self.common
        if task.deliverable:
            self.common.finished[task.tid] = task
        else:
            self._forget(task)

    def sweep(self) -> None:
        floor = self.version - self.s
        for owner in [
            self.common,
            self.feed,
            *(c.owner for c in self.calls if c.kind == "batch"),
        ]:
            for task in list(owner.finished.values()):
                if task.deliverable and not task.is_eval and task.version < floor:
                    task.dropped = "stale"
                    self.counts["stale"] += 1
                    self.accepted_mgr -= 1
                    if owner is self.common:
                        self._forget(task)

    def _take(self, task: MTask) -> int | None:
        self.tasks.pop(task.tid, None)
        task.owner.finished.pop(task.tid, None)
        task.state = "taken"
        if not task.deliverable:
            return None
        self.counts["accepted"] += 1
        self.delivered.append(task.tid)
        return task.tid

    def cancel_task(self, tid: int) -> bool:
        task = self.tasks.get(tid)
        if task is None or task.status is not None:
            return False
        if task is self.running:
            self.running = None
            self._conclude(task, "cancelled", "cancelled")
        else:
            self.queue.remove(task)
            self._conclude(task, "cancelled", "cancelled")
        return True

    def abandon(self, call: MCall) -> None:
        owner = call.owner
        owner.abandoned = True
        for task in list(owner.finished.values()):
            self._hand_on(task)
        for task in call.tasks:
            self.cancel_task(task.tid)

    def settle(self) -> None:
        """Run everything that happens at ``now``, until nothing more does."""
        changed = True
        while changed:
            changed = False
            task = self.running
            if task is not None and task.end <= self.now:
                self.running = None
                if task.kind in ("ok", "slow"):
                    task.version = self.version
                    if not task.is_eval:
                        self.accepted_mgr += 1
                    self._conclude(task, "accepted", None)
                else:
                    self._conclude(
                        task,
                        "rejected" if task.kind == "none" else "failed",
                        REASON[task.kind],
                    )
                changed = True
            # The calls woken by an event take their results before anything starts (the
            # dispatcher yields once after each wake).
            queued = len(self.queue)
            for call in [c for c in self.calls if c.outcome is None]:
                if self._serve(call):
                    changed = True
            changed = changed or len(self.queue) != queued  # prepare_batch queued more
            if self.queue:
                self.sweep()
            nxt = self._next()
            if nxt is not None:
                self.queue.remove(nxt)
                self.seq += 1
                nxt.seq, nxt.state, nxt.end = (
                    self.seq,
                    "running",
                    self.now + DURATION[nxt.kind],
                )
                self.running = nxt
                changed = True

    # -- consumer calls ----------------------------------------------------------------------

    def _stalled(self, call: MCall) -> bool:
        if call.owner.run >= self.max_rejections:
            call.owner.run = 0
            call.owner.reasons.clear()
            call.outcome = ("raise", "ExecutorStalled")
            if call.kind == "batch":
                self.abandon(call)
            return True
        return False

    def _serve(self, call: MCall) -> bool:
        """Let one waiting call look at the state, as it does on every wake."""
        if call.kind == "wait_for":
            self.sweep()
            task = self.tasks.get(call.arg)
            if task is None:
                call.outcome = ("ok", [])
                return True
            if task.status is not None:
                tid = self._take(task)
                call.outcome = ("ok", [] if tid is None else [tid])
                return True
            return False
        if call.kind == "wait":
            self.sweep()
            ready = sorted(
                (t for t in self.common.finished.values() if t.deliverable),
                key=lambda t: t.seq,
            )
            if len(ready) >= call.arg:
                call.outcome = ("ok", [self._take(t) for t in ready[: call.arg]])
                return True
            return self._stalled(call)
        if call.kind == "batch":
            if call.owner.unfinished == 0:
                self.sweep()
                call.outcome = (
                    "ok",
                    [tid for t in call.tasks if (tid := self._take(t)) is not None],
                )
                return True
            return self._stalled(call)
        if call.kind == "prepare":
            return self._serve_prepare(call)
        raise AssertionError(call.kind)

    def _top_up(self, batch_size: int) -> None:
        limit = (self.s + 1) * self.b
        while True:
            outstanding = sum(
                1 for t in self.feed_tasks if t.status is None or t.deliverable
            )
            if outstanding >= max(limit, batch_size):
                return
            kind = self.source[self.source_pos % len(self.source)]
            self.source_pos += 1
            self.feed_tasks.append(self.enqueue(kind, self.feed, False))

    def _serve_prepare(self, call: MCall) -> bool:
        size = call.arg
        self.sweep()
        self._top_up(size)
        chosen: list[MTask] = []
        kept = 0
        for task in sorted(self.feed.finished.values(), key=lambda t: t.seq):
            chosen.append(task)
            kept += task.deliverable
            if kept >= size:
                for t in chosen:
                    self.feed_tasks.remove(t)
                call.outcome = (
                    "ok",
                    [tid for t in chosen if (tid := self._take(t)) is not None],
                )
                return True
        # (a new task was queued above: the dispatcher may start it in this same instant)
        return self._stalled(call)

    def start_call(self, call: MCall) -> None:
        """A call enters: refuse it at once, or let it wait (it is served in ``settle``)."""
        if call.kind == "batch":
            kinds, is_eval = call.arg
            self.sweep()
            if not is_eval and len(kinds) > self.budget_left() - self.queued_training():
                call.outcome = ("raise", "ValueError")
                return
            call.tasks = [self.enqueue(k, call.owner, is_eval) for k in kinds]
        if call.kind == "prepare":
            self.sweep()
            in_hand = len(self.feed.finished) + int(
                self.running is not None and self.running.owner is self.feed
            )
            own_queued = sum(1 for t in self.queue if t.owner is self.feed)
            budget = max(0, self.budget_left() - (self.queued_training() - own_queued))
            if in_hand + budget < call.arg:
                call.outcome = ("raise", "ValueError")
                return
        self.calls.append(call)
        self._serve(call)

    def cancel_call(self, call: MCall) -> None:
        if call.outcome is None:
            call.outcome = ("cancelled", None)
            if call.kind == "batch":
                self.abandon(call)

    # -- what the executor must report -------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        held = [t for t in self.tasks.values() if t.state == "ended" and t.deliverable]
        return {
            "running_ids": [] if self.running is None else [self.running.tid],
            "submitted": self.counts["submitted"],
            "queued": len(self.queue),
            "running": int(self.running is not None),
            "buffered+stale": len(held) + self.counts["stale"],
            "accepted": self.counts["accepted"],
            "rejected_by_reason": dict(self.rejected),
            "failed_by_reason": dict(self.failed),
            "cancelled": self.counts["cancelled"],
            "discarded": self.counts["discarded"],
            "paused": self.paused,
        }
