"""Grouped rollouts: G slots of one prompt in one nursery, then classify, merge and normalize.

The slots of a group live and die together. A slot that raises cancels its siblings
(and, through the engines' cancellation contract, their server-side generations); the
group then raises a strict ``ExceptionGroup`` whose leaves carry their slot index as a
note. A slot that *returns* ``None`` (or ``{}``) is a rejected rollout, not a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import torch
import trio

from . import workflow_context
from ._errors import WorkflowContractError
from ._interaction import Interaction
from ._normalize import rollout_time_affine, rollout_time_apply
from ._padding import join_slots
from ._processor_cache import ProcessorCache
from ._rollout_group import RolloutGroup, as_reward_scalar
from ._stats import StatsRecorder
from ._trajectory import Trajectory
from ._workflow import RolloutWorkflow, resolve_workflow
from .engines import InferenceEngine

__all__ = ["GroupStatistics", "GroupedRolloutWorkflow", "run_group"]

logger = logging.getLogger("rollout_trio.group")

FinalizeHook = Callable[[workflow_context.WorkflowContext], Awaitable[None]]
GroupResult = Trajectory | dict[str, Interaction] | None


@attrs.frozen
class GroupStatistics:
    """What one group run yielded, counted in slots (logical rollouts), before any filter."""

    target_slot_count: int
    usable_slot_count: int
    trainable_slot_count: int

    @property
    def fully_masked_group(self) -> bool:
        """No slot was usable."""
        return self.usable_slot_count == 0

    @property
    def singleton_slot_group(self) -> bool:
        """Exactly one slot was usable (whether or not the group was kept)."""
        return self.usable_slot_count == 1

    def as_dict(self) -> dict[str, float]:
        """The seven scalars recorded per group."""
        g = self.target_slot_count
        return {
            "target_slot_count": g,
            "usable_slot_count": self.usable_slot_count,
            "trainable_slot_count": self.trainable_slot_count,
            "fully_masked_group": float(self.fully_masked_group),
            "singleton_slot_group": float(self.singleton_slot_group),
            "pre_filter_usable_slot_yield": self.usable_slot_count / g,
            "pre_filter_trainable_slot_yield": self.trainable_slot_count / g,
        }


def _is_interaction_dict(result: Any) -> bool:
    return isinstance(result, Mapping) and bool(result) and all(isinstance(v, Interaction) for v in result.values())


def _kind(result: Any, slot: int) -> str:
    if isinstance(result, Trajectory):
        return "tensor"
    if type(result) is dict or isinstance(result, Mapping):
        # Only usable (non-empty) results get here; a tensor dict is told by its first value.
        first = next(iter(result.values()))
        return "interaction" if isinstance(first, Interaction) and _is_interaction_dict(result) else "tensor"
    raise WorkflowContractError(
        f"slot {slot}: a workflow must return a Trajectory, a dict or None; got {type(result).__name__}"
    )


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
        self.group_size = group_size
        self.min_usable_group_size = min_usable_group_size
        self.drop_incomplete_group = drop_incomplete_group
        self.reward_normalization = reward_normalization
        self.reward_normalization_use_std = reward_normalization_use_std
        self.finalize_hook = finalize_hook or getattr(self.workflow, "_afinalize_processor_cache_group", None)
        self.finalize_timeout = finalize_timeout
        self.stats = stats

    def __repr__(self) -> str:
        return f"GroupedRolloutWorkflow({self.workflow!r}, group_size={self.group_size})"

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> GroupResult:
        """Run the group; return the merged usable results, or None when the group is dropped."""
        g = self.group_size
        parent = workflow_context.get()
        cache = ProcessorCache()
        group_ctx = parent.evolve(group_size=g, processor_cache=cache, sample_idx=None)
        results: list[Any] = [None] * g
        try:
            async with trio.open_nursery() as nursery:
                for i in range(g):
                    nursery.start_soon(self._run_slot, engine, data, group_ctx, i, results)
        except BaseException as exc:
            await self._finalize(group_ctx, cache)
            if isinstance(exc, Exception):
                self._metrics_hook(data, results)
            raise
        await self._finalize(group_ctx, cache)
        self._metrics_hook(data, results)
        return self._assemble(results)

    async def _run_slot(
        self, engine: InferenceEngine, data: Any, group_ctx: workflow_context.WorkflowContext, i: int, results: list[Any]
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
            results[i] = await self.workflow.arun_episode(engine, data)
        except Exception as exc:
            exc.add_note(f"rollout_trio: raised in slot {i} of a group of {self.group_size}")
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
        usable = [r for r in results if r]
        if not callable(hook) or not all(_is_interaction_dict(r) for r in usable):
            return
        rewards = [list(r.values())[-1].reward if r else None for r in results]
        hook(data, rewards, self.group_size)

    def _record(self, usable: int, trainable: bool) -> None:
        stats = GroupStatistics(self.group_size, usable, usable if trainable else 0)
        recorder = self.stats or workflow_context.stats_recorder()
        recorder.record(workflow_context.stat_scope(), stats.as_dict())

    def _assemble(self, results: list[Any]) -> GroupResult:
        g = self.group_size
        slots = [i for i, r in enumerate(results) if r]
        u = len(slots)
        if u == 0:
            self._record(0, False)
            return None
        if u < g and self.drop_incomplete_group:
            logger.warning(
                "GroupedRolloutWorkflow: %d/%d trajectories returned None, dropping entire group "
                "(drop_incomplete_group=True).", g - u, g,
            )
            self._record(u, False)
            return None
        if u < g and not self.reward_normalization:
            action = "dropping group below min_usable_group_size" if u < self.min_usable_group_size else "using remaining results"
            logger.warning("GroupedRolloutWorkflow: %d/%d trajectories returned None, %s", g - u, g, action)
        if u < self.min_usable_group_size:
            self._record(u, False)
            return None
        kinds = {i: _kind(results[i], i) for i in slots}
        if len(set(kinds.values())) > 1:
            raise WorkflowContractError(
                "a group's slots must all return the same kind of result; got "
                + ", ".join(f"slot {i}: {k}" for i, k in kinds.items())
            )
        if kinds[slots[0]] == "interaction":
            merged = self._merge_interactions(results, slots)
            if merged is None:
                self._record(u, False)
                return None
            self._record(u, True)
            return merged
        traj = self._merge_tensors(results, slots)
        self._record(u, True)
        return traj

    # -- interaction path -------------------------------------------------------------

    def _merge_interactions(self, results: list[Any], slots: list[int]) -> dict[str, Interaction] | None:
        owner: dict[str, int] = {}
        for i in slots:
            dup = sorted(k for k in results[i] if k in owner)
            if dup:
                raise WorkflowContractError(
                    f"Rollout interaction IDs must be unique: duplicate interaction IDs {dup} "
                    f"in slots {owner[dup[0]]} and {i}"
                )
            owner.update(dict.fromkeys(results[i], i))
        usable = [results[i] for i in slots]
        if self.reward_normalization and not self._normalize_interactions(usable, slots):
            return None
        merged: dict[str, Interaction] = {}
        for j, result in enumerate(usable):
            for key, inter in result.items():
                inter.rollout_index = j
                merged[key] = inter
        return merged

    def _normalize_interactions(self, usable: list[Mapping[str, Interaction]], slots: list[int]) -> bool:
        refs: list[float] = []
        for rollout, slot in zip(usable, slots):
            inters = list(rollout.values())
            explicit = {as_reward_scalar(x.rollout_reward, what=f"slot {slot}: rollout_reward") for x in inters if x.rollout_reward is not None}
            if len(explicit) > 1:
                raise WorkflowContractError(
                    f"slot {slot}: interactions in one rollout must share rollout_reward; got {sorted(explicit)}"
                )
            missing = sum(x.reward is None for x in inters)
            if missing:
                logger.warning(
                    "reward_normalization: dropping group (%d/%d usable rollouts have None reward)",
                    sum(any(x.reward is None for x in r.values()) for r in usable), len(usable),
                )
                return False
            if explicit:
                refs.append(explicit.pop())
                continue
            rewards = {as_reward_scalar(x.reward, what=f"slot {slot}: reward") for x in inters}
            ref = next(iter(rewards))
            # Cached rows are compared in their own dtype: a float32 cache of 0.1 matches 0.1.
            caches = [x.cache.rewards for x in inters if x.cache is not None and x.cache.rewards is not None]
            if len(rewards) > 1 or any(bool((c != torch.tensor(ref, dtype=c.dtype)).any()) for c in caches):
                raise WorkflowContractError(
                    f"slot {slot}: Split rollout row rewards differ; supply an explicit rollout_reward "
                    "for reward normalization."
                )
            refs.append(rewards.pop())
        mean, scale = self._affine(refs)
        for rollout, ref in zip(usable, refs):
            norm_ref = float(rollout_time_apply(ref, mean, scale))
            for x in rollout.values():
                x.original_reward = x.reward
                x.reward = float(rollout_time_apply(x.reward, mean, scale))
                x.rollout_reward = norm_ref
                cache = x.cache
                if cache is not None and cache.rewards is not None:
                    x.cache = attrs.evolve(
                        cache,
                        original_rewards=cache.rewards.clone(),
                        rewards=rollout_time_apply(cache.rewards, mean, scale).to(cache.rewards.dtype),
                    )
        return True

    def _affine(self, refs: list[float] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, scale = rollout_time_affine(refs)
        if not self.reward_normalization_use_std:
            scale = torch.ones((), dtype=torch.float32)
        return mean, scale

    # -- tensor path ------------------------------------------------------------------

    def _merge_tensors(self, results: list[Any], slots: list[int]) -> Trajectory:
        items = [results[i] for i in slots]
        for i, item in zip(slots, items):
            group = item.rollout_group if isinstance(item, Trajectory) else item.get("rollout_group")
            if isinstance(group, RolloutGroup) and group.n_rollouts != 1:
                raise WorkflowContractError(
                    f"slot {i}: 'rollout_group': one workflow call is one logical rollout; "
                    f"got {group.n_rollouts} rollouts {group.row_counts}"
                )
        merged = join_slots(items, slots)
        if self.reward_normalization:
            merged = self._normalize_rows(merged, slots)
        return merged

    def _normalize_rows(self, merged: Trajectory, slots: list[int]) -> Trajectory:
        rewards = merged.rewards
        if rewards is None:
            raise WorkflowContractError("'rewards': reward_normalization needs a rewards tensor [B] in every slot")
        group = merged.logical_group()
        if len(group.row_counts) == merged.batch_size and all(r is None for r in group.rewards):
            refs = rewards  # one row per rollout, no explicit references: the rows are the references
        else:
            refs = torch.tensor(self._row_references(rewards, group, slots), dtype=torch.float64)
        mean, scale = self._affine(refs)
        norm_rows = rollout_time_apply(rewards, mean, scale)
        norm_refs = norm_rows if refs is rewards else rollout_time_apply(refs, mean, scale)
        return merged._replace_unchecked(
            original_rewards=rewards.clone(),
            rewards=norm_rows.to(rewards.dtype),
            rollout_group=RolloutGroup(group.row_counts, tuple(norm_refs.tolist())),
        )

    @staticmethod
    def _row_references(rewards: torch.Tensor, group: RolloutGroup, slots: list[int]) -> list[float]:
        refs: list[float] = []
        start = 0
        for k, (count, ref) in enumerate(zip(group.row_counts, group.rewards)):
            rows = rewards[start : start + count]
            start += count
            if ref is None:
                if bool((rows != rows[0]).any()):
                    raise WorkflowContractError(
                        f"slot {slots[k]}: Split rollout row rewards differ; supply an explicit "
                        "rollout_reward for reward normalization."
                    )
                ref = float(rows[0])
            refs.append(ref)
        return refs


async def run_group(
    workflow: Any,
    engine: InferenceEngine,
    data: Any,
    group_size: int,
    **options: Any,
) -> GroupResult:
    """Run one group of ``workflow`` on ``data`` (see :class:`GroupedRolloutWorkflow` for ``options``)."""
    return await GroupedRolloutWorkflow(workflow, group_size, **options).arun_episode(engine, data)
