"""``RolloutExecutor``: the rollout layer a trainer embeds.

Every submitted task is in exactly one place at every instant (Trio runs one task at a
time, and each move between places happens without a checkpoint):

* ``queued``: waiting for capacity (staleness budget, concurrency, room in the queue);
* ``running``: its workflow runs in the executor's nursery;
* ``buffered``: accepted, held in the one store of finished tasks until the call that owns
  it takes it (``wait`` / ``wait_for_task`` for submitted tasks, the ``rollout_batch`` call
  that made it, the next ``prepare_batch`` for the source's tasks);
* finished: ``accepted`` (delivered), ``rejected`` (by reason), ``failed``, ``cancelled``,
  ``stale`` (accepted, then dropped because it fell more than ``max_head_offpolicyness``
  versions behind before a trainer call took it) or ``discarded`` (an evaluation result
  whose ``rollout_batch`` call was cancelled).

So ``submitted == accepted + rejected + failed + cancelled + stale + discarded + queued +
running + buffered`` always (:meth:`RolloutExecutor.statistics`). A task starts only while
``running`` plus the results waiting in the common pool (``submit``'s, for ``wait``) is below
``queue_size``; results a call owns (a ``rollout_batch``'s own, ``prepare_batch``'s
leftovers) never stop that call or other work from starting, so a batch of any length
finishes (issue 27).

A call takes its results in one synchronous step when it returns; a call cancelled before
that step has taken nothing, so nothing is ever put back. The staleness bound is checked in
that same step: no trajectory is handed out more than ``max_head_offpolicyness`` versions
behind the version at that instant (its oldest token's version; its start version when it
carries none).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import trio

from .. import workflow_context
from .._errors import RolloutError
from .._group import GroupedRolloutWorkflow
from .._stats import StatsRecorder
from .._workflow import RolloutWorkflow, resolve_workflow
from ._admission import Admission
from ._config import RolloutConfig
from ._consumers import ConsumerCalls
from ._control import Control
from ._episode import EpisodeRunner
from ._feed import PrepareFeed
from ._liveness import ExecutorStalled, StallWatch
from ._observer import ExecutorObserver, bind, bind_optional, emit, oldest_version
from ._staleness import StalenessManager
from ._statistics import ExecutorStatistics
from ._store import AcceptFn as AcceptFn  # the facade imports it from here
from ._store import Callback, Owner, Status, Task, TaskOutcome, TaskStore
from ._store import Result as Result  # the facade imports it from here

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["ExecutorFailed", "ExecutorStalled", "ExecutorStatistics", "RolloutExecutor", "TaskOutcome", "open_executor"]

logger = logging.getLogger("rollout_trio.executor")



class ExecutorFailed(RolloutError):
    """The executor stopped on an error (its ``__cause__``); every later call raises this."""


def _current_seed() -> int | None:
    """The caller's :func:`workflow_context.use_seed` (None outside one)."""
    return workflow_context._seed.get()


class _TrainerVersion:
    """The version the executor judges budget and staleness by: the engine's, or the higher
    one the trainer announced with :meth:`RolloutExecutor.set_version`."""

    __slots__ = ("announced", "engine")

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.announced = 0

    def get_version(self) -> int:
        return max(self.engine.get_version(), self.announced)


