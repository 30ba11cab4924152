"""``SyncRolloutExecutor``: the executor for trainers that are not Trio programs.

Trio runs in one background thread that owns the engine and the executor; every
method is a blocking call into it through an anyio :class:`~anyio.from_thread.BlockingPortal`,
so a call interrupted in the caller's thread (Ctrl-C) cancels its task in the executor's
thread and waits for it to unwind. Closing, garbage collection and interpreter exit all
stop it the same way: cancel the calls in flight, leave the executor's ``async with``
(cancelling its work, aborting generations, flushing dumps), then the engine's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import warnings
import weakref
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import trio
from anyio.from_thread import BlockingPortal

from .. import workflow_context
from ._config import RolloutConfig
from ._executor import AcceptFn, Result, RolloutExecutor, open_executor
from ._statistics import ExecutorStatistics

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["SyncRolloutExecutor"]

logger = logging.getLogger("rollout_trio.executor")

T = TypeVar("T")

_THREAD_NAME = "rollout-trio-executor"
_UNWIND_TIMEOUT = 30.0  # seconds an interrupted call may take to unwind in the executor's thread
_CLOSE_TIMEOUT = 60.0


class _Runner:
    """The background thread, its Trio run and its portal. Holds no reference to the facade (so GC works)."""

    def __init__(self, engine: Any, config: RolloutConfig, enter_engine: bool, options: dict[str, Any]) -> None:
        self.engine = engine
        self.config = config
        self.enter_engine = enter_engine
        self.options = options
        self.ready = threading.Event()
        self.executor: RolloutExecutor | None = None
        self.portal: BlockingPortal | None = None
        self.error: BaseException | None = None
        self.error_reported = False
        self.closed = False
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._abort = trio.CancelScope()  # cancelled only when startup is abandoned
        self._abort_requested = False
        # The trainer's thread's use_seed / use_stats_recorder apply to the whole executor,
        # as they do around open_executor (a new thread starts with an empty context).
        self._seed = workflow_context._seed.get()
        self._stats = workflow_context.stats_recorder()
        self.thread = threading.Thread(target=self._main, name=_THREAD_NAME, daemon=True)

    def start(self, timeout: float) -> None:
        self.thread.start()
        if not self.ready.wait(timeout):
            self._abandon_startup()
            self.thread.join(_UNWIND_TIMEOUT)
            self.closed = True
            left = " (and its thread is still running: the engine's start ignores cancellation)" if self.thread.is_alive() else ""
            raise TimeoutError(f"the executor's thread did not start within {timeout} s{left}")
        if self.error is not None:
            self.error_reported = True
            raise self.error

    def _abandon_startup(self) -> None:
        with self._lock:
            self._abort_requested = True
            token = self._token
        if token is not None:
            try:
                trio.from_thread.run_sync(self._abort.cancel, trio_token=token)
            except trio.RunFinishedError:
                pass

    def _main(self) -> None:
        try:
            anyio.run(self._amain, backend="trio")
        except BaseException as exc:  # surfaced at the caller's next call
            self.error = exc
        finally:
            self.ready.set()

    async def _amain(self) -> None:
        with self._lock:
            self._token = trio.lowlevel.current_trio_token()
            if self._abort_requested:
                return
        with self._abort, workflow_context.use_seed(self._seed), workflow_context.use_stats_recorder(self._stats):
            async with self.engine if self.enter_engine else nullcontext():
                async with open_executor(self.engine, self.config, **self.options) as ex:
                    # The portal's tasks (the callers' calls) end before the executor does.
                    async with BlockingPortal() as portal:
                        self.executor, self.portal = ex, portal
                        self.ready.set()
                        await portal.sleep_until_stopped()

    def _raise_if_dead(self) -> BlockingPortal:
        if self.error is not None:
            self.error_reported = True
            raise RuntimeError("the executor's background thread stopped on an error") from self.error
        if self.closed or self.portal is None or not self.thread.is_alive():
            raise RuntimeError("the executor is closed")
        return self.portal

    def call(self, afn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``await afn(*args, **kwargs)`` in the executor's thread; an exception in the
        caller's thread while it blocks (Ctrl-C) cancels it there."""
        return self._run(afn, args, kwargs)

    def call_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in the executor's thread."""
        return self._run(fn, args, kwargs)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        portal = self._raise_if_dead()
        unwound = threading.Event()

        async def tracked() -> Any:
            try:
                result = fn(*args, **kwargs)
                return (await result) if hasattr(result, "__await__") else result
            finally:
                unwound.set()

        try:
            future = portal.start_task_soon(tracked)
        except RuntimeError:  # the portal stopped between the check and the call
            self._raise_if_dead()
            raise
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            # Cancelled from inside: the executor (or its thread) stopped.
            self._raise_if_dead()
            raise RuntimeError("the executor is closed") from None
        except BaseException:
            # Interrupted here (KeyboardInterrupt, a signal handler's exception): cancel the
            # task over there and wait until it has unwound, so it takes nothing for no one.
            if future.cancel() and not unwound.wait(_UNWIND_TIMEOUT):
                logger.error("an interrupted call did not unwind within %s s in the executor's thread", _UNWIND_TIMEOUT)
            raise

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> bool:
        """Stop the thread; False when it did not stop within ``timeout`` seconds."""
        if not self.closed:
            self.closed = True
            portal = self.portal
            if portal is not None and self.thread.is_alive():
                try:
                    portal.call(portal.stop, True)  # cancel the calls in flight, then unwind
                except RuntimeError:  # already stopped, or the loop is gone
                    pass
        if self.thread.ident is None or self.thread is threading.current_thread():
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def finalize(self) -> None:
        """Close at garbage collection or interpreter exit: nobody to raise to, so warn."""
        if not self.close():
            msg = f"SyncRolloutExecutor: the executor's thread did not stop within {_CLOSE_TIMEOUT} s of closing"
            logger.error(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=1)


