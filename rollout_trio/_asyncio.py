"""asyncio code inside a Trio run: one asyncio loop in a worker thread, bridged to Trio.

Code written for asyncio (an AReaL agent, openai-agents' ``Runner.run``, LangChain) runs
on a process-wide asyncio event loop in a daemon thread; the Trio side waits for it without
blocking its own loop. Chosen over trio-asyncio by measurement (``python -m bench
asyncio``): see ``bench/asyncio_bench.py`` for the figures and the reasons.

What crosses the bridge:

* **Trio -> asyncio** (:meth:`AsyncioPortal.run`): the coroutine runs as an asyncio task
  with a copy of the calling Trio task's context (``workflow_context`` works inside it).
  Cancelling the Trio caller cancels the asyncio task and waits for it to finish (at most
  :data:`CANCEL_GRACE_S`; a task that swallows ``CancelledError`` is then left behind with
  a warning, never waited on forever).
* **asyncio -> Trio** (:meth:`AsyncioPortal.run_trio`, :meth:`AsyncioPortal.engine`,
  :class:`TrioBridgeTransport`): the call runs as a Trio task in the portal's nursery, so
  it belongs to the caller's slot: cancelling the slot cancels it at once (an engine call
  aborts its generation on the server); cancelling the asyncio awaiter cancels it too.

The host rule (which loop runs what) lives in :func:`host_of`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import httpx
import outcome
import trio

from ._errors import RolloutError

__all__ = [
    "AsyncioPortal",
    "AsyncioTaskCancelled",
    "CANCEL_GRACE_S",
    "Host",
    "TrioBridgeTransport",
    "asyncio_portal",
    "host_of",
    "on_asyncio",
    "on_trio",
    "run_asyncio",
]

logger = logging.getLogger("rollout_trio.asyncio")

T = TypeVar("T")
Host = Literal["trio", "asyncio"]
#: The attribute :func:`on_asyncio` / :func:`on_trio` set on a function, class or object.
HOST_ATTRIBUTE = "rollout_trio_host"
#: Seconds a cancelled asyncio task gets to finish before it is left behind (with a warning).
CANCEL_GRACE_S = 10.0


class AsyncioTaskCancelled(RolloutError):
    """The asyncio task was cancelled from the asyncio side, not by its Trio caller."""


# ------------------------------------------------------------------------------ host rule


def on_asyncio(obj: T) -> T:
    """Mark a workflow, agent class or agent object to run on the hosted asyncio loop.

    A plain ``async def`` workflow or a class with ``arun_episode`` runs on Trio unless
    marked with this. Agents need no mark: they run on asyncio already.

    Args:
        obj: the workflow function, workflow or agent class, or object to mark.

    Returns:
        ``obj`` itself (so that it works as a decorator).

    Raises:
        AttributeError: ``obj`` takes no attributes (a built-in or ``__slots__`` object).
    """
    setattr(obj, HOST_ATTRIBUTE, "asyncio")
    return obj


def on_trio(obj: T) -> T:
    """Mark an agent class or object to run on Trio (in the caller's Trio task).

    Agents (objects with ``async def run``) run on asyncio unless marked with this. Use it
    for an agent that awaits Trio primitives (``trio.sleep``, nurseries).

    Args:
        obj: the agent class or object to mark.

    Returns:
        ``obj`` itself (so that it works as a decorator).

    Raises:
        AttributeError: ``obj`` takes no attributes (a built-in or ``__slots__`` object).
    """
    setattr(obj, HOST_ATTRIBUTE, "trio")
    return obj


def host_of(obj: Any, *, default: Host) -> Host:
    """Which loop runs ``obj``: its mark (:func:`on_asyncio`, :func:`on_trio`), else ``default``.

    The rule: agents (objects with ``async def run``) default to ``"asyncio"``, as the
    agent SDKs they are written with are asyncio code; workflows (``async def (engine,
    data)`` functions, ``arun_episode`` classes) default to ``"trio"``. A mark on the
    object wins over one on its class; a mark on the bound method's function counts too.

    Raises:
        ValueError: the mark is neither ``"trio"`` nor ``"asyncio"``.
    """
    mark = getattr(obj, HOST_ATTRIBUTE, None)
    if mark is None:
        return default
    if mark not in ("trio", "asyncio"):
        raise ValueError(f"{HOST_ATTRIBUTE}: must be 'trio' or 'asyncio', got {mark!r}")
    return mark


# ------------------------------------------------------------------------------ the loop thread


class _Loop:
    """The process-wide asyncio loop and its daemon thread (restarted after a fork)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop: asyncio.AbstractEventLoop
        started = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(started,), name="rollout-trio-asyncio", daemon=True)
        self.thread.start()
        started.wait()

    def _main(self, started: threading.Event) -> None:
        # Made in its own thread, where no Trio run is (trio-asyncio, once imported, refuses
        # new_event_loop() in a Trio thread); the policy's loop, so an installed uvloop counts.
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()