class RolloutExecutor(ConsumerCalls, Control, EpisodeRunner):
    """Submits rollouts under a staleness bound and hands accepted trajectories to a trainer.

    Made by :func:`open_executor`; not constructed directly. The consumer calls (``wait``,
    ``wait_for_task``, ``rollout_batch``, ``rollout_stream``, ``prepare_batch``) are in
    :class:`~rollout_trio.executor._consumers.ConsumerCalls`.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        config: RolloutConfig,
        *,
        dp_size: int = 1,
        dumper: Any = None,
        stats: StatsRecorder | None = None,
        observers: Sequence[ExecutorObserver] = (),
    ) -> None:
        self.engine = engine
        self._observers = tuple(observers)
        # bound once: at thousands of tasks per second a lookup per observer and event counts
        self._on_queued = bind(self._observers, "task_queued")
        self._on_started = bind(self._observers, "task_started")
        self._on_finished = bind(self._observers, "task_finished")
        self._on_consumed = bind(self._observers, "task_consumed")
        self.config = config
        self._version = _TrainerVersion(engine)
        self.staleness = StalenessManager.for_data_parallel(
            self._version,
            max_concurrent_rollouts=config.max_concurrent_rollouts,
            consumer_batch_size=config.consumer_batch_size,
            max_staleness=config.max_head_offpolicyness,
            dp_size=dp_size,
        )
        self.queue_size = config.queue_capacity
        self.stats = stats if stats is not None else StatsRecorder()
        self._dumper = dumper
        self._lot = trio.lowlevel.ParkingLot()
        self._control = trio.Lock()  # pause / resume, one at a time
        self._nursery: trio.Nursery | None = None
        self._admission = Admission(self.staleness, self.queue_size)
        self._store = TaskStore(self._admission)
        self._common = self._store.common
        self._watch = StallWatch(
            config.stall_warning_s, config.max_consecutive_rejections, self._waiting_on,
            bind_optional(self._observers, "call_stalled"), bind_optional(self._observers, "call_unstalled"),
        )  # fmt: skip
        self._order = 0
        self._next_id = 0
        self._seq = 0
        self._submitted = 0
        self._cancelled = 0
        self._rejected: collections.Counter[str] = collections.Counter()
        self._failed: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._failure: BaseException | None = None
        self._failure_reported = False
        self._tracked_keys: set[str] | None = None
        self._feed: PrepareFeed | None = None

    # -- state ---------------------------------------------------------------------------

    def _check(self) -> None:
        if self._failure is not None:
            self._failure_reported = True
            raise ExecutorFailed(f"the executor stopped: {type(self._failure).__name__}: {self._failure}") from self._failure
        if self._closed:
            raise RuntimeError("the executor is closed (its `async with open_executor(...)` block has ended)")

    def _notify(self) -> None:
        self._lot.unpark_all()

    async def _park(self) -> None:
        await self._lot.park()
        self._check()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            logger.error("Rollout executor stopped: %s: %s", type(exc).__name__, exc)
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            self._notify()

    def _seed(self) -> int | None:
        """The caller's :func:`workflow_context.use_seed`, else the config's ``seed``."""
        seed = _current_seed()
        return self.config.seed if seed is None else seed

    def get_version(self) -> int:
        """The trainer's version as the executor sees it (budget and staleness are judged by it)."""
        return self._version.get_version()

    def statistics(self) -> ExecutorStatistics:
        """The counters now (callable at any moment, even after a failure)."""
        store = self._store
        oldest = min((t.version for t in store.held.values()), default=None)
        return ExecutorStatistics(
            submitted=self._submitted,
            queued=self._admission.queued,
            running=len(self._admission.running),
            buffered=store.buffered,
            accepted=store.accepted,
            rejected=sum(self._rejected.values()),
            rejected_by_reason=dict(self._rejected),
            failed=sum(self._failed.values()),
            failed_by_reason=dict(self._failed),
            cancelled=self._cancelled,
            stale=store.stale,
            stale_tokens=store.stale_tokens,
            discarded=store.discarded,
            version=self.get_version(),
            capacity=self.staleness.get_capacity(),
            oldest_buffered_version=oldest,
            paused=self._admission.paused,
            stalled_calls=dict(self._watch.stalled),
        )

    def group_statistics(self, *, reset: bool = True) -> dict[str, float]:
        """Group statistics of this executor's tasks, averaged per ``"scope/name"``."""
        return self.stats.export(reset=reset)

    @property
    def dumper(self) -> Any:
        """The trajectory dumper (None without ``dump_to_file``); its ``statistics()`` count dumps."""
        return self._dumper

    @property
    def paused(self) -> bool:
        """Whether :meth:`pause` is in effect."""
        return self._admission.paused

    def _waiting_on(self) -> str:
        text = self._admission.waiting_on(self.get_version())
        servers = getattr(self.engine, "servers", None)  # a RemoteEngine's fleet
        if isinstance(servers, list) and servers:
            down = sum(1 for s in servers if not getattr(s, "up", True))
            if down:
                text += f", {down} of {len(servers)} servers out of service"
        return text

    # -- submission ----------------------------------------------------------------------

    def _resolve(
        self, workflow: Any, workflow_kwargs: Mapping[str, Any] | None, group_size: int, options: Mapping[str, Any]
    ) -> RolloutWorkflow:
        if group_size == 1 and not options:
            return resolve_workflow(workflow, workflow_kwargs)
        return GroupedRolloutWorkflow(workflow, group_size, workflow_kwargs=workflow_kwargs, **options)

    def _take_id(self, task_id: int | None) -> int:
        if task_id is None:
            while self._next_id in self._store.tasks:
                self._next_id += 1
            task_id = self._next_id
            self._next_id += 1
            return task_id
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise TypeError(f"task_id: must be an int or None, got {type(task_id).__name__}")
        if task_id in self._store.tasks:
            raise ValueError(f"Duplicate task_id: {task_id}; a task with this id is pending, running or unconsumed")
        return task_id

    @staticmethod
    def _check_callables(should_accept_fn: Any, callback: Any) -> None:
        if should_accept_fn is not None and not callable(should_accept_fn):
            raise TypeError(f"should_accept_fn: must be callable or None, got {type(should_accept_fn).__name__}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback: must be callable or None, got {type(callback).__name__}")

    def _enqueue(
        self,
        data: Any,
        workflow: RolloutWorkflow,
        owner: Owner,
        *,
        task_id: int | None = None,
        is_eval: bool,
        should_accept_fn: AcceptFn | None,
        callback: Callback | None,
    ) -> Task:
        tid = self._take_id(task_id)
        self._order += 1
        task = Task(
            tid, data, workflow, should_accept_fn, bool(is_eval), callback, owner, self._order,
            seed=self._seed(),
        )  # fmt: skip
        self._store.add(task)
        owner.unfinished += 1
        self._admission.queue(task)
        self._submitted += 1
        if self._observers:
            now = trio.current_time()
            emit(self._on_queued, "task_queued", tid, is_eval=task.is_eval, time=now)
        self._notify()
        return task

    def submit(
        self,
        data: Any,
        workflow: Any,
        workflow_kwargs: Mapping[str, Any] | None = None,
        *,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
        should_accept_fn: AcceptFn | None = None,
        callback: Callback | None = None,
        **group_options: Any,
    ) -> int:
        """Queue one task; returns its id. Never blocks (capacity gates the start, not the queue).

        Args:
            data: the dataset item given to the workflow.
            workflow: anything :func:`rollout_trio.resolve_workflow` accepts.
            workflow_kwargs: keyword arguments for the workflow.
            group_size: run ``group_size`` slots as one group (:class:`GroupedRolloutWorkflow`);
                ``group_options`` (``min_usable_group_size``, ``drop_incomplete_group``,
                ``reward_normalization``, ...) go to it.
            task_id: an explicit id (``ValueError`` if one is pending, running or unconsumed).
            is_eval: an evaluation task: not limited by the training staleness budget, and
                its context and statistics scope say so.
            should_accept_fn: ``fn(trajectory) -> bool``; false rejects the trajectory.
            callback: ``fn(TaskOutcome)`` called when the task ends (errors are logged).
        """
        self._check()
        self._check_callables(should_accept_fn, callback)
        wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
        task = self._enqueue(
            data, wf, self._common, task_id=task_id, is_eval=is_eval, should_accept_fn=should_accept_fn, callback=callback
        )
        return task.task_id

    def cancel(self, task_id: int) -> bool:
        """Cancel a queued or running task (its generations are aborted); False if it already ended."""
        self._check()
        return self._cancel(task_id)

    def _cancel(self, task_id: int) -> bool:
        task = self._store.tasks.get(task_id)
        if task is None or task.status is not None:
            return False
        if task in self._admission.running:
            task.cancel_requested = True
            assert task.scope is not None
            task.scope.cancel()
            return True
        self._admission.unqueue(task)
        self._conclude(task, "cancelled", "cancelled", None)
        return True

    # -- the dispatcher and the tasks -------------------------------------------------------

    async def _serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._failure is not None:
                nursery.cancel_scope.cancel()
            nursery.start_soon(self._dispatch)
            task_status.started()

    def _start(self, task: Task) -> None:
        assert self._nursery is not None
        self._admission.started(task)
        self._seq += 1
        task.seq = self._seq
        task.scope = trio.CancelScope()
        self._nursery.start_soon(self._run, task)

    async def _dispatch(self) -> None:
        poll = self.config.version_poll_interval
        admission = self._admission
        while True:
            if admission.queued:
                # A stale result gives back its budget and its room in the pool: drop it
                # before deciding what can start (a no-op unless one is old enough).
                self._sweep_stale()
            # (No call waits for a start: they wait for ends and versions, which notify.)
            while (task := admission.next_task()) is not None:
                self._start(task)
            if admission.starved():
                # Starved of budget: only a version bump opens it, and the trainer may bump
                # the engine directly (polled: no call tells the executor).
                with trio.move_on_after(poll):
                    await self._lot.park()
            else:
                await self._lot.park()
            # Let the consumer calls woken with it take their results first (each takes in
            # one step): what starts next then never depends on which task Trio ran first.
            await trio.lowlevel.checkpoint()

    def _conclude(self, task: Task, status: Status, reason: str | None, result: Result | None) -> None:
        """Move a finished task to its owner (no checkpoint in here: the invariant holds throughout)."""
        task.status, task.reason = status, reason
        owner = task.owner
        owner.unfinished -= 1
        owner.record(status, reason)
        if status == "accepted":
            task.result = result
            oldest = oldest_version(result)
            task.version = task.start_version if oldest is None else oldest
            self._store.hold(task)
        elif status == "rejected":
            self._rejected[reason or "rejected"] += 1
        elif status == "failed":
            self._failed[reason or "failed"] += 1
        else:
            self._cancelled += 1
        if self._observers:
            now = trio.current_time()
            emit(self._on_finished, "task_finished", task.task_id, status=status, reason=reason, result=result, time=now)
        if task.callback is not None:
            try:
                task.callback(TaskOutcome(task.task_id, status, reason, result, task.data))
            except Exception:
                logger.exception("Completion callback of task %d failed.", task.task_id)
        if owner.kind != "stream":  # a stream hands each outcome out with its data
            task.data = None
        if owner.abandoned:
            self._store.hand_on(task)
        elif owner is self._common and status != "accepted":
            self._store.forget(task)  # nobody takes a result-less common task: wait_for_task answers None
        else:
            owner.finished[task.task_id] = task
        self._notify()

    def _sweep_stale(self) -> None:
        """Drop every untaken training result more than ``max_head_offpolicyness`` versions
        behind the current version (unless ``drop_stale`` is off). Every take calls it
        first, with no checkpoint between."""
        if not self.config.drop_stale:
            return
        floor = self.get_version() - self.config.max_head_offpolicyness
        store = self._store
        if floor <= store.oldest_held:
            return
        for task in store.stale_below(floor):
            store.drop(task, "stale")
            logger.info("Task %d: dropped, its oldest token (version %d) is older than %d.", task.task_id, task.version, floor)
            if task.owner is self._common:
                store.forget(task)

    def _take(self, task: Task) -> Result | None:
        """Hand ``task``'s result to the caller: it leaves the executor (no checkpoint)."""
        result = self._store.take(task)
        if result is not None and self._observers:
            version = self.get_version()
            lag = max(0, version - task.version)
            now = trio.current_time()
            emit(self._on_consumed, "task_consumed", task.task_id, version=version, lag=lag, time=now)
        return result

    def _abandon(self, owner: Owner, tasks: list[Task]) -> None:
        """A rollout_batch call ended early (cancelled, or the executor stopped): its unfinished
        tasks are cancelled, its finished ones handed on. Nothing was taken, so nothing is undone."""
        owner.abandoned = True
        for task in list(owner.finished.values()):
            self._store.hand_on(task)
        if self._failure is None and not self._closed:
            for task in tasks:
                self._cancel(task.task_id)  # a queued one concludes (and is handed on) at once
        self._notify()

    def _close(self) -> None:
        """Cancel everything (queued tasks count as cancelled; running ones as they unwind)."""
        if self._closed:
            return
        self._closed = True
        for task in self._admission.drain():
            self._conclude(task, "cancelled", "closed", None)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        self._notify()

