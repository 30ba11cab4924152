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
import heapq
import logging
import math
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .. import workflow_context
from .._errors import RewardValueError, RolloutError, WorkflowContractError
from .._group import GroupedRolloutWorkflow
from .._interaction import Interaction, interactions_to_trajectory
from .._stats import StatsRecorder
from .._check import check_trajectory_format
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow, resolve_workflow
from ._config import RolloutConfig
from ._feed import END, Feed, same_source
from ._observer import ExecutorObserver, bind, emit, oldest_version
from ._staleness import StalenessManager
from ._store import IdSet, Owner, Status, Task
from ._store import Result as Result  # the facade imports it from here

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["ExecutorFailed", "ExecutorStatistics", "RolloutExecutor", "TaskOutcome", "open_executor"]

logger = logging.getLogger("rollout_trio.executor")

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
    for the call that owns them; ``stale`` those dropped for exceeding the staleness
    bound before any call took them; ``discarded`` evaluation results of cancelled
    ``rollout_batch`` calls. ``capacity`` is the staleness manager's;
    ``oldest_buffered_version`` is the oldest token version of any buffered result
    (its start version when it has none; None when nothing is buffered).
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
    stale: int = 0
    discarded: int = 0

    def balanced(self) -> bool:
        """Whether every submitted task is accounted for exactly once."""
        return self.submitted == (
            self.accepted + self.rejected + self.failed + self.cancelled + self.stale + self.discarded
            + self.queued + self.running + self.buffered
        )


def _current_seed() -> int | None:
    """The caller's :func:`workflow_context.use_seed` (None outside one)."""
    return workflow_context._seed.get()


def _split_errors(exc: BaseException) -> tuple[BaseException | None, BaseException | None]:
    """(the contract errors in ``exc`` that stop the executor, the bad reward values in it)."""
    if isinstance(exc, RewardValueError):
        return None, exc
    if isinstance(exc, WorkflowContractError):
        return exc, None
    if isinstance(exc, BaseExceptionGroup):
        contract, _ = exc.split(WorkflowContractError)
        if contract is None:
            return None, None
        reward, rest = contract.split(RewardValueError)
        return rest, reward
    return None, None


