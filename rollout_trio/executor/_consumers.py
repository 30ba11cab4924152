"""The consumer calls of the executor: the ways a trainer takes results.

Each call takes its results in one synchronous step when it returns (a call cancelled
before that step has taken nothing), waits through :class:`~._liveness.CallWait` (a stall
warning, ``ExecutorStalled``), and never holds up other work: only the common pool's
waiting results count against ``queue_size``.

* ``wait`` / ``wait_for_task``: results of ``submit``;
* ``rollout_batch``: every item once, the batch's own results, in input order;
* ``rollout_stream``: the same for sets too large to hold, outcomes as they finish;
* ``prepare_batch``: the next training batch from a cycled source.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import trio

from ._feed import END, Feed, PrepareFeed, same_source
from ._store import AcceptFn, Callback, Owner, Result, Task
from ._stream import RolloutStream

if TYPE_CHECKING:
    from .._workflow import RolloutWorkflow
    from ._admission import Admission
    from ._config import RolloutConfig
    from ._liveness import StallWatch
    from ._staleness import StalenessManager
    from ._store import TaskStore

__all__ = ["ConsumerCalls"]


class ConsumerCalls:
    """The consumer calls, mixed into :class:`~rollout_trio.executor.RolloutExecutor`."""

    if TYPE_CHECKING:  # provided by the executor
        config: RolloutConfig
        queue_size: int
        _admission: Admission
        _store: TaskStore
        _watch: StallWatch
        _common: Owner
        _feed: PrepareFeed | None
        staleness: StalenessManager

        def _check(self) -> None: ...
        async def _park(self) -> None: ...
        def _notify(self) -> None: ...
        def _sweep_stale(self) -> None: ...
        def _take(self, task: Task) -> Result | None: ...
        def _seed(self) -> int | None: ...
        def get_version(self) -> int: ...
        def _abandon(self, owner: Owner, tasks: list[Task]) -> None: ...
        @staticmethod
        def _check_callables(should_accept_fn: Any, callback: Any) -> None: ...
        def _resolve(
            self, workflow: Any, workflow_kwargs: Mapping[str, Any] | None, group_size: int, options: Mapping[str, Any]
        ) -> RolloutWorkflow: ...
        def _enqueue(
            self, data: Any, workflow: RolloutWorkflow, owner: Owner, *, task_id: int | None = None, is_eval: bool,
            should_accept_fn: AcceptFn | None, callback: Callback | None,
        ) -> Task: ...  # fmt: skip

    def _order_key(self) -> Callable[[Task], int]:
        if self.config.deterministic_sampling:
            return lambda t: t.task_id
        return lambda t: t.seq

    async def wait(self, count: int, timeout: float | None = None, *, raise_timeout: bool = True) -> list[Result]:
        """Wait for ``count`` accepted trajectories of submitted tasks and take them
        (oldest-started first; task-id order with ``deterministic_sampling``).

        Raises:
            ValueError: ``count`` below 1 or above ``queue_size`` (it could never fill).
            TimeoutError: ``timeout`` seconds passed first (``raise_timeout=False``:
                returns ``[]``; nothing is taken).
            ExecutorStalled: ``max_consecutive_rejections`` submitted tasks in a row ended
                without a trajectory while it waited.
            ExecutorFailed: the executor stopped.
        """
        self._check()
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"count must be positive, got {count!r}")
        if count > self.queue_size:
            raise ValueError(f"count must be <= queue_size ({self.queue_size}), got {count}")
        ready: list[Task] = []
        with trio.move_on_after(math.inf if timeout is None else timeout), self._watch.call("wait", self._common, self._park) as w:
            while True:
                self._sweep_stale()
                ready = [t for t in self._common.finished.values() if t.deliverable]
                if len(ready) >= count:
                    break
                await w.park()
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
        store = self._store
        with trio.move_on_after(math.inf if timeout is None else timeout), self._watch.call("wait_for_task", self._common, self._park) as w:
            while True:
                self._sweep_stale()
                task = store.tasks.get(task_id)
                if task is None:
                    if task_id in store.resultless:
                        return None
                    if task_id in store.seen:
                        raise ValueError(f"Task {task_id}: its result was already taken.")
                    raise ValueError(f"Task {task_id} is never submitted.")
                if task.owner is not self._common:
                    raise ValueError(f"Task {task_id} belongs to a rollout_batch or prepare_batch call that will take it")
                if task.status is not None:
                    result = self._take(task)
                    self._notify()
                    return result
                await w.park(check_rejections=False)  # its answer for a failed task is None
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

        Holds at most its own results: a batch of any length finishes (for sets too
        large to hold, :meth:`rollout_stream`). Neither ``queue_size`` nor other calls'
        results hold it up.

        Raises:
            ValueError: a training batch larger than the staleness budget can ever start
                before the next version bump, counting the training tasks queued ahead of
                it (the numbers are named).
            ExecutorStalled: ``max_consecutive_rejections`` of its tasks in a row ended
                without a trajectory (its remaining tasks are cancelled).
        """
        self._check()
        self._check_callables(should_accept_fn, callback)
        wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
        if isinstance(data_list, (list, tuple, range)):
            items = list(data_list)
        else:  # read whole before anything is queued: an iterable that raises queues nothing
            items = await trio.to_thread.run_sync(list, data_list)
            self._check()
        admission = self._admission
        self._sweep_stale()  # a stale result gives its budget back
        if not is_eval and len(items) > admission.budget_for_new():
            raise ValueError(
                f"rollout_batch: {len(items)} training tasks can never all start before the next version bump: "
                f"the staleness budget allows {max(0, admission.budget_for_new())} = "
                f"{admission.budget_text(self.get_version())}; "
                "pass is_eval=True for evaluation, raise max_head_offpolicyness or consumer_batch_size, "
                "or split the batch (rollout_stream waits for version bumps)"
            )
        owner = Owner("batch")
        tasks = [
            self._enqueue(item, wf, owner, is_eval=is_eval, should_accept_fn=should_accept_fn, callback=callback)
            for item in items
        ]
        try:
            with self._progress(len(tasks), progress, "task") as bar, self._watch.call("rollout_batch", owner, self._park) as w:
                while owner.unfinished:
                    if bar is not None:
                        bar.update(len(owner.finished) - bar.n)
                    await w.park()
            self._sweep_stale()
        except BaseException:
            self._abandon(owner, tasks)
            raise
        results = [self._take(t) for t in tasks]  # one synchronous step: the call takes all its results
        self._notify()
        return [r for r in results if r is not None]

    def rollout_stream(
        self,
        data: Iterable[Any] | AsyncIterable[Any],
        workflow: Any,
        workflow_kwargs: Mapping[str, Any] | None = None,
        *,
        group_size: int = 1,
        is_eval: bool = False,
        should_accept_fn: AcceptFn | None = None,
        window: int | None = None,
        **group_options: Any,
    ) -> RolloutStream:
        """Run every item once, handing out each task's :class:`TaskOutcome` as it ends.

        For sets too large to hold: at most ``window`` (default ``queue_size``) of its tasks
        are outstanding (queued, running, or ended and not yet handed out), so memory stays
        bounded whatever the length of ``data`` (a sync or async iterable, read lazily; a
        sync one in a worker thread). Outcomes come in the order the tasks end; each
        carries its item (``data``) and, when accepted, its trajectory (a result dropped
        as stale before it was handed out comes as ``"rejected"``, reason ``"stale"``).
        A training stream waits for version bumps when the budget is spent (the consumer
        may bump between outcomes). Use it as::

            async with ex.rollout_stream(items, workflow) as outcomes:
                async for outcome in outcomes:
                    ...

        Leaving the ``async with`` early cancels its unfinished tasks; its accepted,
        untaken training results then wait for :meth:`wait` (evaluation ones are dropped).

        Args:
            data: the items.
            workflow: anything :func:`rollout_trio.resolve_workflow` accepts.
            workflow_kwargs: keyword arguments for the workflow.
            group_size: slots per group (see :meth:`submit`); ``group_options`` go to the group.
            is_eval: evaluation tasks (not limited by the staleness budget).
            should_accept_fn: ``fn(trajectory) -> bool``; false rejects the trajectory.
            window: the most outstanding tasks (an integer >= 1).

        Returns:
            A :class:`RolloutStream` (an async context manager and async iterator).

        Raises:
            ValueError: ``window`` is not an integer >= 1.
            TypeError: ``data`` is not iterable, or a callable argument is not callable.
        """
        self._check()
        self._check_callables(should_accept_fn, None)
        if window is None:
            window = self.queue_size
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"rollout_stream: window must be an integer >= 1, got {window!r}")
        if not isinstance(data, (Iterable, AsyncIterable)):
            raise TypeError(f"rollout_stream: data must be an iterable or async iterable, got {type(data).__name__}")
        wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
        return RolloutStream(self, data, wf, is_eval=bool(is_eval), should_accept_fn=should_accept_fn, window=window)

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
                next version bump, counting other training tasks queued ahead (the numbers
                are named); a source whose full pass yields nothing.
            ExecutorStalled: ``max_consecutive_rejections`` of the source's tasks in a row
                ended without a trajectory (the results so far wait for the next call).
        """
        self._check()
        if self._feed is None:
            self._check_callables(should_accept_fn, callback)
            wf = self._resolve(workflow, workflow_kwargs, group_size, group_options)
            self._feed = PrepareFeed(Feed(source, cycle=cycle), workflow, wf, should_accept_fn, callback)
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
        admission = self._admission
        in_hand = len(feed.owner.finished) + sum(1 for t in feed.tasks if t in admission.running)
        own_queued = sum(1 for t in feed.tasks if t.status is None and t not in admission.running)
        budget = max(0, admission.budget_left() - (admission.queued_training - own_queued))
        if in_hand + budget < batch_size:
            raise ValueError(
                f"prepare_batch: batch_size {batch_size} can never be filled before the next version bump: "
                f"{in_hand} results are finished or running and the staleness budget allows "
                f"{budget} more = {admission.budget_text(self.get_version())} (other work first); bump the version "
                "(set_version) after each batch, use batch_size <= (max_head_offpolicyness + 1) * consumer_batch_size, "
                "or raise them"
            )
        strict = self.config.deterministic_sampling or self._seed() is not None
        with self._progress(batch_size, progress, "traj") as bar, self._watch.call("prepare_batch", feed.owner, self._park) as w:
            while True:
                self._sweep_stale()  # first: a dropped result makes room for the top-up
                await self._top_up(feed, batch_size)
                self._sweep_stale()  # (an async source's read is a checkpoint)
                chosen = feed.choose(batch_size, dynamic_bs, strict, self._order_key())
                if chosen is not None:
                    break
                if bar is not None:
                    bar.update(min(batch_size, sum(t.deliverable for t in feed.owner.finished.values())) - bar.n)
                await w.park()
        for task in chosen:  # one synchronous step: the batch leaves the store
            feed.tasks.remove(task)
        results = [self._take(t) for t in chosen]
        self._notify()
        return [r for r in results if r is not None]

    async def _top_up(self, feed: PrepareFeed, batch_size: int) -> None:
        """Queue source items while fewer than the pending limit are outstanding (queued,
        running, or accepted and untaken): a trainer that stops asking stops the reading.
        Other work queued (submits waiting for room in the common pool) does not stop it."""
        limit = max(self.staleness.get_pending_limit(), batch_size)
        outstanding = sum(1 for t in feed.tasks if t.status is None or t.deliverable)
        while True:
            if outstanding >= limit or feed.items.exhausted:
                return
            if feed.items.in_memory:  # read at once: the whole top-up is one step
                item = feed.items.next_nowait()
            else:
                item = await feed.items.next_item()
                self._check()
            if item is END:
                return
            task = self._enqueue(
                item, feed.workflow, feed.owner, is_eval=False, should_accept_fn=feed.should_accept_fn,
                callback=feed.callback,
            )  # fmt: skip
            feed.tasks.append(task)
            outstanding += 1
