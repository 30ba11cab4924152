"""``RolloutExecutor``: the rollout layer a trainer embeds.

Every submitted task is in exactly one place at every instant (Trio runs one task at a
time, and each move between places happens without a checkpoint):

* ``queued``: waiting for capacity (staleness budget, concurrency, room in the queue);
* ``running``: its workflow runs in the executor's nursery;
* ``buffered``: accepted, held until the trainer takes it (``wait``, ``rollout_batch``,
  ``prepare_batch``, ``wait_for_task``);
* finished: ``accepted`` (delivered), ``rejected`` (by reason), ``failed`` or ``cancelled``.

So ``submitted == accepted + rejected + failed + cancelled + queued + running + buffered``
always (:meth:`RolloutExecutor.statistics`). Buffered trajectories never exceed
``queue_size``: a task starts only while ``running + buffered < queue_size``. (The one
exception: a ``rollout_batch`` / ``prepare_batch`` call abandoned part-way returns the
trajectories it had taken to the buffer rather than lose them; no task starts until the
buffer is back under the bound.)
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from .. import workflow_context
from .._errors import RolloutError, WorkflowContractError
from .._group import GroupedRolloutWorkflow
from .._interaction import Interaction, interactions_to_trajectory
from .._stats import StatsRecorder
from .._check import check_trajectory_format
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow, resolve_workflow
from ._config import RolloutConfig
from ._observer import ExecutorObserver, notify, oldest_version
from ._staleness import StalenessManager

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["ExecutorFailed", "ExecutorStatistics", "RolloutExecutor", "TaskOutcome", "open_executor"]

logger = logging.getLogger("rollout_trio.executor")

Status = Literal["accepted", "rejected", "failed", "cancelled"]
Result = Trajectory | dict[str, Interaction]
AcceptFn = Callable[[Any], Any]
Callback = Callable[["TaskOutcome"], Any]


class ExecutorFailed(RolloutError):
    """The executor stopped on an error (its ``__cause__``); every later call raises this."""


@attrs.frozen
class TaskOutcome:
    """How one task ended, as passed to its completion callback.

    ``trajectory`` is set for accepted tasks and for tasks ``should_accept_fn`` rejected.
    """

    task_id: int
    status: Status
    reason: str | None
    trajectory: Result | None
    data: Any


@attrs.frozen(kw_only=True)
class ExecutorStatistics:
    """A snapshot of the executor (see the module docstring for the invariant).

    ``accepted`` counts trajectories handed to the trainer; ``buffered`` those waiting
    for it. ``capacity`` is the staleness manager's; ``oldest_buffered_version`` is the
    engine version at the start of the oldest buffered task (None when none is).
    """

    submitted: int
    queued: int
    running: int
    buffered: int
    accepted: int
    rejected: int
    rejected_by_reason: Mapping[str, int]
    failed: int
    failed_by_reason: Mapping[str, int]
    cancelled: int
    version: int
    capacity: int
    oldest_buffered_version: int | None
    paused: bool

    def balanced(self) -> bool:
        """Whether every submitted task is accounted for exactly once."""
        return self.submitted == (
            self.accepted + self.rejected + self.failed + self.cancelled + self.queued + self.running + self.buffered
        )


class _Collector:
    """Receives the outcomes of the tasks of one ``rollout_batch`` / ``prepare_batch`` / ``wait_for_task``."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done: collections.deque[_Task] = collections.deque()


@attrs.define(eq=False, slots=True)
class _Task:
    task_id: int
    data: Any
    workflow: RolloutWorkflow
    should_accept_fn: AcceptFn | None
    is_eval: bool
    callback: Callback | None
    collector: _Collector | None
    seq: int = 0
    start_time: float = 0.0
    start_version: int = 0
    scope: trio.CancelScope | None = None
    cancel_requested: bool = False
    status: Status | None = None
    reason: str | None = None
    result: Result | None = None


