"""Observers: what metrics, traces and live views learn about each task's life.

An observer is any object with the methods of :class:`ExecutorObserver` (all optional to
act on, all required to exist). The executor calls them synchronously on the Trio thread,
at the instant the task moves (no checkpoint in between), so an observer sees every
transition exactly once and in order: ``queued``, then ``started`` (unless the task is
cancelled while queued), then ``finished``, then ``consumed`` for an accepted task that a
trainer call took. ``time`` is ``trio.current_time()``. An observer must not block; an
exception it raises is logged and never reaches the executor.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from .._trajectory import Trajectory

__all__ = ["ExecutorObserver", "Status", "bind", "bind_optional", "emit", "oldest_version"]

logger = logging.getLogger("rollout_trio.executor")

Status = Literal["accepted", "rejected", "failed", "cancelled"]


@runtime_checkable
class ExecutorObserver(Protocol):
    """Receives every task transition of one executor (see the module docstring)."""

    def task_queued(self, task_id: int, *, is_eval: bool, time: float) -> None:
        """``task_id`` was submitted and waits for capacity."""

    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        """Its workflow started while the engine was at ``version``."""

    def task_finished(self, task_id: int, *, status: Status, reason: str | None, result: Any, time: float) -> None:
        """It ended; ``result`` is the trajectory for accepted (and filter-rejected) tasks."""

    def task_consumed(self, task_id: int, *, version: int, lag: int, time: float) -> None:
        """A trainer call took its result at engine ``version``; ``lag`` is how many
        versions its oldest token is behind (0 when it carries no versions)."""

    # Optional (an observer without them is not called): a consumer call ``call``
    # ("wait", "rollout_batch", ...) has waited ``waited`` seconds without progress, on
    # ``waiting_on`` (in words); then it progressed or ended.
    #   def call_stalled(self, call: str, waiting_on: str, waited: float) -> None
    #   def call_unstalled(self, call: str) -> None


def bind(observers: Sequence[ExecutorObserver], method: str) -> tuple[tuple[Callable[..., None], ExecutorObserver], ...]:
    """``(observer.method, observer)`` for each observer, the method looked up once.

    :func:`emit` calls them; the lookup is not repeated per event.
    A missing method still fails, and is logged, at each call.
    """
    return tuple(
        (getattr(observer, method, None) or functools.partial(_late_lookup, observer, method), observer)
        for observer in observers
    )


def bind_optional(observers: Sequence[ExecutorObserver], method: str) -> Callable[..., None]:
    """One function calling ``method`` on each observer that has it (an optional event)."""
    bound = tuple((m, o) for o in observers if (m := getattr(o, method, None)) is not None)

    def call(*args: Any, **kwargs: Any) -> None:
        emit(bound, method, *args, **kwargs)

    return call


def emit(bound: Sequence[tuple[Callable[..., None], ExecutorObserver]], method: str, *args: Any, **kwargs: Any) -> None:
    """Call each of :func:`bind`'s methods, logging (never raising) what they raise."""
    for call, observer in bound:
        try:
            call(*args, **kwargs)
        except Exception:
            logger.exception("Executor observer %r failed in %s.", observer, method)


def _late_lookup(observer: Any, method: str, *args: Any, **kwargs: Any) -> None:
    getattr(observer, method)(*args, **kwargs)


_AS_LIST = 1024  # up to this many entries, reading a tensor into Python beats tensor ops


def oldest_version(result: Any) -> int | None:
    """The lowest weight version of any output token in ``result`` (None when none has one).

    ``result`` is a :class:`~rollout_trio.Trajectory` or a dict of interactions.
    """
    if isinstance(result, Trajectory):
        versions = result.versions
        if versions is None:
            return None
        if versions.numel() <= _AS_LIST and versions.is_cpu:
            # Short rows (the common case, for every accepted task): one copy out, then
            # Python; a masked select and a reduction cost ~20 us in tensor-op overheads.
            # tolist() follows the strides, so a sliced (non-contiguous) row reads right.
            rows = versions.tolist()
            found = [v for row in rows for v in row if v >= 0] if versions.ndim == 2 else [v for v in rows if v >= 0]
            return min(found) if found else None
        kept = versions[versions >= 0]
        return int(kept.min()) if kept.numel() else None
    if isinstance(result, dict):
        found = [
            v
            for item in result.values()
            for v in getattr(getattr(item, "model_response", None), "output_versions", ()) or ()
            if v >= 0
        ]
        return min(found) if found else None
    return None