_LOOP: _Loop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    current = _LOOP
    if current is None or current.pid != os.getpid() or not current.thread.is_alive():
        with _LOOP_LOCK:
            if _LOOP is None or _LOOP.pid != os.getpid() or not _LOOP.thread.is_alive():
                _LOOP = _Loop()
            current = _LOOP
    return current.loop


def hosted_loop() -> asyncio.AbstractEventLoop:
    """The asyncio loop that hosts asyncio code (started on first use)."""
    return _loop()


# ------------------------------------------------------------------------------ the portal

_PORTAL: contextvars.ContextVar[AsyncioPortal] = contextvars.ContextVar("rollout_trio_asyncio_portal")


class _Task:
    """One asyncio task started from Trio: its outcome and the Trio event set when it ends."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.done = trio.Event()
        self.result: outcome.Outcome[Any] | None = None
        self.task: asyncio.Task[Any] | None = None
        self.cancel_requested = False

    def finished(self, result: outcome.Outcome[Any]) -> None:  # on the asyncio thread
        self.result = result
        try:
            self.token.run_sync_soon(self.done.set)
        except trio.RunFinishedError:  # the Trio run is gone (a task left behind after its grace)
            pass

    def cancel(self) -> None:  # on the asyncio thread
        self.cancel_requested = True
        if self.task is not None:
            self.task.cancel()


class _Job:
    """One Trio call made from asyncio: the asyncio future it resolves, its cancel scope."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], future: asyncio.Future[Any]) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.scope: trio.CancelScope | None = None
        self.cancel_requested = False

    def cancel(self) -> None:  # on the Trio thread
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()


def _resolve(future: asyncio.Future[Any], result: outcome.Outcome[Any]) -> None:
    if future.done():  # the awaiter was cancelled meanwhile
        return
    if isinstance(result, outcome.Error):
        future.set_exception(result.error)
    elif isinstance(result, outcome.Value):
        future.set_result(result.value)


