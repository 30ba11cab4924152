"""Phase tracing a workflow author puts on a method: how long each phase of an episode took.

``async with phase("reward"):`` (or ``with``), or ``@traced_phase("reward")`` on a sync or
async function, records the phase's wall time into the workflow's statistics (scope
``"<stat scope>/phase"``, key ``"<phase>_seconds"``), under the status it ended with
(``ok``, ``cancelled``, ``error``: a cancelled phase also counts ``<phase>_cancelled``, a
failed one ``<phase>_error``), and hands a :class:`PhaseRecord` to every listener added
with :func:`add_phase_listener` (a trace file or a metrics registry). :func:`new_session`
(``@session_context()`` under AReaL's name) numbers the samples of an episode, so that
the records of one sample can be told apart.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

import attrs
import trio

from . import workflow_context

__all__ = ["PhaseRecord", "add_phase_listener", "new_session", "phase", "phase_metrics", "remove_phase_listener", "traced_phase"]

Status = Literal["ok", "cancelled", "error"]
F = TypeVar("F", bound=Callable[..., Any])

_sessions = itertools.count(1)
_session: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_trio.phase_session", default=None)
_listeners: list[Callable[[PhaseRecord], None]] = []


@attrs.frozen
class PhaseRecord:
    """One phase that ended.

    Attributes:
        phase: its name.
        seconds: its wall time.
        status: ``"ok"``, ``"cancelled"`` or ``"error"``.
        task_id, sample_idx: the episode and slot it ran in (from the workflow context).
        session: the sample number set by :func:`new_session` (None outside one).
        start: its start on :func:`time.perf_counter`'s clock.

    Raises:
        Nothing: records are made by the phases themselves, from values they measured.
    """

    phase: str
    seconds: float
    status: Status
    task_id: int | None
    sample_idx: int | None
    session: int | None
    start: float


def add_phase_listener(listener: Callable[[PhaseRecord], None]) -> None:
    """Call ``listener(record)`` for every phase that ends, in this process, until removed.

    Args:
        listener: called with each ended phase's :class:`PhaseRecord`, synchronously, on
            the thread that ended it; it should be quick (it runs inside the phase's exit).

    Raises:
        Nothing: any callable is accepted as is; what it raises when called is its own.
    """
    _listeners.append(listener)


def remove_phase_listener(listener: Callable[[PhaseRecord], None]) -> None:
    """Stop calling ``listener`` (added with :func:`add_phase_listener`)."""
    _listeners.remove(listener)


def _status_of(exc: BaseException | None) -> Status:
    if exc is None:
        return "ok"
    if isinstance(exc, trio.Cancelled) or (
        isinstance(exc, BaseExceptionGroup) and exc.subgroup(trio.Cancelled) is not None and exc.split(trio.Cancelled)[1] is None
    ):
        return "cancelled"
    return "error"


def _record(name: str, start: float, exc: BaseException | None) -> None:
    seconds = time.perf_counter() - start
    status = _status_of(exc)
    values = {f"{name}_seconds": seconds}
    if status != "ok":
        values[f"{name}_{status}"] = 1.0
    workflow_context.stats_recorder().record(f"{workflow_context.stat_scope()}/phase", values)
    if _listeners:
        ctx = workflow_context.get()
        rec = PhaseRecord(name, seconds, status, ctx.task_id, ctx.sample_idx, _session.get(), start)
        for listener in list(_listeners):
            listener(rec)


@contextmanager
def _phase_cm(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    except BaseException as exc:
        _record(name, start, exc)
        raise
    _record(name, start, None)


class phase:  # noqa: N801 - used like a function: ``with phase("x")`` / ``async with phase("x")``
    """Time the block as phase ``name`` (usable with ``with`` and ``async with``).

    Args:
        name: the phase's name (a non-empty str).

    Raises:
        ValueError: ``name`` is empty or not a str.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name: must be a non-empty str, got {name!r}")
        self.name = name
        self._cm: Any = None

    def __enter__(self) -> None:
        self._cm = _phase_cm(self.name)
        self._cm.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        cm, self._cm = self._cm, None
        return cm.__exit__(*exc_info)

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return self.__exit__(*exc_info)


def traced_phase(name: str) -> Callable[[F], F]:
    """Decorator: every call of the (sync or async) function is timed as phase ``name``.

    Args:
        name: the phase's name, as :func:`phase` takes it.

    Returns:
        The decorator; the function it returns keeps the wrapped one's signature and
        returns what it returns (a coroutine function stays one).

    Raises:
        ValueError: ``name`` is empty or not a str (at decoration, not at each call).
    """
    phase(name)  # validate now

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                with _phase_cm(name):
                    return await fn(*args, **kwargs)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _phase_cm(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def new_session() -> Callable[[F], F]:
    """Decorator: each call of the (sync or async) function is a new sample session.

    Phases recorded inside the call carry the session's number (:attr:`PhaseRecord.session`).

    Returns:
        The decorator; the function it returns keeps the wrapped one's signature and
        returns what it returns (a coroutine function stays one).

    Raises:
        Nothing of its own: the wrapped function's exceptions pass through unchanged.
    """

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                token = _session.set(next(_sessions))
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _session.reset(token)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            token = _session.set(next(_sessions))
            try:
                return fn(*args, **kwargs)
            finally:
                _session.reset(token)

        return wrapper  # type: ignore[return-value]

    return decorate


def phase_metrics(registry: Any = None) -> Callable[[PhaseRecord], None]:
    """Export phase durations as ``rollout_trio_phase_seconds{phase,status}`` (a histogram).

    Args:
        registry: the ``prometheus_client`` registry (default: the process's).

    Returns:
        The listener, already added (:func:`remove_phase_listener` stops it).
    """
    from prometheus_client import REGISTRY, Histogram

    histogram = Histogram(
        "rollout_trio_phase_seconds", "Wall time of each traced workflow phase, by phase and how it ended",
        ["phase", "status"], registry=registry if registry is not None else REGISTRY,
    )  # fmt: skip

    def listener(rec: PhaseRecord) -> None:
        histogram.labels(rec.phase, rec.status).observe(rec.seconds)

    add_phase_listener(listener)
    return listener