class SyncRolloutExecutor:
    """The :class:`RolloutExecutor` methods, blocking, for a trainer that is not Trio.

    Args:
        engine: an :class:`~rollout_trio.engines.InferenceEngine`; it is entered (``async
            with``) in the executor's thread unless ``enter_engine=False``.
        config: a :class:`RolloutConfig` or a mapping; keyword ``overrides`` replace keys.
        dp_size, tokenizer, dumper, stats: as for :func:`open_executor`.
        start_timeout: seconds to wait for the thread (and the engine) to start; past it
            the startup is cancelled and :class:`TimeoutError` raised.

    Use it as a context manager or call :meth:`close`; it is also closed when garbage
    collected and at interpreter exit. An error inside (a stopped executor, a crashed
    engine) is raised at the caller's next call. Completion callbacks run in the
    executor's thread. An exception raised in the caller's thread while a method blocks
    (Ctrl-C's ``KeyboardInterrupt``) cancels that call in the executor's thread, which
    leaves its results for the next call. :func:`~rollout_trio.workflow_context.use_seed`
    and ``use_stats_recorder`` around the constructor apply to every task, as they do
    around :func:`open_executor`.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        config: RolloutConfig | Mapping[str, Any] | None = None,
        *,
        enter_engine: bool = True,
        dp_size: int = 1,
        tokenizer: Any = None,
        dumper: Any = None,
        stats: Any = None,
        start_timeout: float = 120.0,
        **overrides: Any,
    ) -> None:
        cfg = RolloutConfig.coerce(config, **overrides)
        options = {"dp_size": dp_size, "tokenizer": tokenizer, "dumper": dumper, "stats": stats}
        self._runner = _Runner(engine, cfg, enter_engine, options)
        self._runner.start(start_timeout)
        self._finalizer = weakref.finalize(self, self._runner.finalize)

    @property
    def _ex(self) -> RolloutExecutor:
        ex = self._runner.executor
        assert ex is not None
        return ex

    def __enter__(self) -> SyncRolloutExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """Cancel in-flight work, stop the thread; raise an error from inside not yet seen.

        Raises:
            TimeoutError: the thread did not stop within ``timeout`` seconds (something in
                the engine's or a workflow's shutdown ignores cancellation); it is left
                running as a daemon thread. At garbage collection or interpreter exit the
                same condition is logged and warned (``RuntimeWarning``) instead.
        """
        self._finalizer.detach()
        if not self._runner.close(timeout):
            raise TimeoutError(
                f"the executor's thread did not stop within {timeout} s of closing "
                "(the engine's or a workflow's shutdown ignores cancellation)"
            )
        if self._runner.error is not None and not self._runner.error_reported:
            self._runner.error_reported = True
            raise self._runner.error

    @property
    def config(self) -> RolloutConfig:
        """The executor's configuration."""
        return self._runner.config

    @property
    def queue_size(self) -> int:
        """The most buffered trajectories."""
        return self._ex.queue_size

    def submit(self, data: Any, workflow: Any, workflow_kwargs: Mapping[str, Any] | None = None, **options: Any) -> int:
        """See :meth:`RolloutExecutor.submit`."""
        return self._runner.call_sync(self._ex.submit, data, workflow, workflow_kwargs, **options)

    def wait(self, count: int, timeout: float | None = None, *, raise_timeout: bool = True) -> list[Result]:
        """See :meth:`RolloutExecutor.wait`."""
        return self._runner.call(self._ex.wait, count, timeout, raise_timeout=raise_timeout)

    def wait_for_task(self, task_id: int, timeout: float | None = None, *, raise_timeout: bool = True) -> Result | None:
        """See :meth:`RolloutExecutor.wait_for_task`."""
        return self._runner.call(self._ex.wait_for_task, task_id, timeout, raise_timeout=raise_timeout)

    def rollout_batch(
        self, data_list: Iterable[Any], workflow: Any, workflow_kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> list[Result]:
        """See :meth:`RolloutExecutor.rollout_batch`."""
        return self._runner.call(self._ex.rollout_batch, data_list, workflow, workflow_kwargs, **options)

    def prepare_batch(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        workflow: Any,
        workflow_kwargs: Mapping[str, Any] | None = None,
        *,
        should_accept_fn: AcceptFn | None = None,
        **options: Any,
    ) -> list[Result]:
        """See :meth:`RolloutExecutor.prepare_batch` (the source is iterated in the executor's thread)."""
        return self._runner.call(
            self._ex.prepare_batch, source, workflow, workflow_kwargs, should_accept_fn=should_accept_fn, **options
        )

    def cancel(self, task_id: int) -> bool:
        """See :meth:`RolloutExecutor.cancel`."""
        return self._runner.call_sync(self._ex.cancel, task_id)

    def pause(self) -> None:
        """See :meth:`RolloutExecutor.pause`."""
        self._runner.call(self._ex.pause)

    def resume(self) -> None:
        """See :meth:`RolloutExecutor.resume`."""
        self._runner.call(self._ex.resume)

    @property
    def paused(self) -> bool:
        """Whether the executor is paused."""
        return self._runner.call_sync(lambda: self._ex.paused)

    def set_version(self, version: int) -> None:
        """See :meth:`RolloutExecutor.set_version`."""
        self._runner.call_sync(self._ex.set_version, version)

    def get_version(self) -> int:
        """The engine's current version."""
        return self._runner.call_sync(self._ex.engine.get_version)

    def update_weights(self, source: Any, version: int) -> None:
        """The engine's ``update_weights`` (run in the executor's thread), then the new budget."""

        async def update() -> None:
            await self._ex.engine.update_weights(source, version)
            self._ex.set_version(version)

        self._runner.call(update)

    def on_version_recovered(self, version: int) -> None:
        """See :meth:`RolloutExecutor.on_version_recovered`."""
        self._runner.call_sync(self._ex.on_version_recovered, version)

    def statistics(self) -> ExecutorStatistics:
        """See :meth:`RolloutExecutor.statistics`."""
        return self._runner.call_sync(self._ex.statistics)

    def group_statistics(self, *, reset: bool = True) -> dict[str, float]:
        """See :meth:`RolloutExecutor.group_statistics`."""
        return self._runner.call_sync(self._ex.group_statistics, reset=reset)