class AsyncioPortal:
    """Runs asyncio coroutines from a Trio task, and Trio calls from those coroutines.

    Open one with :func:`asyncio_portal`. Trio calls made through it run in its nursery,
    inside the Trio task that opened it: cancelling that task cancels them too.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()
        self._loop = _loop()
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The hosted asyncio loop."""
        return self._loop

    # ---------------------------------------------------------------- Trio -> asyncio

    async def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``async_fn(*args, **kwargs)`` as a task on the hosted asyncio loop (call from Trio).

        Returns:
            What the coroutine returns.

        Raises:
            Exception: what the coroutine raises.
            AsyncioTaskCancelled: the task was cancelled from the asyncio side.
        """
        if self._closed:
            raise RuntimeError("this AsyncioPortal is closed")
        handle = _Task(self._token)
        context = contextvars.copy_context()
        context.run(_PORTAL.set, self)

        async def main() -> Any:
            return await async_fn(*args, **kwargs)

        def finished(task: asyncio.Task[Any]) -> None:  # on the asyncio thread
            if task.cancelled():
                handle.finished(outcome.Error(asyncio.CancelledError()))
            elif (exc := task.exception()) is not None:
                handle.finished(outcome.Error(exc))
            else:
                handle.finished(outcome.Value(task.result()))

        def start() -> None:  # on the asyncio thread
            if handle.cancel_requested:
                handle.finished(outcome.Error(asyncio.CancelledError()))
                return
            handle.task = self._loop.create_task(main(), context=context)
            handle.task.add_done_callback(finished)

        self._loop.call_soon_threadsafe(start)
        try:
            await handle.done.wait()
        except trio.Cancelled:
            self._loop.call_soon_threadsafe(handle.cancel)
            with trio.move_on_after(CANCEL_GRACE_S, shield=True):
                await handle.done.wait()
            if not handle.done.is_set():
                logger.warning(
                    "the asyncio task of %r did not finish within %ss of its cancellation; it is left behind",
                    async_fn,
                    CANCEL_GRACE_S,
                )
            raise
        assert handle.result is not None
        if isinstance(handle.result, outcome.Error) and isinstance(handle.result.error, asyncio.CancelledError):
            raise AsyncioTaskCancelled(f"{async_fn!r}: its asyncio task was cancelled from the asyncio side") from None
        return handle.result.unwrap()

    # ---------------------------------------------------------------- asyncio -> Trio

    async def run_trio(self, async_fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``async_fn(*args)`` in Trio, in this portal's nursery (call from asyncio).

        Cancelling the asyncio awaiter cancels the Trio call; cancelling the portal's Trio
        task cancels it too (the awaiter then gets ``asyncio.CancelledError``).

        Returns:
            What the Trio call returns.

        Raises:
            Exception: what the Trio call raises.
            RuntimeError: the portal is closed.
        """
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        job = _Job(async_fn, args, future)
        try:
            self._token.run_sync_soon(self._spawn, job)
        except trio.RunFinishedError:
            raise RuntimeError("the Trio run behind this AsyncioPortal has finished") from None
        try:
            return await future
        except asyncio.CancelledError:
            try:
                self._token.run_sync_soon(job.cancel)
            except trio.RunFinishedError:
                pass
            raise

    def _spawn(self, job: _Job) -> None:  # on the Trio thread, outside any task: must not raise
        if self._closed:
            self._loop.call_soon_threadsafe(_resolve, job.future, outcome.Error(RuntimeError("this AsyncioPortal is closed")))
            return
        try:
            self._nursery.start_soon(self._serve, job)
        except RuntimeError as exc:  # the nursery no longer takes tasks
            self._loop.call_soon_threadsafe(_resolve, job.future, outcome.Error(exc))

    async def _serve(self, job: _Job) -> None:
        result: outcome.Outcome[Any] = outcome.Error(asyncio.CancelledError())
        try:
            with trio.CancelScope() as job.scope:
                if job.cancel_requested:
                    job.scope.cancel()
                try:
                    result = outcome.Value(await job.fn(*job.args))
                except Exception as exc:
                    result = outcome.Error(exc)
        finally:
            self._loop.call_soon_threadsafe(_resolve, job.future, result)

    def trio_caller(self, async_fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        """``async_fn`` (a Trio function) as an asyncio coroutine function that runs it in Trio."""

        @functools.wraps(async_fn)
        async def call(*args: Any, **kwargs: Any) -> T:
            return await self.run_trio(functools.partial(async_fn, *args, **kwargs) if kwargs else async_fn, *(() if kwargs else args))

        return call

    def engine(self, engine: Any) -> Any:
        """``engine`` for asyncio code: its coroutine methods run in Trio, the rest as they are."""
        return _AsyncioEngine(engine, self)

    def http_transport(self, trio_transport: httpx.AsyncBaseTransport) -> TrioBridgeTransport:
        """An asyncio-side ``httpx`` transport whose requests ``trio_transport`` sends in Trio."""
        return TrioBridgeTransport(trio_transport, self)

    def close(self) -> None:
        """Refuse further Trio calls (the ones in flight go on until the nursery ends)."""
        self._closed = True


@asynccontextmanager
async def asyncio_portal() -> AsyncIterator[AsyncioPortal]:
    """Open an :class:`AsyncioPortal` for this Trio task; leaving the block cancels its Trio calls.

    An exception from the block propagates as itself, not inside an exception group (the
    portal's own tasks never raise).
    """
    raised: Exception | None = None
    async with trio.open_nursery() as nursery:
        portal = AsyncioPortal(nursery)
        try:
            yield portal
        except Exception as exc:  # re-raised below, outside the nursery's exception group
            raised = exc
        finally:
            portal.close()
            nursery.cancel_scope.cancel()
    if raised is not None:
        try:
            raise raised
        finally:
            raised = None


async def run_asyncio(async_fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Run an asyncio coroutine function from Trio (see :meth:`AsyncioPortal.run`).

    Args:
        async_fn: the coroutine function, written for asyncio.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        What the coroutine returns.

    Raises:
        Exception: what the coroutine raises.
        AsyncioTaskCancelled: the task was cancelled from the asyncio side.
    """
    async with asyncio_portal() as portal:
        return await portal.run(async_fn, *args, **kwargs)


def current_portal() -> AsyncioPortal:
    """The portal of the hosted asyncio task running this code.

    Raises:
        RuntimeError: not inside a coroutine started by :meth:`AsyncioPortal.run`.
    """
    try:
        return _PORTAL.get()
    except LookupError:
        raise RuntimeError("not in an asyncio task hosted by rollout_trio (AsyncioPortal.run)") from None


class _AsyncioEngine:
    """An engine as asyncio code sees it: ``await engine.agenerate(req)`` is served in Trio."""

    def __init__(self, engine: Any, portal: AsyncioPortal) -> None:
        self._engine = engine
        self._portal = portal

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if inspect.iscoroutinefunction(attr):
            return self._portal.trio_caller(attr)
        return attr

    def __repr__(self) -> str:
        return f"<asyncio view of {self._engine!r}>"


class TrioBridgeTransport(httpx.AsyncBaseTransport):
    """An asyncio-side ``httpx`` transport that sends each request with a Trio-side one.

    The body is read on asyncio, the request goes out as a Trio call of the portal
    (cancelling the request cancels it there), and the whole answer comes back: a
    streamed (SSE) answer arrives at once, its events intact. With
    ``httpx.ASGITransport(app)`` as the Trio side, the app runs in Trio with no socket.
    """

    def __init__(self, trio_transport: httpx.AsyncBaseTransport, portal: AsyncioPortal) -> None:
        self._trio_transport = trio_transport
        self._portal = portal

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        status, headers, content = await self._portal.run_trio(self._send, request)
        return httpx.Response(status, headers=headers, content=content, request=request)

    async def _send(self, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:  # in Trio
        response = await self._trio_transport.handle_async_request(request)
        try:
            content = await response.aread()
        finally:
            await response.aclose()
        return response.status_code, response.headers.raw, content
