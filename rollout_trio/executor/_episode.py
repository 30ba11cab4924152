"""Running one task's episode: its workflow in a cancel scope, its result converted and checked.

How an episode ends decides what the executor does: a result is accepted (or rejected by
``should_accept_fn``); ``None`` or ``{}`` rejects it; a workflow exception fails it (or
stops the executor with ``on_workflow_error="raise"``); a bad reward value rejects it
(``invalid_reward``); a broken contract of the executor's own (a result of the wrong type,
keys that change under ``check_trajectory_format``) stops the executor.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import trio

from .. import workflow_context
from .._check import check_trajectory_format
from .._errors import RewardValueError, WorkflowContractError
from .._interaction import Interaction, interactions_to_trajectory
from .._trajectory import Trajectory
from ._observer import emit
from ._store import Result, Status, Task

if TYPE_CHECKING:
    from ._admission import Admission
    from ._config import RolloutConfig

__all__ = ["EpisodeRunner"]

logger = logging.getLogger("rollout_trio.executor")


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


class EpisodeRunner:
    """Runs a started task to its end, mixed into the executor."""

    if TYPE_CHECKING:  # provided by the executor
        engine: Any
        config: RolloutConfig
        stats: Any
        _admission: Admission
        _observers: tuple[Any, ...]
        _on_started: Any
        _dumper: Any
        _failure: BaseException | None
        _tracked_keys: set[str] | None

        def get_version(self) -> int: ...
        def _fail(self, exc: BaseException) -> None: ...
        def _conclude(self, task: Task, status: Status, reason: str | None, result: Result | None) -> None: ...

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
            status, reason, result = outcome if outcome is not None else ("cancelled", "cancelled", None)
            self._admission.ended(task, status == "accepted")
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
