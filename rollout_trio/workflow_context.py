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
import hashlib
import itertools
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
    "request_seed",
    "set",
    "stat_scope",
    "stats_recorder",
    "use",
    "use_seed",
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

    Each context counts the requests made under it (for :func:`request_seed`); a copy made
    with :meth:`evolve` starts its own count.
    """

    is_eval: bool = False
    task_id: int | None = None
    sample_idx: int | None = None
    group_size: int = 1
    processor_cache: ProcessorCache | None = None
    _requests: Iterator[int] = attrs.field(init=False, factory=itertools.count, eq=False, repr=False)

    def evolve(self, **changes: Any) -> WorkflowContext:
        """A copy with ``changes``."""
        return attrs.evolve(self, **changes)


T = TypeVar("T")
_DEFAULT = WorkflowContext()
_context: contextvars.ContextVar[WorkflowContext] = contextvars.ContextVar("rollout_trio.workflow_context")
_http: contextvars.ContextVar[httpx.AsyncClient] = contextvars.ContextVar("rollout_trio.http_client")
_stats: contextvars.ContextVar[StatsRecorder] = contextvars.ContextVar("rollout_trio.stats")
_seed: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_trio.seed", default=None)
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


def use_seed(seed: int | None) -> AbstractContextManager[int | None]:
    """Make sampling inside the ``with`` block (and its tasks) follow ``seed``.

    Engines that honour :func:`request_seed` (``LocalEngine``) then seed each request that
    has no ``gconfig.seed`` of its own from ``(seed, task_id, sample_idx, n)``, where ``n``
    counts the requests of that slot: a run gives the same samples whatever order its tasks
    are scheduled in. None turns it off.
    """
    return _bound(_seed, seed)


def request_seed() -> int | None:
    """The seed for the current task's next engine request, or None outside :func:`use_seed`.

    Derived from the block's seed, the context's ``task_id`` and ``sample_idx``, and how
    many requests this context made before; each call counts as one request. Requests made
    concurrently under one context get their numbers in the order they are made.
    """
    base = _seed.get()
    if base is None:
        return None
    ctx = get()
    key = f"{base}/{ctx.task_id}/{ctx.sample_idx}/{next(ctx._requests)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1  # fits torch's int64 seed


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