def _contract_error(exc: BaseException) -> BaseException | None:
    """The WorkflowContractError in ``exc`` (bare or inside a group), if any."""
    if isinstance(exc, WorkflowContractError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, _ = exc.split(WorkflowContractError)
        return match
    return None


class RolloutExecutor:
    """Submits rollouts under a staleness bound and hands accepted trajectories to a trainer.

    Made by :func:`open_executor`; not constructed directly.
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
        self.config = config
        self.staleness = StalenessManager.for_data_parallel(
            engine,
            max_concurrent_rollouts=config.max_concurrent_rollouts,
            consumer_batch_size=config.consumer_batch_size,
            max_staleness=config.max_head_offpolicyness,
            dp_size=dp_size,
        )
        self.queue_size = config.queue_capacity
        self.stats = stats if stats is not None else StatsRecorder()
        self._dumper = dumper
        self._lot = trio.lowlevel.ParkingLot()
        self._nursery: trio.Nursery | None = None
        self._pending: collections.deque[_Task] = collections.deque()
        self._running: set[_Task] = set()
        self._tasks: dict[int, _Task] = {}  # queued, running or holding an untaken result
        self._buffer: dict[int, _Task] = {}  # accepted, unclaimed
        self._recent: collections.OrderedDict[int, Status] = collections.OrderedDict()
        self._next_id = 0
        self._seq = 0
        self._submitted = 0
        self._accepted = 0
        self._buffered = 0
        self._cancelled = 0
        self._rejected: collections.Counter[str] = collections.Counter()
        self._failed: collections.Counter[str] = collections.Counter()
        self._paused = False
        self._closed = False
        self._failure: BaseException | None = None
        self._failure_reported = False
        self._tracked_keys: set[str] | None = None
        self._feed: _Feed | None = None

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

    def statistics(self) -> ExecutorStatistics:
        """The counters now (callable at any moment, even after a failure)."""
        oldest = min((t.start_version for t in self._buffer.values()), default=None)
        return ExecutorStatistics(
            submitted=self._submitted,
            queued=len(self._pending),
            running=len(self._running),
            buffered=self._buffered,
            accepted=self._accepted,
            rejected=sum(self._rejected.values()),
            rejected_by_reason=dict(self._rejected),
            failed=sum(self._failed.values()),
            failed_by_reason=dict(self._failed),
            cancelled=self._cancelled,
            version=self.engine.get_version(),
            capacity=self.staleness.get_capacity(),
            oldest_buffered_version=oldest,
            paused=self._paused,
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
        return self._paused

    # -- submission ----------------------------------------------------------------------

    def _resolve(
        self, workflow: Any, workflow_kwargs: Mapping[str, Any] | None, group_size: int, options: Mapping[str, Any]
    ) -> RolloutWorkflow:
        if group_size == 1 and not options:
            return resolve_workflow(workflow, workflow_kwargs)
        return GroupedRolloutWorkflow(workflow, group_size, workflow_kwargs=workflow_kwargs, **options)

    def _take_id(self, task_id: int | None) -> int:
        if task_id is None:
            while self._next_id in self._tasks:
                self._next_id += 1
            task_id = self._next_id
            self._next_id += 1
            return task_id
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise TypeError(f"task_id: must be an int or None, got {type(task_id).__name__}")
        if task_id in self._tasks:
            raise ValueError(f"Duplicate task_id: {task_id}; a task with this id is pending, running or unconsumed")
        return task_id

    def _enqueue(
        self,
        data: Any,
        workflow: RolloutWorkflow,
        *,
        task_id: int | None,
        is_eval: bool,
        should_accept_fn: AcceptFn | None,
        callback: Callback | None,
        collector: _Collector | None,
    ) -> _Task:
        if should_accept_fn is not None and not callable(should_accept_fn):
            raise TypeError(f"should_accept_fn: must be callable or None, got {type(should_accept_fn).__name__}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback: must be callable or None, got {type(callback).__name__}")
        tid = self._take_id(task_id)
        self._recent.pop(tid, None)
        task = _Task(tid, data, workflow, should_accept_fn, bool(is_eval), callback, collector)
        self._tasks[tid] = task
        self._pending.append(task)
        self._submitted += 1
        self.staleness.on_rollout_enqueued()
        if self._observers:
            notify(self._observers, "task_queued", tid, is_eval=task.is_eval, time=trio.current_time())
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
            is_eval: an evaluation task (its context and statistics scope say so).
            should_accept_fn: ``fn(trajectory) -> bool``; false rejects the trajectory.
            callback: ``fn(TaskOutcome)`` called when the task ends (errors are logged).
        """
        self._check()
        wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
        task = self._enqueue(
            data, wf, task_id=task_id, is_eval=is_eval, should_accept_fn=should_accept_fn, callback=callback, collector=None
        )
        return task.task_id

    def cancel(self, task_id: int) -> bool:
        """Cancel a queued or running task (its generations are aborted); False if it already ended."""
        self._check()
        task = self._tasks.get(task_id)
        if task is None or task.status is not None:
            return False
        if task in self._running:
            task.cancel_requested = True
            assert task.scope is not None
            task.scope.cancel()
            return True
        self._pending.remove(task)
        self.staleness.on_rollout_dequeued()
        self._conclude(task, "cancelled", "cancelled", None)
        return True

    # -- pause, versions ------------------------------------------------------------------

    async def pause(self) -> None:
        """Start nothing new and interrupt in-flight generation (the engine's pause).

        Submissions are still queued and finished results still delivered.
        """
        self._check()
        self._paused = True
        await self.engine.pause()
        self._notify()

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._check()
        await self.engine.resume()
        self._paused = False
        self._notify()

    def set_version(self, version: int) -> None:
        """Set the engine's version and let the executor see the new budget at once."""
        self._check()
        self.engine.set_version(version)
        self._notify()

    def on_version_recovered(self, version: int) -> None:
        """After a checkpoint resume at ``version``: no burst of ``version`` batches of budget."""
        self._check()
        self.staleness.on_version_recovered(version)
        self._notify()

    # -- the dispatcher and the tasks -------------------------------------------------------

    def _can_start(self) -> bool:
        return (
            not self._paused
            and bool(self._pending)
            and len(self._running) + self._buffered < self.queue_size
            and self.staleness.get_capacity() > 0
        )

    async def _serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._failure is not None:
                nursery.cancel_scope.cancel()
            nursery.start_soon(self._dispatch)
            task_status.started()

    async def _dispatch(self) -> None:
        nursery = self._nursery
        assert nursery is not None
        poll = self.config.version_poll_interval
        while True:
            started = False
            while self._can_start():
                task = self._pending.popleft()
                self._running.add(task)
                self.staleness.on_rollout_submitted()
                self._seq += 1
                task.seq = self._seq
                task.scope = trio.CancelScope()
                nursery.start_soon(self._run, task)
                started = True
            if started:
                self._notify()
            starved = bool(self._pending) and not self._paused and len(self._running) + self._buffered < self.queue_size
            if starved:
                # Only a version bump opens budget, and the trainer may bump it on the engine directly.
                with trio.move_on_after(poll):
                    await self._lot.park()
            else:
                await self._lot.park()

    async def _run(self, task: _Task) -> None:
        scope = task.scope
        assert scope is not None
        task.start_time = trio.current_time()
        task.start_version = self.engine.get_version()
        if self._observers:
            notify(self._observers, "task_started", task.task_id, version=task.start_version, time=task.start_time)
        if self.config.episode_timeout is not None:
            scope.deadline = task.start_time + self.config.episode_timeout
        outcome: tuple[Status, str | None, Result | None] = ("cancelled", "cancelled", None)
        try:
            try:
                with scope:
                    outcome = await self._episode(task)
            except Exception as exc:  # what is left of a group once the scope took its Cancelled leaves
                outcome = self._on_error(task, exc)
            if scope.cancelled_caught and not task.cancel_requested and self._failure is None:
                outcome = ("failed", "timeout", None)
                logger.warning("Task %d ran past its episode_timeout of %s s.", task.task_id, self.config.episode_timeout)
        except BaseExceptionGroup as group:
            # Outer cancellation mixed with real errors: record the errors, let the Cancelled through.
            cancelled, rest = group.split(trio.Cancelled)
            if rest is not None:
                self._on_error(task, rest)
            if cancelled is not None:
                raise cancelled from None
        finally:
            self._running.discard(task)
            status, reason, result = outcome
            if status == "accepted":
                self.staleness.on_rollout_accepted()
            else:
                self.staleness.on_rollout_rejected()
            self._conclude(task, status, reason, result)

    def _on_error(self, task: _Task, exc: BaseException) -> tuple[Status, str | None, Result | None]:
        contract = _contract_error(exc)
        if contract is not None:
            self._fail(contract)
            return ("failed", "contract_error", None)
        if self.config.on_workflow_error == "raise":
            self._fail(exc)
        logger.error("Task %d: workflow failed; the task is counted as failed.", task.task_id, exc_info=exc)
        return ("failed", "workflow_exception", None)

    async def _episode(self, task: _Task) -> tuple[Status, str | None, Result | None]:
        ctx = workflow_context.WorkflowContext(is_eval=task.is_eval, task_id=task.task_id)
        try:
            with workflow_context.use(ctx), workflow_context.use_stats_recorder(self.stats):
                raw = await task.workflow.arun_episode(self.engine, task.data)
            result, reason = self._convert(task, raw)
            if result is None:
                return ("rejected", reason, None)
            accepted = task.should_accept_fn is None or bool(task.should_accept_fn(result))
        except Exception as exc:
            return self._on_error(task, exc)
        if self._dumper is not None and isinstance(result, Trajectory):
            await self._dumper.dump(result, task_id=task.task_id, is_eval=task.is_eval, accepted=accepted)
        return ("accepted", None, result) if accepted else ("rejected", "should_accept_fn", result)

    def _convert(self, task: _Task, raw: Any) -> tuple[Result | None, str | None]:
        if raw is None:
            return None, "returned_none"
        if isinstance(raw, Trajectory):
            result: Result = raw
        elif isinstance(raw, Mapping):
            if not raw:
                return None, "empty_result"
            if all(isinstance(v, Interaction) for v in raw.values()):
                if all(v.has_tensor_data for v in raw.values()):
                    result = interactions_to_trajectory(raw)
                else:
                    result = dict(raw)
            else:
                result = Trajectory.from_dict(raw, where=f"task {task.task_id}: ")
        else:
            raise WorkflowContractError(
                f"task {task.task_id}: a workflow must return a Trajectory, a dict or None; got {type(raw).__name__}"
            )
        if self.config.check_trajectory_format and isinstance(result, Trajectory):
            check_trajectory_format(result, expected_keys=self._tracked_keys)
            if self._tracked_keys is None:
                self._tracked_keys = set(result.to_dict())
                logger.info("Trajectory format check: tracking keys %s", sorted(self._tracked_keys))
        return result, None

    def _conclude(self, task: _Task, status: Status, reason: str | None, result: Result | None) -> None:
        """Move a finished task to its place (no checkpoint in here: the invariant holds throughout)."""
        task.status, task.reason = status, reason
        if status == "accepted":
            task.result = result
            self._buffered += 1
            if task.collector is not None:
                task.collector.done.append(task)
            else:
                self._buffer[task.task_id] = task
        else:
            if status == "rejected":
                self._rejected[reason or "rejected"] += 1
            elif status == "failed":
                self._failed[reason or "failed"] += 1
            else:
                self._cancelled += 1
            if task.collector is not None:
                task.collector.done.append(task)
            else:
                del self._tasks[task.task_id]
                self._remember(task.task_id, status)
        if self._observers:
            notify(
                self._observers, "task_finished", task.task_id,
                status=status, reason=reason, result=result, time=trio.current_time(),
            )
        if task.callback is not None:
            try:
                task.callback(TaskOutcome(task.task_id, status, reason, result, task.data))
            except Exception:
                logger.exception("Completion callback of task %d failed.", task.task_id)
        task.data = None
        self._notify()

    def _remember(self, task_id: int, status: Status) -> None:
        self._recent[task_id] = status
        while len(self._recent) > self.queue_size:
            self._recent.popitem(last=False)

    def _take(self, task: _Task) -> Result | None:
        """Hand ``task``'s result to the caller: it leaves the executor."""
        self._tasks.pop(task.task_id, None)
        if task.status != "accepted":
            return None
        self._buffered -= 1
        self._accepted += 1
        result, task.result = task.result, None
        if self._observers:
            version = self.engine.get_version()
            oldest = oldest_version(result)
            lag = 0 if oldest is None else max(0, version - oldest)
            notify(self._observers, "task_consumed", task.task_id, version=version, lag=lag, time=trio.current_time())
        return result

    def _close(self) -> None:
        """Cancel everything (queued tasks count as cancelled; running ones as they unwind)."""
        if self._closed:
            return
        self._closed = True
        while self._pending:
            task = self._pending.popleft()
            self.staleness.on_rollout_dequeued()
            self._conclude(task, "cancelled", "closed", None)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        self._notify()

    def _untake(self, task: _Task, result: Result) -> None:
        """Undo :meth:`_take`: the result is buffered again."""
        task.result = result
        self._accepted -= 1
        self._buffered += 1
        self._tasks[task.task_id] = task

    def _abandon(self, tasks: list[_Task], collector: _Collector, taken: dict[int, Result]) -> None:
        """A rollout_batch call ended early (cancelled, or the executor stopped).

        Its unfinished tasks are cancelled; accepted trajectories it had not returned go to
        the common buffer (for ``wait``), so nothing accepted is lost.
        """
        for task in tasks:
            if task.status is None:
                task.collector = None  # it concludes the ordinary way
                if self._failure is None and not self._closed:
                    self.cancel(task.task_id)
        while collector.done:
            task = collector.done.popleft()
            task.collector = None
            if task.status == "accepted":
                self._buffer[task.task_id] = task
            else:
                self._tasks.pop(task.task_id, None)
                self._remember(task.task_id, task.status or "cancelled")
        for task in tasks:
            if task.task_id in taken:
                self._untake(task, taken.pop(task.task_id))
                self._buffer[task.task_id] = task
        self._notify()

    # -- consuming -------------------------------------------------------------------------

    async def wait(self, count: int, timeout: float | None = None, *, raise_timeout: bool = True) -> list[Result]:
        """Wait for ``count`` accepted trajectories and take them (oldest-started first).

        Raises:
            ValueError: ``count`` below 1 or above ``queue_size`` (it could never fill).
            TimeoutError: ``timeout`` seconds passed first (``raise_timeout=False``:
                returns ``[]``; nothing is taken).
            ExecutorFailed: the executor stopped.
        """
        self._check()
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"count must be positive, got {count!r}")
        if count > self.queue_size:
            raise ValueError(f"count must be <= queue_size ({self.queue_size}), got {count}")
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while len(self._buffer) < count:
                await self._park()
        if len(self._buffer) < count:
            if raise_timeout:
                raise TimeoutError(f"Timed out waiting for {count} results, only received {len(self._buffer)}")
            return []
        key = (lambda t: t.task_id) if self.config.deterministic_sampling else (lambda t: t.seq)
        chosen = heapq.nsmallest(count, self._buffer.values(), key=key)
        out = []
        for task in chosen:
            del self._buffer[task.task_id]
            result = self._take(task)
            assert result is not None
            out.append(result)
        self._notify()
        return out

    async def wait_for_task(
        self, task_id: int, timeout: float | None = None, *, raise_timeout: bool = True
    ) -> Result | None:
        """Wait for one task and take its result (None when it was rejected, failed or cancelled).

        Raises:
            ValueError: the id was never submitted, or its result was already taken.
            TimeoutError: ``timeout`` passed (``raise_timeout=False``: returns None).
        """
        self._check()
        if task_id in self._buffer:
            result = self._take(self._buffer.pop(task_id))
            self._notify()
            return result
        if task_id in self._recent:
            del self._recent[task_id]
            return None
        task = self._tasks.get(task_id)
        if task is None:
            raise ValueError(f"Task {task_id} is never submitted.")
        if task.collector is not None:
            raise ValueError(f"Task {task_id} belongs to a rollout_batch or prepare_batch call that will take it")
        collector = task.collector = _Collector()
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                while not collector.done:
                    await self._park()
        finally:
            if not collector.done:
                task.collector = None  # a later result goes to the common buffer
        if not collector.done:
            if raise_timeout:
                raise TimeoutError(f"Timed out waiting for task {task_id}.")
            return None
        result = self._take(task)
        self._notify()
        return result

    def _progress(self, total: int | None, progress: bool | None, unit: str) -> Any:
        show = sys.stderr.isatty() if progress is None else progress
        if not show:
            return nullcontext(None)
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        return tqdm(total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)

    async def rollout_batch(
        self,
        data_list: Iterable[Any],
        workflow: Any,
        workflow_kwargs: Mapping[str, Any] | None = None,
        *,
        group_size: int = 1,
        is_eval: bool = False,
        should_accept_fn: AcceptFn | None = None,
        callback: Callback | None = None,
        progress: bool | None = None,
        **group_options: Any,
    ) -> list[Result]:
        """Run every item once and return the accepted trajectories in input order.

        Waits for its own tasks only. ``callback`` is called with each task's
        :class:`TaskOutcome`; ``progress``: a tqdm bar (default: when stderr is a terminal).
        """
        self._check()
        wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
        collector = _Collector()
        tasks = [
            self._enqueue(
                item, wf, task_id=None, is_eval=is_eval, should_accept_fn=should_accept_fn, callback=callback,
                collector=collector,
            )
            for item in data_list
        ]
        results: dict[int, Result] = {}
        remaining = len(tasks)
        try:
            with self._progress(remaining, progress, "task") as bar:
                while remaining:
                    while collector.done:
                        task = collector.done.popleft()
                        result = self._take(task)
                        remaining -= 1
                        if result is not None:
                            results[task.task_id] = result
                        if bar is not None:
                            bar.update(1)
                    if remaining:
                        await self._park()
            self._notify()
        except BaseException:
            self._abandon(tasks, collector, results)
            raise
        return [results[t.task_id] for t in tasks if t.task_id in results]

    async def prepare_batch(
        self,
        source: Iterable[Any] | AsyncIterable[Any],
        workflow: Any,
        workflow_kwargs: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
        should_accept_fn: AcceptFn | None = None,
        dynamic_bs: bool = False,
        cycle: bool = True,
        callback: Callback | None = None,
        group_size: int = 1,
        progress: bool | None = None,
        **group_options: Any,
    ) -> list[Result]:
        """The next training batch, keeping the pipeline full across calls.

        ``source`` (a sync or async iterable of items, or a data loader whose ``batch_size``
        attribute says each element is a batch) is cycled forever; at most
        ``(max_head_offpolicyness + 1) * consumer_batch_size`` of its items wait queued.
        Returns ``batch_size`` accepted trajectories, or with ``dynamic_bs`` the accepted
        ones among the next ``batch_size`` finished tasks. With ``cycle=False`` the source
        is read once: when it is used up and its tasks are all taken, the batch is returned
        as it is (possibly short, possibly empty). ``callback`` gets every task's
        :class:`TaskOutcome` (the first call's ``should_accept_fn``, ``cycle`` and
        ``callback`` stay in force).

        Raises:
            ValueError: another source or workflow than the first call's; a batch larger
                than ``queue_size``; a source whose full pass yields nothing.
        """
        self._check()
        if self._feed is None:
            wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
            self._feed = _Feed(source, workflow, wf, should_accept_fn, cycle=cycle, callback=callback)
        elif not _same_source(self._feed.source, source) or self._feed.workflow_arg is not workflow:
            raise ValueError(
                "prepare_batch: called with another data source or workflow than the first call; "
                "one executor cycles one source (use submit / rollout_batch for others)"
            )
        feed = self._feed
        if batch_size is None:
            batch_size = getattr(source, "batch_size", None)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"prepare_batch: batch_size must be an integer >= 1 (or the source's batch_size), got {batch_size!r}")
        if self.queue_size < batch_size:
            raise ValueError(f"Inference engine config's queue size is too small: {self.queue_size} < batch size {batch_size}.")
        pending_limit = self.staleness.get_pending_limit()
        kept: list[tuple[_Task, Result]] = []
        try:
            return await self._fill_batch(feed, batch_size, dynamic_bs, pending_limit, kept, progress)
        except BaseException:
            # Abandoned: the trajectories taken so far wait, in order, for the next call.
            for task, result in reversed(kept):
                self._untake(task, result)
                feed.collector.done.appendleft(task)
                feed.outstanding += 1
            self._notify()
            raise

    async def _fill_batch(
        self,
        feed: _Feed,
        batch_size: int,
        dynamic_bs: bool,
        pending_limit: int,
        kept: list[tuple[_Task, Result]],
        progress: bool | None,
    ) -> list[Result]:
        attempts = 0
        with self._progress(batch_size, progress, "traj") as bar:
            while True:
                queued = sum(1 for t in feed.queued if t.scope is None and t.status is None)
                capacity = min(pending_limit - queued, self.queue_size - (len(self._pending) + batch_size))
                for _ in range(min(batch_size, capacity)):
                    item = await feed.next_item()
                    self._check()
                    if item is _END:
                        break
                    task = self._enqueue(
                        item, feed.workflow, task_id=None, is_eval=False, should_accept_fn=feed.should_accept_fn,
                        callback=feed.callback, collector=feed.collector,
                    )
                    feed.queued.append(task)
                    feed.outstanding += 1
                while feed.queued and (feed.queued[0].status is not None or feed.queued[0].scope is not None):
                    feed.queued.popleft()
                while feed.collector.done:
                    task = feed.collector.done.popleft()
                    result = self._take(task)
                    feed.outstanding -= 1
                    attempts += 1
                    if result is not None:
                        kept.append((task, result))
                        if bar is not None:
                            bar.update(1)
                    if (attempts if dynamic_bs else len(kept)) >= batch_size:
                        self._notify()
                        return [r for _, r in kept]
                if feed.exhausted and not feed.outstanding:
                    self._notify()
                    return [r for _, r in kept]
                self._notify()
                await self._park()