class _TrainerVersion:
    """The version the executor judges budget and staleness by: the engine's, or the higher
    one the trainer announced with :meth:`RolloutExecutor.set_version`."""

    __slots__ = ("announced", "engine")

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.announced = 0

    def get_version(self) -> int:
        return max(self.engine.get_version(), self.announced)


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
        self._pending: collections.deque[Task] = collections.deque()  # training tasks waiting to start
        self._pending_eval: collections.deque[Task] = collections.deque()
        self._running: set[Task] = set()
        self._tasks: dict[int, Task] = {}  # queued, running, or finished and untaken
        self._held: dict[int, Task] = {}  # the deliverable ones among them (buffered)
        self._common = Owner("common")
        self._seen = IdSet()  # every id ever submitted
        self._resultless = IdSet()  # ended without a result for anyone (wait_for_task returns None)
        self._order = 0
        self._next_id = 0
        self._seq = 0
        self._submitted = 0
        self._accepted = 0
        self._buffered = 0
        # Of those, the ones in the common pool (submit's, for wait()): only they count
        # against queue_size. A call's own results (a rollout_batch's, prepare_batch's
        # leftovers) never stop that call or other work from starting (issue 27).
        self._pool_buffered = 0
        self._cancelled = 0
        self._stale = 0
        self._discarded = 0
        self._rejected: collections.Counter[str] = collections.Counter()
        self._failed: collections.Counter[str] = collections.Counter()
        self._paused = False
        self._closed = False
        self._failure: BaseException | None = None
        self._failure_reported = False
        self._tracked_keys: set[str] | None = None
        self._feed: _PrepareFeed | None = None

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
        oldest = min((t.version for t in self._held.values()), default=None)
        return ExecutorStatistics(
            submitted=self._submitted,
            queued=len(self._pending) + len(self._pending_eval),
            running=len(self._running),
            buffered=self._buffered,
            accepted=self._accepted,
            rejected=sum(self._rejected.values()),
            rejected_by_reason=dict(self._rejected),
            failed=sum(self._failed.values()),
            failed_by_reason=dict(self._failed),
            cancelled=self._cancelled,
            stale=self._stale,
            discarded=self._discarded,
            version=self.get_version(),
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
        self._seen.add(tid)
        self._resultless.discard(tid)
        self._order += 1
        task = Task(
            tid, data, workflow, should_accept_fn, bool(is_eval), callback, owner, self._order,
            seed=self._seed(),
        )  # fmt: skip
        self._tasks[tid] = task
        owner.unfinished += 1
        if task.is_eval:
            self._pending_eval.append(task)
        else:
            self._pending.append(task)
            self.staleness.on_rollout_enqueued()
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
        task = self._tasks.get(task_id)
        if task is None or task.status is not None:
            return False
        if task in self._running:
            task.cancel_requested = True
            assert task.scope is not None
            task.scope.cancel()
            return True
        self._unqueue(task)
        self._conclude(task, "cancelled", "cancelled", None)
        return True

    def _unqueue(self, task: Task) -> None:
        if task.is_eval:
            self._pending_eval.remove(task)
        else:
            self._pending.remove(task)
            self.staleness.on_rollout_dequeued()

    # -- pause, versions ------------------------------------------------------------------

    async def pause(self) -> None:
        """Start nothing new and interrupt in-flight generation (the engine's pause).

        Submissions are still queued and finished results still delivered. Pause and
        :meth:`resume` run one at a time, so a resume never overtakes a pause still
        reaching the servers.
        """
        self._check()
        async with self._control:
            self._paused = True  # before the engine: nothing new starts while it pauses
            await self.engine.pause()
        self._notify()

    async def resume(self) -> None:
        """Undo :meth:`pause` (after any pause still in progress has finished)."""
        self._check()
        async with self._control:
            await self.engine.resume()
            self._paused = False
        self._notify()

    def set_version(self, version: int) -> None:
        """Tell the executor (and a client-versioned engine) the trainer's version.

        The executor's budget and staleness bound use it at once. Engines whose servers
        own their version (``RemoteEngine``: only ``update_weights`` changes a server)
        keep their own: a version announced before the servers have it fails no task.
        """
        self._check()
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version: must be an int, got {version!r}")
        self._version.announced = version
        if not getattr(self.engine, "servers_own_version", False):
            self.engine.set_version(version)
        self._notify()

    def on_version_recovered(self, version: int) -> None:
        """After a checkpoint resume at ``version``: no burst of ``version`` batches of budget."""
        self._check()
        self.staleness.on_version_recovered(version)
        self._notify()

    # -- the dispatcher and the tasks -------------------------------------------------------

    def _room(self) -> bool:
        return (
            not self._paused
            and len(self._running) < max(1, self.staleness.max_concurrent_rollouts)
            and len(self._running) + self._pool_buffered < self.queue_size
        )

    async def _serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._failure is not None:
                nursery.cancel_scope.cancel()
            nursery.start_soon(self._dispatch)
            task_status.started()

    def _start(self, task: Task) -> None:
        assert self._nursery is not None
        self._running.add(task)
        if not task.is_eval:
            self.staleness.on_rollout_submitted()
        self._seq += 1
        task.seq = self._seq
        task.scope = trio.CancelScope()
        self._nursery.start_soon(self._run, task)

    async def _dispatch(self) -> None:
        poll = self.config.version_poll_interval
        while True:
            started = False
            while self._pending_eval and self._room():  # eval: not limited by the staleness budget
                self._start(self._pending_eval.popleft())
                started = True
            while self._pending and self._room() and self.staleness.get_capacity() > 0:
                self._start(self._pending.popleft())
                started = True
            if started:
                self._notify()
            if self._pending and self._room():
                # Starved of budget: only a version bump opens it, and the trainer may bump
                # the engine directly. Stale results may also be waiting to be swept.
                with trio.move_on_after(poll):
                    await self._lot.park()
                self._sweep_stale()
            else:
                await self._lot.park()

    async def _run(self, task: Task) -> None:
        scope = task.scope
        assert scope is not None
        task.start_time = trio.current_time()
        task.start_version = self.get_version()
        if self._observers:
            emit(self._on_started, "task_started", task.task_id, version=task.start_version, time=task.start_time)
        if self.config.episode_timeout is not None:
            scope.deadline = task.start_time + self.config.episode_timeout
        outcome: tuple[Status, str | None, Result | None] | None = None
        try:
            try:
                with scope:
                    outcome = await self._episode(task)
            except Exception as exc:  # what is left of a group once the scope took its Cancelled leaves
                outcome = self._on_error(task, exc)
            if outcome is None and scope.cancelled_caught and not task.cancel_requested and self._failure is None:
                # Only a task that ended with nothing else to say timed out: a workflow
                # error raised as the deadline passed keeps its own reason.
                outcome = ("failed", "timeout", None)
                logger.warning("Task %d ran past its episode_timeout of %s s.", task.task_id, self.config.episode_timeout)
        except BaseExceptionGroup as group:
            # Outer cancellation mixed with real errors: record the errors, let the Cancelled through.
            cancelled, rest = group.split(trio.Cancelled)
            if rest is not None:
                outcome = self._on_error(task, rest)
            if cancelled is not None:
                raise cancelled from None
        finally:
            self._running.discard(task)
            status, reason, result = outcome if outcome is not None else ("cancelled", "cancelled", None)
            if not task.is_eval:
                if status == "accepted":
                    self.staleness.on_rollout_accepted()
                else:
                    self.staleness.on_rollout_rejected()
            self._conclude(task, status, reason, result)

    def _on_error(self, task: Task, exc: BaseException) -> tuple[Status, str | None, Result | None]:
        contract, reward = _split_errors(exc)
        if contract is not None:
            self._fail(contract)
            return ("failed", "contract_error", None)
        if reward is not None:
            logger.warning("Task %d: rejected for a bad reward value: %s", task.task_id, reward)
            return ("rejected", "invalid_reward", None)
        if self.config.on_workflow_error == "raise":
            self._fail(exc)
        logger.error("Task %d: workflow failed; the task is counted as failed.", task.task_id, exc_info=exc)
        return ("failed", "workflow_exception", None)

    async def _episode(self, task: Task) -> tuple[Status, str | None, Result | None]:
        ctx = workflow_context.WorkflowContext(is_eval=task.is_eval, task_id=task.task_id)
        try:
            with (
                workflow_context.use(ctx),
                workflow_context.use_stats_recorder(self.stats),
                workflow_context.use_seed(task.seed) if task.seed is not None else nullcontext(),
            ):
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

    def _convert(self, task: Task, raw: Any) -> tuple[Result | None, str | None]:
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

    def _conclude(self, task: Task, status: Status, reason: str | None, result: Result | None) -> None:
        """Move a finished task to its owner (no checkpoint in here: the invariant holds throughout)."""
        task.status, task.reason = status, reason
        owner = task.owner
        owner.unfinished -= 1
        if status == "accepted":
            task.result = result
            oldest = oldest_version(result)
            task.version = task.start_version if oldest is None else oldest
            self._buffered += 1
            self._held[task.task_id] = task
            if owner is self._common:
                self._pool_buffered += 1
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
        task.data = None
        if owner.abandoned:
            self._hand_on(task)
        elif owner is self._common and status != "accepted":
            self._forget(task)  # nobody takes a result-less common task: wait_for_task answers None
        else:
            owner.finished[task.task_id] = task
        self._notify()

    def _forget(self, task: Task) -> None:
        """``task`` leaves the executor without a result."""
        self._tasks.pop(task.task_id, None)
        self._resultless.add(task.task_id)
        task.owner.finished.pop(task.task_id, None)

    def _drop(self, task: Task, why: str) -> None:
        """Withdraw an accepted, untaken result (``"stale"`` or ``"abandoned"``)."""
        task.dropped = why
        task.result = None
        self._buffered -= 1
        if task.owner is self._common:
            self._pool_buffered -= 1
        del self._held[task.task_id]
        if why == "stale":
            self._stale += 1
            self.staleness.on_rollout_discarded()
        else:
            self._discarded += 1

    def _sweep_stale(self) -> None:
        """Drop every untaken training result more than ``max_head_offpolicyness`` versions
        behind the current version. Every take calls it first, with no checkpoint between."""
        floor = self.get_version() - self.config.max_head_offpolicyness
        for task in [t for t in self._held.values() if not t.is_eval and t.version < floor]:
            self._drop(task, "stale")
            logger.info("Task %d: dropped, its oldest token (version %d) is older than %d.", task.task_id, task.version, floor)
            if task.owner is self._common:
                self._forget(task)

    def _take(self, task: Task) -> Result | None:
        """Hand ``task``'s result to the caller: it leaves the executor (no checkpoint)."""
        self._tasks.pop(task.task_id, None)
        task.owner.finished.pop(task.task_id, None)
        if not task.deliverable:
            self._resultless.add(task.task_id)
            return None
        self._buffered -= 1
        if task.owner is self._common:
            self._pool_buffered -= 1
        del self._held[task.task_id]
        self._accepted += 1
        result, task.result = task.result, None
        if self._observers:
            version = self.get_version()
            lag = max(0, version - task.version)
            now = trio.current_time()
            emit(self._on_consumed, "task_consumed", task.task_id, version=version, lag=lag, time=now)
        return result

    def _hand_on(self, task: Task) -> None:
        """A finished task of an abandoned batch call: training results go to the common pool
        (for ``wait``), evaluation results are dropped (they are never training data)."""
        task.owner.finished.pop(task.task_id, None)
        if task.deliverable and task.is_eval:
            self._drop(task, "abandoned")  # still the batch's: it never counted in the pool
        task.owner = self._common
        if not task.deliverable:
            self._forget(task)
        else:
            self._pool_buffered += 1  # from now on it waits for wait(), like a submit's
            self._common.finished[task.task_id] = task

    def _abandon(self, owner: Owner, tasks: list[Task]) -> None:
        """A rollout_batch call ended early (cancelled, or the executor stopped): its unfinished
        tasks are cancelled, its finished ones handed on. Nothing was taken, so nothing is undone."""
        owner.abandoned = True
        for task in list(owner.finished.values()):
            self._hand_on(task)
        if self._failure is None and not self._closed:
            for task in tasks:
                self._cancel(task.task_id)  # a queued one concludes (and is handed on) at once
        self._notify()

    def _close(self) -> None:
        """Cancel everything (queued tasks count as cancelled; running ones as they unwind)."""
        if self._closed:
            return
        self._closed = True
        for queue in (self._pending, self._pending_eval):
            while queue:
                task = queue[0]
                self._unqueue(task)
                self._conclude(task, "cancelled", "closed", None)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        self._notify()

    # -- consuming -------------------------------------------------------------------------

    def _order_key(self) -> Callable[[Task], int]:
        if self.config.deterministic_sampling:
            return lambda t: t.task_id
        return lambda t: t.seq

    def _budget_left(self) -> int:
        return self.staleness.get_capacity(include_concurrency=False)

    def _budget_text(self) -> str:
        st = self.staleness.get_stats()
        return (
            f"(max_head_offpolicyness {self.staleness.max_staleness} + version {self.get_version()} + 1) "
            f"* consumer_batch_size {self.staleness.consumer_batch_size} - accepted {st.accepted} - running {st.running}"
        )

    async def wait(self, count: int, timeout: float | None = None, *, raise_timeout: bool = True) -> list[Result]:
        """Wait for ``count`` accepted trajectories of submitted tasks and take them
        (oldest-started first; task-id order with ``deterministic_sampling``).

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
        ready: list[Task] = []
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                self._sweep_stale()
                ready = [t for t in self._common.finished.values() if t.deliverable]
                if len(ready) >= count:
                    break
                await self._park()
        if len(ready) < count:  # timed out: nothing taken
            if raise_timeout:
                raise TimeoutError(f"Timed out waiting for {count} results, only received {len(ready)}")
            return []
        out = [self._take(t) for t in heapq.nsmallest(count, ready, key=self._order_key())]
        self._notify()
        return [r for r in out if r is not None]

    async def wait_for_task(
        self, task_id: int, timeout: float | None = None, *, raise_timeout: bool = True
    ) -> Result | None:
        """Wait for one submitted task and take its result (None when it was rejected,
        failed, cancelled or dropped as stale).

        Raises:
            ValueError: the id was never submitted, its result was already taken, or it
                belongs to a ``rollout_batch`` / ``prepare_batch`` call.
            TimeoutError: ``timeout`` passed (``raise_timeout=False``: returns None).
        """
        self._check()
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                self._sweep_stale()
                task = self._tasks.get(task_id)
                if task is None:
                    if task_id in self._resultless:
                        return None
                    if task_id in self._seen:
                        raise ValueError(f"Task {task_id}: its result was already taken.")
                    raise ValueError(f"Task {task_id} is never submitted.")
                if task.owner is not self._common:
                    raise ValueError(f"Task {task_id} belongs to a rollout_batch or prepare_batch call that will take it")
                if task.status is not None:
                    result = self._take(task)
                    self._notify()
                    return result
                await self._park()
        if raise_timeout:
            raise TimeoutError(f"Timed out waiting for task {task_id}.")
        return None

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
        Evaluation batches (``is_eval=True``) are not limited by the staleness budget.
        Cancelled part-way, its unfinished tasks are cancelled and its accepted training
        trajectories wait for :meth:`wait`; evaluation ones are dropped (``discarded``).

        Raises:
            ValueError: a training batch larger than the staleness budget can ever start
                before the next version bump (the numbers are named).
        """
        self._check()
        self._check_callables(should_accept_fn, callback)
        wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
        if isinstance(data_list, (list, tuple, range)):
            items = list(data_list)
        else:  # read whole before anything is queued: an iterable that raises queues nothing
            items = await trio.to_thread.run_sync(list, data_list)
            self._check()
        if not is_eval and len(items) > self._budget_left():
            raise ValueError(
                f"rollout_batch: {len(items)} training tasks can never all start before the next version bump: "
                f"the staleness budget allows {self._budget_left()} = {self._budget_text()}; "
                "pass is_eval=True for evaluation, raise max_head_offpolicyness or consumer_batch_size, "
                "or split the batch"
            )
        owner = Owner("batch")
        tasks = [
            self._enqueue(item, wf, owner, is_eval=is_eval, should_accept_fn=should_accept_fn, callback=callback)
            for item in items
        ]
        try:
            with self._progress(len(tasks), progress, "task") as bar:
                while owner.unfinished:
                    if bar is not None:
                        bar.update(len(owner.finished) - bar.n)
                    await self._park()
            self._sweep_stale()
        except BaseException:
            self._abandon(owner, tasks)
            raise
        results = [self._take(t) for t in tasks]  # one synchronous step: the call takes all its results
        self._notify()
        return [r for r in results if r is not None]

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
        attribute says each element is a batch) is cycled forever; a sync source is read in
        a worker thread. At most ``(max_head_offpolicyness + 1) * consumer_batch_size`` (or
        ``batch_size`` if larger) of its items are outstanding: queued, running, or
        accepted and untaken. Returns ``batch_size`` accepted trajectories, or with
        ``dynamic_bs`` the accepted ones among the next ``batch_size`` finished tasks. With
        ``cycle=False`` the source is read once: when it is used up and its tasks are all
        taken, the batch is returned as it is (possibly short, possibly empty). ``callback``
        gets every task's :class:`TaskOutcome` (the first call's ``should_accept_fn``,
        ``cycle`` and ``callback`` stay in force). Results a call does not take wait for the
        next ``prepare_batch`` (``wait`` does not take them).

        Order: results go out oldest-started first. Under ``use_seed`` (or the config's
        ``seed``) or with ``deterministic_sampling`` they go out in the source's order
        instead, waiting for the oldest unfinished task: every run then gets the same
        batches, whatever the scheduling, at the cost of that wait.

        Raises:
            ValueError: another source or workflow than the first call's; a batch larger
                than ``queue_size``; a batch the staleness budget can never fill before the
                next version bump (the numbers are named); a source whose full pass yields
                nothing.
        """
        self._check()
        if self._feed is None:
            self._check_callables(should_accept_fn, callback)
            wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
            self._feed = _PrepareFeed(Feed(source, cycle=cycle), workflow, wf, should_accept_fn, callback)
        elif not same_source(self._feed.items.source, source) or self._feed.workflow_arg is not workflow:
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
        self._sweep_stale()
        in_hand = len(feed.owner.finished) + sum(1 for t in feed.tasks if t in self._running)
        if in_hand + self._budget_left() < batch_size:
            raise ValueError(
                f"prepare_batch: batch_size {batch_size} can never be filled before the next version bump: "
                f"{in_hand} results are finished or running and the staleness budget allows "
                f"{max(0, self._budget_left())} more = {self._budget_text()}; bump the version (set_version) after "
                "each batch, use batch_size <= (max_head_offpolicyness + 1) * consumer_batch_size, or raise them"
            )
        strict = self.config.deterministic_sampling or self._seed() is not None
        with self._progress(batch_size, progress, "traj") as bar:
            while True:
                await self._top_up(feed, batch_size)
                self._sweep_stale()
                chosen = feed.choose(batch_size, dynamic_bs, strict, self._order_key())
                if chosen is not None:
                    break
                if bar is not None:
                    bar.update(min(batch_size, sum(t.deliverable for t in feed.owner.finished.values())) - bar.n)
                await self._park()
        for task in chosen:  # one synchronous step: the batch leaves the store
            feed.tasks.remove(task)
        results = [self._take(t) for t in chosen]
        self._notify()
        return [r for r in results if r is not None]

    async def _top_up(self, feed: _PrepareFeed, batch_size: int) -> None:
        """Queue source items while fewer than the pending limit are outstanding (queued,
        running, or accepted and untaken): a trainer that stops asking stops the reading."""
        limit = self.staleness.get_pending_limit()
        while True:
            outstanding = sum(1 for t in feed.tasks if t.status is None or t.deliverable)
            queued = len(self._pending) + len(self._pending_eval)
            if outstanding >= max(limit, batch_size) or queued + batch_size >= self.queue_size or feed.items.exhausted:
                return
            item = await feed.items.next_item()
            self._check()
            if item is END:
                return
            task = self._enqueue(
                item, feed.workflow, feed.owner, is_eval=False, should_accept_fn=feed.should_accept_fn,
                callback=feed.callback,
            )  # fmt: skip
            feed.tasks.append(task)


class _PrepareFeed:
    """``prepare_batch``'s source, workflow and the untaken tasks made from it (submission order)."""

    def __init__(
        self, items: Feed, workflow_arg: Any, workflow: RolloutWorkflow, should_accept_fn: AcceptFn | None,
        callback: Callback | None,
    ) -> None:  # fmt: skip
        self.items = items
        self.workflow_arg = workflow_arg
        self.workflow = workflow
        self.should_accept_fn = should_accept_fn
        self.callback = callback
        self.owner = Owner("feed")
        self.tasks: list[Task] = []

    def choose(self, batch_size: int, dynamic_bs: bool, strict: bool, key: Callable[[Task], int]) -> list[Task] | None:
        """The tasks the next batch takes (accepted and result-less alike), or None if not ready."""
        if strict:
            candidates = self.tasks  # submission order; stop at the oldest unfinished task
        else:
            candidates = sorted(self.owner.finished.values(), key=key)
        chosen: list[Task] = []
        kept = 0
        for task in candidates:
            if task.status is None:
                break
            chosen.append(task)
            kept += task.deliverable
            if (len(chosen) if dynamic_bs else kept) >= batch_size:
                return chosen
        if self.items.exhausted and not self.owner.unfinished:
            return list(self.tasks)  # a read-once source is used up: what is left
        return None
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
            await ex._feed.items.aclose()
    if body_error is not None:
        raise body_error
    if ex._failure is not None and not ex._failure_reported:
        ex._check()

