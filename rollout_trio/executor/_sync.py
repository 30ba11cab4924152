"""``SyncRolloutExecutor``: the executor for trainers that are not Trio programs.

Trio runs in one background thread that owns the engine and the executor; every
method is a blocking call into it (``trio.from_thread``). Closing, garbage collection
and interpreter exit all stop it the same way: leave the executor's ``async with``
(cancelling in-flight work, aborting generations, flushing dumps), then the engine's.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ._config import RolloutConfig
from ._executor import AcceptFn, ExecutorStatistics, Result, RolloutExecutor, open_executor

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["SyncRolloutExecutor"]

T = TypeVar("T")


class _Runner:
    """The background thread and its Trio run. Holds no reference to the facade (so GC works)."""

    def __init__(self, engine: Any, config: RolloutConfig, enter_engine: bool, options: dict[str, Any]) -> None:
        self.engine = engine
        self.config = config
        self.enter_engine = enter_engine
        self.options = options
        self.ready = threading.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        self.executor: RolloutExecutor | None = None
        self.error: BaseException | None = None
        self.error_reported = False
        self.closed = False
        self._stop: trio.Event | None = None
        self.thread = threading.Thread(target=self._main, name="rollout-trio-executor", daemon=True)

    def start(self, timeout: float) -> None:
        self.thread.start()
        if not self.ready.wait(timeout):
            self.close()
            raise TimeoutError(f"the executor's thread did not start within {timeout} s")
        if self.error is not None:
            self.error_reported = True
            raise self.error

    def _main(self) -> None:
        try:
            trio.run(self._amain)
        except BaseException as exc:  # surfaced at the caller's next call
            self.error = exc
        finally:
            self.ready.set()

    async def _amain(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self.engine if self.enter_engine else nullcontext():
            async with open_executor(self.engine, self.config, **self.options) as ex:
                self.executor = ex
                self.ready.set()
                await self._stop.wait()

    def _raise_if_dead(self) -> None:
        if self.error is not None:
            self.error_reported = True
            raise RuntimeError("the executor's background thread stopped on an error") from self.error
        if self.closed or self.token is None:
            raise RuntimeError("the executor is closed")

    def call(self, afn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._raise_if_dead()
        try:
            return trio.from_thread.run(lambda: afn(*args, **kwargs), trio_token=self.token)
        except trio.RunFinishedError:
            self._raise_if_dead()
            raise

    def call_sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._raise_if_dead()
        try:
            return trio.from_thread.run_sync(lambda: fn(*args, **kwargs), trio_token=self.token)
        except trio.RunFinishedError:
            self._raise_if_dead()
            raise

    def close(self, timeout: float = 60.0) -> None:
        if self.closed:
            return
        self.closed = True
        if self.thread.is_alive() and self.token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
            except trio.RunFinishedError:
                pass
        if self.thread.ident is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)


class SyncRolloutExecutor:
    """The :class:`RolloutExecutor` methods, blocking, for a trainer that is not Trio.

    Args:
        engine: an :class:`~rollout_trio.engines.InferenceEngine`; it is entered (``async
            with``) in the executor's thread unless ``enter_engine=False``.
        config: a :class:`RolloutConfig` or a mapping; keyword ``overrides`` replace keys.
        dp_size, tokenizer, dumper, stats: as for :func:`open_executor`.
        start_timeout: seconds to wait for the thread (and the engine) to start.

    Use it as a context manager or call :meth:`close`; it is also closed when garbage
    collected and at interpreter exit. An error inside (a stopped executor, a crashed
    engine) is raised at the caller's next call. Completion callbacks run in the
    executor's thread.
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
        self._finalizer = weakref.finalize(self, self._runner.close)

    @property
    def _ex(self) -> RolloutExecutor:
        ex = self._runner.executor
        assert ex is not None
        return ex

    def __enter__(self) -> SyncRolloutExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel in-flight work, stop the thread; raise an error from inside not yet seen."""
        self._finalizer.detach()
        self._runner.close()
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
        return self._runner.call(self._ex.wait, count, timeout, raise_timeout=raise_timeout)  # type: ignore[no-any-return]

    def wait_for_task(self, task_id: int, timeout: float | None = None, *, raise_timeout: bool = True) -> Result | None:
        """See :meth:`RolloutExecutor.wait_for_task`."""
        return self._runner.call(self._ex.wait_for_task, task_id, timeout, raise_timeout=raise_timeout)  # type: ignore[no-any-return]

    def rollout_batch(
        self, data_list: Iterable[Any], workflow: Any, workflow_kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> list[Result]:
        """See :meth:`RolloutExecutor.rollout_batch`."""
        return self._runner.call(self._ex.rollout_batch, data_list, workflow, workflow_kwargs, **options)  # type: ignore[no-any-return]

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
        return self._runner.call(  # type: ignore[no-any-return]
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