_END = object()  # a source read once (cycle=False) has no more items


def _same_source(a: Any, b: Any) -> bool:
    """The same object, or equal plain sequences (``range(8)`` written twice is one source)."""
    return a is b or (type(a) is type(b) and isinstance(a, (range, list, tuple)) and a == b)


class _Feed:
    """``prepare_batch``'s source, cycled forever, and the tasks made from it."""

    def __init__(
        self,
        source: Any,
        workflow_arg: Any,
        workflow: RolloutWorkflow,
        should_accept_fn: AcceptFn | None,
        *,
        cycle: bool,
        callback: Callback | None,
    ) -> None:
        if not isinstance(source, (Iterable, AsyncIterable)):
            raise TypeError(f"prepare_batch: source must be an iterable or async iterable, got {type(source).__name__}")
        self.source = source
        self.workflow_arg = workflow_arg
        self.workflow = workflow
        self.should_accept_fn = should_accept_fn
        self.cycle = cycle
        self.callback = callback
        self.exhausted = False
        self.outstanding = 0  # tasks made from the source and not yet taken
        self.batched = isinstance(getattr(source, "batch_size", None), int)
        self.collector = _Collector()
        self.queued: collections.deque[_Task] = collections.deque()
        self.epoch = 0
        self._it: Any = None
        self._yielded = False
        self._items: collections.deque[Any] = collections.deque()

    async def aclose(self) -> None:
        """Close an unfinished async iterator of the source (its ``finally`` blocks run now)."""
        it, self._it = self._it, None
        close = getattr(it, "aclose", None)
        if close is not None:
            with trio.move_on_after(5) as scope:
                scope.shield = True
                await close()

    async def next_item(self) -> Any:
        while True:
            if self.exhausted:
                return _END
            if self._items:
                return self._items.popleft()
            if self._it is None:
                self._it = aiter(self.source) if isinstance(self.source, AsyncIterable) else iter(self.source)
                self._yielded = False
            try:
                if isinstance(self.source, AsyncIterable):
                    element = await anext(self._it)
                else:
                    element = next(self._it)
                    await trio.lowlevel.checkpoint()
            except (StopIteration, StopAsyncIteration):
                self._it = None
                if not self._yielded:
                    raise ValueError("prepare_batch: the data source yielded nothing in a full pass") from None
                if not self.cycle:
                    self.exhausted = True
                    continue
                self.epoch += 1
                set_epoch = getattr(getattr(self.source, "sampler", None), "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(self.epoch)
                continue
            self._yielded = True
            if self.batched:
                self._items.extend(element)
            else:
                return element


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
        async with trio.open_nursery() as nursery:
            await nursery.start(ex._serve)
            try:
                yield ex
            except BaseException as exc:
                body_error = exc
            finally:
                ex._close()
        if ex._feed is not None:
            await ex._feed.aclose()
    if body_error is not None:
        raise body_error
    if ex._failure is not None and not ex._failure_reported:
        ex._check()

