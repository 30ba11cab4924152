"""The per-task workflow context: which episode, which slot, which group resources.

The context lives in a :mod:`contextvars` variable. Trio gives every task a copy of
its parent's context when it starts, so a value set inside one slot never leaks into
its siblings or its parent::

    from rollout_trio import workflow_context

    async def my_workflow(engine, data):
        ctx = workflow_context.get()
        print(ctx.sample_idx, ctx.group_size, workflow_context.stat_scope())

Shared resources are owned by an ``async with`` block, never by a global::

    async with workflow_context.open_http_client():
        ...  # every task started in here can call workflow_context.http_client()
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from typing import Any, TypeVar

import attrs
import httpx

from ._processor_cache import ProcessorCache
from ._stats import StatsRecorder, StatSummary

__all__ = [
    "ProcessorCache",
    "StatSummary",
    "StatsRecorder",
    "WorkflowContext",
    "get",
    "http_client",
    "open_http_client",
    "set",
    "stat_scope",
    "stats_recorder",
    "use",
    "use_stats_recorder",
]


@attrs.frozen(kw_only=True)
class WorkflowContext:
    """What a running workflow knows about its episode.

    Attributes:
        is_eval: whether this is an evaluation rollout.
        task_id: the executor's id for the episode, if any.
        sample_idx: the slot index inside a group (None outside a group).
        group_size: the number of slots of the group (1 outside a group).
        processor_cache: the memo the slots of one group share.
    """

    is_eval: bool = False
    task_id: int | None = None
    sample_idx: int | None = None
    group_size: int = 1
    processor_cache: ProcessorCache | None = None

    def evolve(self, **changes: Any) -> WorkflowContext:
        """A copy with ``changes``."""
        return attrs.evolve(self, **changes)


T = TypeVar("T")
_DEFAULT = WorkflowContext()
_context: contextvars.ContextVar[WorkflowContext] = contextvars.ContextVar("rollout_trio.workflow_context")
_http: contextvars.ContextVar[httpx.AsyncClient] = contextvars.ContextVar("rollout_trio.http_client")
_stats: contextvars.ContextVar[StatsRecorder] = contextvars.ContextVar("rollout_trio.stats")
_process_stats = StatsRecorder()


def get() -> WorkflowContext:
    """The current task's context (a default one if none was set)."""
    return _context.get(_DEFAULT)


def set(ctx: WorkflowContext) -> contextvars.Token[WorkflowContext]:  # noqa: A001 - mirrors the reference API
    """Set the current task's context; returns a token for :meth:`contextvars.ContextVar.reset`."""
    return _context.set(ctx)


@contextmanager
def _bound(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def use(ctx: WorkflowContext) -> AbstractContextManager[WorkflowContext]:
    """Install ``ctx`` for the duration of the ``with`` block."""
    return _bound(_context, ctx)


def stat_scope() -> str:
    """``"eval-rollout"`` for an evaluation episode, else ``"rollout"``."""
    return "eval-rollout" if get().is_eval else "rollout"


def stats_recorder() -> StatsRecorder:
    """The recorder statistics go to: the one installed with :func:`use_stats_recorder`,
    else the process-wide default."""
    return _stats.get(_process_stats)


def use_stats_recorder(recorder: StatsRecorder) -> AbstractContextManager[StatsRecorder]:
    """Send statistics recorded inside the ``with`` block (and its tasks) to ``recorder``."""
    return _bound(_stats, recorder)


@asynccontextmanager
async def open_http_client(**client_kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """Open the ``httpx.AsyncClient`` workflows share, for the ``async with`` block.

    Tasks started inside the block see it through :func:`http_client`; it is closed
    when the block ends. ``client_kwargs`` go to ``httpx.AsyncClient``.
    """
    client_kwargs.setdefault("timeout", httpx.Timeout(60.0, connect=10.0))
    async with httpx.AsyncClient(**client_kwargs) as client:
        with _bound(_http, client):
            yield client


def http_client() -> httpx.AsyncClient:
    """The shared client opened by an enclosing :func:`open_http_client`.

    Raises:
        RuntimeError: no :func:`open_http_client` block encloses this task.
    """
    try:
        return _http.get()
    except LookupError:
        raise RuntimeError(
            "no shared HTTP client: wrap the run in `async with workflow_context.open_http_client():`"
        ) from None
