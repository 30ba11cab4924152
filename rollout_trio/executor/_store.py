"""The executor's one store of tasks, each owned by the call that takes its result.

A task's *owner* is where its result goes: the common pool (``submit``; taken by
``wait`` / ``wait_for_task``), one ``rollout_batch`` call, or the ``prepare_batch`` feed.
A finished task stays in its owner until that owner's call takes it, in one synchronous
step when the call returns: a call cancelled before that step has taken nothing, so
there is nothing to undo.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any, Literal

import attrs
import trio

from .._interaction import Interaction
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow

__all__ = ["IdSet", "Owner", "Result", "Status", "Task"]

Status = Literal["accepted", "rejected", "failed", "cancelled"]
Result = Trajectory | dict[str, Interaction]


class Owner:
    """Who takes the results of some tasks (``kind``: ``"common"``, ``"batch"`` or ``"feed"``).

    ``finished`` holds its ended, untaken tasks by id; ``unfinished`` counts its queued and
    running ones. An abandoned batch call's owner hands its results on (see the executor).
    """

    __slots__ = ("abandoned", "finished", "kind", "unfinished")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.finished: dict[int, Task] = {}
        self.unfinished = 0
        self.abandoned = False


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
