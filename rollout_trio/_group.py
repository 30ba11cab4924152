"""Grouped rollouts: G slots of one prompt in one nursery, then classify, merge and normalize.

The slots of a group live and die together. A slot that raises cancels its siblings
(and, through the engines' cancellation contract, their server-side generations); the
group then raises a :class:`GroupRolloutError`: a strict ``ExceptionGroup`` of what the
slots raised, each noted with its slot index, carrying the group size and failing slots. A slot that *returns* ``None`` (or ``{}``) is a rejected rollout, not a failure.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from . import workflow_context
from ._assemble import (
    GroupPolicy,
    GroupResult,
    GroupStatistics,
    assemble_group,
    last_interaction_rewards,
    token_positions,
)
from ._errors import GroupRolloutError, exception_leaves
from ._processor_cache import ProcessorCache
from ._stats import StatsRecorder
from ._workflow import FunctionWorkflow, RolloutWorkflow, resolve_workflow

if TYPE_CHECKING:
    from .engines import InferenceEngine

__all__ = ["GroupStatistics", "GroupedRolloutWorkflow", "run_group"]

logger = logging.getLogger("rollout_trio.group")

FinalizeHook = Callable[[workflow_context.WorkflowContext], Awaitable[None]]

#: Groups holding more token positions than this are assembled in a worker thread:
#: bench/group_stall_bench.py measured ~10 ms of scheduler stall for 16 x 32k tokens,
#: while the thread hop costs ~0.1 ms, which small groups should not pay.
INLINE_ASSEMBLY_POSITIONS = 1 << 16
_ASSEMBLY_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("rollout_trio.assembly_limiter")


def assembly_limiter() -> trio.CapacityLimiter:
    """The limiter bounding the worker threads that assemble large groups (2 per Trio run)."""
    try:
        return _ASSEMBLY_LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(2)
        _ASSEMBLY_LIMITER.set(limiter)
        return limiter


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Runs ``group_size`` slots of ``workflow`` on the same data, concurrently, as one group.

    Args:
        workflow: anything :func:`rollout_trio.resolve_workflow` accepts.
        group_size: slots per group (G >= 1).
        min_usable_group_size: the fewest usable slots a kept group has. Defaults to
            2 when ``reward_normalization`` is on, else 1.
        drop_incomplete_group: drop the group when any slot is unusable.
        reward_normalization: normalize rewards across the usable rollouts of the
            group (interactions and tensor rows alike), keeping the originals.
        reward_normalization_use_std: divide by the group's std (else centre only).
        workflow_kwargs: passed to ``resolve_workflow`` with ``workflow``.
        finalize_hook: ``async def hook(group_context)`` run once after every slot
            has ended; defaults to the workflow's ``_afinalize_processor_cache_group``.
        finalize_timeout: seconds the finalization may take before it is abandoned.
        stats: where group statistics go (default: ``workflow_context.stats_recorder()``).

    Raises:
        ValueError: an invalid size, or reward normalization with ``group_size == 1``.

    ``arun_episode`` raises :class:`GroupRolloutError` when slots fail, and
    :class:`WorkflowContractError` when a result breaks the contract.
    """

    def __init__(
        self,
        workflow: Any,
        group_size: int,
        *,
        min_usable_group_size: int | None = None,
        drop_incomplete_group: bool = False,
        reward_normalization: bool = False,
        reward_normalization_use_std: bool = True,
        workflow_kwargs: Mapping[str, Any] | None = None,
        finalize_hook: FinalizeHook | None = None,
        finalize_timeout: float = 10.0,
        stats: StatsRecorder | None = None,
    ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size!r}")
        if reward_normalization and group_size == 1:
            raise ValueError(
                "reward_normalization needs group_size > 1: normalizing a single rollout erases its reward"
            )
        if min_usable_group_size is None:
            min_usable_group_size = 2 if reward_normalization else 1
        elif (
            isinstance(min_usable_group_size, bool)
            or not isinstance(min_usable_group_size, int)
            or not 1 <= min_usable_group_size <= group_size
        ):
            raise ValueError(
                f"min_usable_group_size must be between 1 and group_size ({group_size}), got {min_usable_group_size!r}"
            )
        elif reward_normalization and min_usable_group_size < 2:
            raise ValueError(
                "min_usable_group_size must be at least 2 when reward_normalization is on "
                f"(group statistics need two rollouts), got {min_usable_group_size}"
            )
        if not finalize_timeout > 0:
            raise ValueError(f"finalize_timeout must be > 0 seconds, got {finalize_timeout!r}")
        self.workflow = resolve_workflow(workflow, workflow_kwargs)
        # A plain function is awaited directly: each adapter frame is resumed at every
        # checkpoint of every slot.
        wf = self.workflow
        self._episode: Callable[[InferenceEngine, Any], Awaitable[Any]] = (
            functools.partial(wf.fn, **wf.kwargs) if wf.kwargs else wf.fn
        ) if type(wf) is FunctionWorkflow else wf.arun_episode
        self.policy = GroupPolicy(
            group_size, min_usable_group_size, drop_incomplete_group, reward_normalization, reward_normalization_use_std
        )
        self.finalize_hook = finalize_hook or getattr(self.workflow, "_afinalize_processor_cache_group", None)
        self.finalize_timeout = finalize_timeout
        self.stats = stats

    @property
    def group_size(self) -> int:
        """Slots per group."""
        return self.policy.group_size

    @property
    def min_usable_group_size(self) -> int:
        """The fewest usable slots a kept group has."""
        return self.policy.min_usable_group_size

    @property
    def drop_incomplete_group(self) -> bool:
        """Whether a group with an unusable slot is dropped."""
        return self.policy.drop_incomplete_group

    @property
    def reward_normalization(self) -> bool:
        """Whether rewards are normalized across the group's usable rollouts."""
        return self.policy.reward_normalization

    @property
    def reward_normalization_use_std(self) -> bool:
        """Whether normalization divides by the group's std (else it only centres)."""
        return self.policy.reward_normalization_use_std

    def __repr__(self) -> str:
        return f"GroupedRolloutWorkflow({self.workflow!r}, group_size={self.group_size})"

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> GroupResult:
        """Run the group; return the merged usable results, or None when the group is dropped."""
        g = self.group_size
        parent = workflow_context.get()
        cache = ProcessorCache()
        group_ctx = parent.evolve(group_size=g, processor_cache=cache, sample_idx=None)
        results: list[Any] = [None] * g
        failed_in: dict[int, int] = {}  # id(leaf exception) -> the slot that raised it
        try:
            async with trio.open_nursery() as nursery:
                for i in range(g):
                    nursery.start_soon(self._run_slot, engine, data, group_ctx, i, results, failed_in)
        except BaseException as exc:
            await self._finalize(group_ctx, cache)
            if isinstance(exc, Exception):
                self._metrics_hook(data, results)
            # Trio may re-derive a slot's own exception group (to split out Cancelled),
            # so a slot is recognised by the leaves it raised.
            slot_of = [failed_in.get(id(exception_leaves(e)[0])) for e in getattr(exc, "exceptions", ())]
            if isinstance(exc, ExceptionGroup) and None not in slot_of:
                slots = [s for s in slot_of if s is not None]
                raise GroupRolloutError(
                    f"{len(slots)} of {g} slots failed (slots {sorted(slots)})",
                    exc.exceptions, group_size=g, slots=slots,
                ).with_traceback(exc.__traceback__) from None
            raise
        await self._finalize(group_ctx, cache)
        self._metrics_hook(data, results)
        if token_positions(results) > INLINE_ASSEMBLY_POSITIONS:
            out, stats = await trio.to_thread.run_sync(assemble_group, results, self.policy, limiter=assembly_limiter())
        else:
            out, stats = assemble_group(results, self.policy)
        self._record(stats)
        return out

    async def _run_slot(
        self,
        engine: InferenceEngine,
        data: Any,
        group_ctx: workflow_context.WorkflowContext,
        i: int,
        results: list[Any],
        failed_in: dict[int, int],
    ) -> None:
        workflow_context.set(
            workflow_context.WorkflowContext(
                is_eval=group_ctx.is_eval,
                task_id=group_ctx.task_id,
                sample_idx=i,
                group_size=group_ctx.group_size,
                processor_cache=group_ctx.processor_cache,
            )
        )
        try:
            results[i] = await self._episode(engine, data)
        except Exception as exc:
            exc.add_note(f"rollout_trio: raised in slot {i} of a group of {self.group_size}")
            failed_in.update(dict.fromkeys(map(id, exception_leaves(exc)), i))
            raise

    async def _finalize(self, group_ctx: workflow_context.WorkflowContext, cache: ProcessorCache) -> None:
        if self.finalize_hook is None:
            cache.closed = True
            return
        # Shielded so it runs even when the group is being cancelled, bounded so it never hangs.
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.finalize_timeout
            try:
                await self.finalize_hook(group_ctx)
            except Exception as exc:
                logger.warning("Failed to finalize rollout group resources (%s: %s).", type(exc).__name__, exc)
            finally:
                cache.closed = True
        if scope.cancelled_caught:
            logger.warning("Finalizing rollout group resources timed out after %.1f s.", self.finalize_timeout)

    def _metrics_hook(self, data: Any, results: list[Any]) -> None:
        hook = getattr(self.workflow, "record_group_metrics", None)
        if not callable(hook):
            return
        rewards = last_interaction_rewards(results)
        if rewards is not None:
            hook(data, rewards, self.group_size)

    def _record(self, stats: GroupStatistics) -> None:
        recorder = self.stats if self.stats is not None else workflow_context.stats_recorder()
        recorder.record(workflow_context.stat_scope(), stats.as_dict())


async def run_group(
    workflow: Any,
    engine: InferenceEngine,
    data: Any,
    group_size: int,
    **options: Any,
) -> GroupResult:
    """Run one group of ``workflow`` on ``data``.

    Args:
        workflow: anything :func:`resolve_workflow` accepts.
        engine: the inference engine the slots call (already open).
        data: the dataset item every slot gets.
        group_size: slots in the group (G >= 1).
        **options: :class:`GroupedRolloutWorkflow`'s keyword arguments
            (``reward_normalization``, ``min_usable_group_size``, ...).

    Returns:
        The group's :class:`GroupResult` (its trajectory, or None when the group was
        dropped, with the slots' outcomes).

    Raises:
        ValueError: an invalid ``group_size`` or option.
        GroupRolloutError: slots raised (the others were cancelled).
        WorkflowContractError: a slot's result breaks the contract.
    """
    return await GroupedRolloutWorkflow(workflow, group_size, **options).arun_episode(engine, data)