def _make_dumper(config: RolloutConfig, tokenizer: Any, dumper: Any) -> Any:
    if dumper is not None or not config.dump_to_file:
        return dumper
    missing = [n for n in ("fileroot", "experiment_name", "trial_name") if not getattr(config, n)]
    if tokenizer is None:
        missing.append("tokenizer")
    if missing:
        raise ValueError(f"RolloutConfig.dump_to_file: needs {', '.join(missing)} (set them, or turn dump_to_file off)")
    from ._dump import TrajectoryDumper

    assert config.fileroot and config.experiment_name and config.trial_name  # checked above
    return TrajectoryDumper(config.fileroot, config.experiment_name, config.trial_name, tokenizer)


@asynccontextmanager
async def open_executor(
    engine: InferenceEngine,
    config: RolloutConfig | Mapping[str, Any] | None = None,
    *,
    dp_size: int = 1,
    tokenizer: Any = None,
    dumper: Any = None,
    stats: StatsRecorder | None = None,
    observers: Sequence[ExecutorObserver] = (),
    **overrides: Any,
) -> AsyncIterator[RolloutExecutor]:
    """Run a :class:`RolloutExecutor` for the ``async with`` block.

    ``config`` is a :class:`RolloutConfig` or a mapping; keyword ``overrides`` replace its
    keys. ``dp_size`` divides concurrency and batch size among data-parallel trainer
    ranks. ``tokenizer`` decodes dumps (``dump_to_file``); ``dumper`` replaces the
    default :class:`TrajectoryDumper`. The engine must already be open. ``observers``
    (:class:`ExecutorObserver`) see every task transition: metrics and traces hang here.

    Leaving the block (normally, by an error or by cancellation) cancels queued and
    running tasks, aborting their generations, and flushes dumps. If the executor
    stopped on an error the body did not see, leaving raises :class:`ExecutorFailed`.
    """
    cfg = RolloutConfig.coerce(config, **overrides)
    dumper = _make_dumper(cfg, tokenizer, dumper)
    ex = RolloutExecutor(engine, cfg, dp_size=dp_size, dumper=dumper, stats=stats, observers=observers)
    body_error: BaseException | None = None
    async with dumper if dumper is not None else nullcontext():
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(ex._serve)
                try:
                    yield ex
                except BaseException as exc:
                    body_error = exc
                finally:
                    ex._close()
        finally:  # also when a cancellation ends the nursery: the source's cleanup runs (shielded)
            if ex._feed is not None:
                await ex._feed.items.aclose()
    if body_error is not None:
        raise body_error
    if ex._failure is not None and not ex._failure_reported:
        ex._check()

