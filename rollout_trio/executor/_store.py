"""The executor's one store of tasks, each owned by the call that takes its result.

A task's *owner* is where its result goes: the common pool (``submit``; taken by
``wait`` / ``wait_for_task``), one ``rollout_batch`` call, or the ``prepare_batch`` feed.
A finished task stays in its owner until that owner's call takes it, in one synchronous
step when the call returns: a call cancelled before that step has taken nothing, so
there is nothing to undo.
"""

from __future__ import annotations

import bisect
import collections
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from .._interaction import Interaction
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow

if TYPE_CHECKING:
    from ._admission import Admission

__all__ = ["AcceptFn", "Callback", "IdSet", "Owner", "Result", "Status", "Task", "TaskOutcome", "TaskStore"]

Status = Literal["accepted", "rejected", "failed", "cancelled"]
Result = Trajectory | dict[str, Interaction]
AcceptFn = Callable[[Any], Any]


@attrs.frozen
class TaskOutcome:
    """How one task ended, as passed to its completion callback (and yielded by
    ``rollout_stream``).

    ``trajectory`` is set for accepted tasks and for tasks ``should_accept_fn`` rejected.
    """

    task_id: int
    status: Status
    reason: str | None
    trajectory: Result | None
    data: Any


Callback = Callable[[TaskOutcome], Any]


class Owner:
    """Who takes the results of some tasks (``kind``: ``"common"``, ``"batch"``, ``"stream"``
    or ``"feed"``).

    ``finished`` holds its ended, untaken tasks by id; ``unfinished`` counts its queued and
    running ones. An abandoned batch call's owner hands its results on (see the executor).
    ``ended`` counts its tasks that ended (progress, for the stall watch);
    ``unaccepted_run`` the tasks that ended in a row without a trajectory, by reason in
    ``unaccepted_reasons`` (both reset by an accepted one).
    """

    __slots__ = ("abandoned", "ended", "finished", "kind", "unaccepted_reasons", "unaccepted_run", "unfinished")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.finished: dict[int, Task] = {}
        self.unfinished = 0
        self.abandoned = False
        self.ended = 0
        self.unaccepted_run = 0
        self.unaccepted_reasons: collections.Counter[str] = collections.Counter()

    def record(self, status: str, reason: str | None) -> None:
        """Count one ended task of this owner."""
        self.ended += 1
        if status == "accepted":
            self.unaccepted_run = 0
            self.unaccepted_reasons.clear()
        elif status != "cancelled":  # a cancellation says nothing about the workflow
            self.unaccepted_run += 1
            self.unaccepted_reasons[reason or status] += 1


@attrs.define(eq=False, slots=True)
class Task:
    """One submitted task, from queued to taken."""

    task_id: int
    data: Any
    workflow: RolloutWorkflow
    should_accept_fn: Callable[[Any], Any] | None
    is_eval: bool
    callback: Callable[[Any], Any] | None
    owner: Owner
    order: int  # submission order
    seed: int | None = None  # the caller's use_seed, applied to the episode
    seq: int = 0  # start order
    start_time: float = 0.0
    start_version: int = 0
    scope: trio.CancelScope | None = None
    cancel_requested: bool = False
    status: Status | None = None
    reason: str | None = None
    result: Result | None = None
    version: int = 0  # the oldest weight version of its tokens (its start version without any)
    dropped: str | None = None  # "stale" or "abandoned": accepted, then withdrawn before delivery

    @property
    def deliverable(self) -> bool:
        """Accepted and still to be handed to a trainer call."""
        return self.status == "accepted" and self.dropped is None


class IdSet:
    """A set of ints kept as sorted disjoint ranges: task ids are mostly consecutive, so
    remembering every id ever submitted costs a few ranges, not one entry per task."""

    __slots__ = ("_hi", "_lo")

    def __init__(self) -> None:
        self._lo: list[int] = []  # range k is [_lo[k], _hi[k])
        self._hi: list[int] = []

    def __contains__(self, value: int) -> bool:
        k = bisect.bisect_right(self._lo, value) - 1
        return k >= 0 and value < self._hi[k]

    def __len__(self) -> int:
        return sum(h - lo for lo, h in zip(self._lo, self._hi))

    def add(self, value: int) -> None:
        if value in self:
            return
        k = bisect.bisect_right(self._lo, value)  # ranges before k start at or below value
        joins_left = k > 0 and self._hi[k - 1] == value
        joins_right = k < len(self._lo) and self._lo[k] == value + 1
        if joins_left and joins_right:
            self._hi[k - 1] = self._hi[k]
            del self._lo[k], self._hi[k]
        elif joins_left:
            self._hi[k - 1] = value + 1
        elif joins_right:
            self._lo[k] = value
        else:
            self._lo.insert(k, value)
            self._hi.insert(k, value + 1)

    def discard(self, value: int) -> None:
        k = bisect.bisect_right(self._lo, value) - 1
        if k < 0 or value >= self._hi[k]:
            return
        lo, hi = self._lo[k], self._hi[k]
        del self._lo[k], self._hi[k]
        for a, b in ((value + 1, hi), (lo, value)):  # reinserted in descending order at k
            if a < b:
                self._lo.insert(k, a)
                self._hi.insert(k, b)


_NONE_HELD = sys.maxsize


def _tokens_of(result: Any) -> int:
    """Generated tokens of a result (its loss-mask positions; its positions without a mask)."""
    if isinstance(result, Trajectory):
        mask = result.loss_mask if result.loss_mask is not None else result.attention_mask
        return int(mask.sum())
    return 0


class TaskStore:
    """Every task the executor knows, by id, and the accepted results waiting for their owner.

    ``buffered`` counts those results; ``admission.pool_buffered`` the common pool's share of
    them (the queue gate). A result leaves by :meth:`take` (delivered), :meth:`drop` (stale
    or abandoned) or, for a result-less task, :meth:`forget`.
    """

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.tasks: dict[int, Task] = {}  # queued, running, or finished and untaken
        self.held: dict[int, Task] = {}  # the deliverable ones among them (buffered)
        self.common = Owner("common")
        self.seen = IdSet()  # every id ever submitted
        self.resultless = IdSet()  # ended without a result for anyone (wait_for_task returns None)
        self.buffered = 0
        # A lower bound on the oldest version of any held training result: a sweep with a
        # floor at or below it has nothing to drop, and costs nothing.
        self.oldest_held = _NONE_HELD
        self.accepted = 0
        self.stale = 0
        self.stale_tokens = 0
        self.discarded = 0

    def add(self, task: Task) -> None:
        self.tasks[task.task_id] = task
        self.seen.add(task.task_id)
        self.resultless.discard(task.task_id)

    def hold(self, task: Task) -> None:
        """An accepted task's result waits for its owner."""
        self.buffered += 1
        self.held[task.task_id] = task
        if not task.is_eval and task.version < self.oldest_held:
            self.oldest_held = task.version
        if task.owner is self.common:
            self.admission.pool_buffered += 1

    def _unhold(self, task: Task) -> None:
        self.buffered -= 1
        if task.owner is self.common:
            self.admission.pool_buffered -= 1
        del self.held[task.task_id]

    def forget(self, task: Task) -> None:
        """``task`` leaves the executor without a result."""
        self.tasks.pop(task.task_id, None)
        self.resultless.add(task.task_id)
        task.owner.finished.pop(task.task_id, None)

    def drop(self, task: Task, why: str) -> None:
        """Withdraw an accepted, untaken result (``"stale"`` or ``"abandoned"``)."""
        task.dropped = why
        if why == "stale":
            self.stale += 1
            self.stale_tokens += _tokens_of(task.result)
            if not task.is_eval:
                self.admission.staleness.on_rollout_discarded()
        else:
            self.discarded += 1
        task.result = None
        self._unhold(task)

    def stale_below(self, floor: int) -> list[Task]:
        """The untaken training results whose oldest token is older than version ``floor``
        (``oldest_held`` becomes the oldest version among the rest)."""
        stale = [t for t in self.held.values() if not t.is_eval and t.version < floor]
        self.oldest_held = min((t.version for t in self.held.values() if not t.is_eval and t.version >= floor), default=_NONE_HELD)
        return stale

    def take(self, task: Task) -> Result | None:
        """Hand ``task``'s result to its owner's call: the task leaves the executor."""
        self.tasks.pop(task.task_id, None)
        task.owner.finished.pop(task.task_id, None)
        if not task.deliverable:
            self.resultless.add(task.task_id)
            return None
        self._unhold(task)
        self.accepted += 1
        result, task.result = task.result, None
        return result

    def hand_on(self, task: Task) -> None:
        """A finished task of an abandoned call: training results go to the common pool
        (for ``wait``), evaluation results are dropped (they are never training data)."""
        task.owner.finished.pop(task.task_id, None)
        if task.deliverable and task.is_eval:
            self.drop(task, "abandoned")  # still the call's: it never counted in the pool
        if task.deliverable:
            self._unhold(task)
            task.owner = self.common
            self.hold(task)  # from now on it waits for wait(), like a submit's
            self.common.finished[task.task_id] = task
        else:
            task.owner = self.common
            self.forget(task)
