"""A finished group's slot results → one trajectory or interaction dict, synchronously.

Classification (usable, rejected, or a contract error), the keep/drop policy, merging
and rollout-time reward normalization. Pure and free of Trio: the group layer runs
this after every slot has ended (in a worker thread when the group is large), and
tests call it directly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import torch

from ._errors import WorkflowContractError
from ._interaction import Interaction
from ._normalize import rollout_time_affine, rollout_time_apply, rollout_time_apply_floats, rollout_time_stats
from ._padding import join_packed, join_slots
from ._rollout_group import RolloutGroup, as_reward_scalar
from ._trajectory import Trajectory

__all__ = ["GroupPolicy", "GroupResult", "GroupStatistics", "assemble_group", "last_interaction_rewards", "token_positions"]

logger = logging.getLogger("rollout_trio.group")

GroupResult = Trajectory | dict[str, Interaction] | None
SlotKind = Literal["tensor", "interaction"]


@attrs.frozen
class GroupStatistics:
    """What one group run yielded, counted in slots (logical rollouts), before any filter.

    Args:
        target_slot_count: the group's size, G.
        usable_slot_count: slots that returned a usable result.
        trainable_slot_count: usable slots whose rows carry a loss (a kept group's).

    Raises:
        Nothing: the executor and the group build it from counts they checked.
    """

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


@attrs.frozen
class GroupPolicy:
    """The keep/drop and normalization settings of a group (checked by the group layer)."""

    group_size: int
    min_usable_group_size: int = 1
    drop_incomplete_group: bool = False
    reward_normalization: bool = False
    reward_normalization_use_std: bool = True


def _is_interaction_dict(result: Any) -> bool:
    return isinstance(result, Mapping) and bool(result) and all(isinstance(v, Interaction) for v in result.values())


def is_usable(result: Any) -> bool:
    """Whether a slot result counts as a rollout (anything but ``None`` and ``{}``)."""
    if type(result) is dict:  # the common case, without the Mapping ABC check
        return len(result) > 0
    return result is not None and not (isinstance(result, Mapping) and len(result) == 0)


def _kind(result: Any, slot: int) -> SlotKind:
    if isinstance(result, Trajectory):
        return "tensor"
    if type(result) is dict or isinstance(result, Mapping):
        # Only usable (non-empty) results get here; a tensor dict is told by its first value.
        first = next(iter(result.values()))
        return "interaction" if isinstance(first, Interaction) and _is_interaction_dict(result) else "tensor"
    raise WorkflowContractError(
        f"slot {slot}: a workflow must return a Trajectory, a dict or None; got {type(result).__name__}"
    )


def _all_tensor_dicts(results: Sequence[Any]) -> bool:
    """Whether every result is a plain non-empty dict whose first value is a tensor
    (usable, and of the tensor kind by :func:`_kind`'s rule), checked in one pass."""
    for r in results:
        if type(r) is not dict or not r or type(next(iter(r.values()))) is not torch.Tensor:
            return False
    return True


def token_positions(results: Sequence[Any]) -> int:
    """Roughly how many token positions a group's results hold (what assembly costs)."""
    total = 0
    for r in results:
        if type(r) is dict:  # the common case first, without the ABC checks
            ids = r.get("input_ids")
            if type(ids) is torch.Tensor:
                total += ids.numel()
                continue
        if isinstance(r, Trajectory):
            total += r.input_ids.numel()
        elif isinstance(r, Mapping):
            ids = r.get("input_ids")
            if isinstance(ids, torch.Tensor):
                total += ids.numel()
            else:
                for v in r.values():
                    if isinstance(v, Interaction):
                        resp = v.model_response
                        total += 0 if resp is None else resp.input_len + resp.output_len
    return total


def last_interaction_rewards(results: Sequence[Any]) -> list[float | None] | None:
    """Per slot, the reward of its last interaction (None for unusable slots).

    None when some usable result is not an interaction dict (the metrics hook then
    does not run).
    """
    if not all(_is_interaction_dict(r) for r in results if is_usable(r)):
        return None
    return [list(r.values())[-1].reward if is_usable(r) else None for r in results]


def assemble_group(results: Sequence[Any], policy: GroupPolicy) -> tuple[GroupResult, GroupStatistics]:
    """Classify, filter, merge and normalize the results of a finished group.

    Returns the merged result (None when the group is dropped) and its statistics.

    Raises:
        WorkflowContractError: a result breaks the contract (naming the slot).
    """
    g = policy.group_size
    if len(results) == g and _all_tensor_dicts(results):
        # Every slot returned a tensor dict: all usable, one kind, nothing to drop.
        return _merge_tensors(results, list(range(g)), policy), GroupStatistics(g, g, g)
    slots = [i for i, r in enumerate(results) if is_usable(r)]
    u = len(slots)

    def stats(trainable: bool) -> GroupStatistics:
        return GroupStatistics(g, u, u if trainable else 0)

    if u == 0:
        return None, stats(False)
    if u < g and policy.drop_incomplete_group:
        logger.warning(
            "GroupedRolloutWorkflow: %d/%d trajectories returned None, dropping entire group "
            "(drop_incomplete_group=True).", g - u, g,
        )
        return None, stats(False)
    if u < g and not policy.reward_normalization:
        action = (
            "dropping group below min_usable_group_size" if u < policy.min_usable_group_size else "using remaining results"
        )
        logger.warning("GroupedRolloutWorkflow: %d/%d trajectories returned None, %s", g - u, g, action)
    if u < policy.min_usable_group_size:
        return None, stats(False)
    kinds = {i: _kind(results[i], i) for i in slots}
    if len(set(kinds.values())) > 1:
        raise WorkflowContractError(
            "a group's slots must all return the same kind of result; got "
            + ", ".join(f"slot {i}: {k}" for i, k in kinds.items())
        )
    if kinds[slots[0]] == "interaction":
        merged = _merge_interactions(results, slots, policy)
        return merged, stats(merged is not None)
    return _merge_tensors(results, slots, policy), stats(True)


def _affine(refs: list[float] | torch.Tensor, policy: GroupPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    mean, scale = rollout_time_affine(refs)
    if not policy.reward_normalization_use_std:
        scale = torch.ones((), dtype=torch.float32)
    return mean, scale


# -- interaction path -----------------------------------------------------------------


def _merge_interactions(results: Sequence[Any], slots: list[int], policy: GroupPolicy) -> dict[str, Interaction] | None:
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
    if policy.reward_normalization and not _normalize_interactions(usable, slots, policy):
        return None
    merged: dict[str, Interaction] = {}
    for j, result in enumerate(usable):
        for key, inter in result.items():
            inter.rollout_index = j
            merged[key] = inter
    return merged


def _normalize_interactions(usable: list[Mapping[str, Interaction]], slots: list[int], policy: GroupPolicy) -> bool:
    refs: list[float] = []
    for rollout, slot in zip(usable, slots):
        inters = list(rollout.values())
        explicit = {
            as_reward_scalar(x.rollout_reward, what=f"slot {slot}: rollout_reward")
            for x in inters
            if x.rollout_reward is not None
        }
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
    mean, scale = _affine(refs, policy)
    normalized = []  # every value first, so an overflow leaves no interaction half-normalized
    for rollout, ref, slot in zip(usable, refs, slots):
        try:
            normalized.append(
                (float(rollout_time_apply(ref, mean, scale)),
                 [float(rollout_time_apply(x.reward, mean, scale)) for x in rollout.values()])
            )
        except ValueError as exc:
            raise WorkflowContractError(f"slot {slot}: 'reward': {exc}") from None
    for rollout, (norm_ref, norm) in zip(usable, normalized):
        for x, value in zip(rollout.values(), norm):
            x.original_reward = x.reward
            x.reward = value
            x.rollout_reward = norm_ref
            cache = x.cache
            if cache is not None and cache.rewards is not None:
                x.cache = attrs.evolve(
                    cache,
                    original_rewards=cache.rewards.clone(),
                    rewards=rollout_time_apply(cache.rewards, mean, scale).to(cache.rewards.dtype),
                )
    return True


# -- tensor path ----------------------------------------------------------------------


def _merge_tensors(results: Sequence[Any], slots: list[int], policy: GroupPolicy) -> Trajectory:
    items = list(results) if len(slots) == len(results) else [results[i] for i in slots]
    merged = join_packed(items)  # the common shape (no rollout_group key), packed in bulk
    if merged is not None:
        return _normalize_rows(merged, slots, policy) if policy.reward_normalization else merged
    for i, item in zip(slots, items):
        group = item.rollout_group if isinstance(item, Trajectory) else item.get("rollout_group")
        if isinstance(group, RolloutGroup) and group.n_rollouts != 1:
            raise WorkflowContractError(
                f"slot {i}: 'rollout_group': one workflow call is one logical rollout; "
                f"got {group.n_rollouts} rollouts {group.row_counts}"
            )
    merged = join_slots(items, slots, packed=False)
    if policy.reward_normalization:
        merged = _normalize_rows(merged, slots, policy)
    return merged


def _normalize_rows(merged: Trajectory, slots: list[int], policy: GroupPolicy) -> Trajectory:
    rewards = merged.rewards
    if rewards is None:
        raise WorkflowContractError("'rewards': reward_normalization needs a rewards tensor [B] in every slot")
    group = merged.logical_group()
    refs: torch.Tensor
    one_per_row = len(group.row_counts) == merged.batch_size and all(r is None for r in group.rewards)
    if one_per_row and rewards.dtype == torch.float32:
        fast = _normalize_float32_rows(merged, rewards, policy)
        if fast is not None:
            return fast
    if one_per_row:
        refs = rewards  # one row per rollout, no explicit references: the rows are the references
    else:
        refs = torch.tensor(_row_references(rewards, group, slots), dtype=torch.float64)
    mean, scale = _affine(refs, policy)
    try:
        norm_refs = rollout_time_apply(refs, mean, scale)
    except ValueError as exc:  # one reference per slot: the farthest from the mean overflowed
        k = int(((refs.to(torch.float32).double() - mean.double()) / scale.double()).abs().argmax())
        raise WorkflowContractError(f"slot {slots[k]}: 'rewards': {exc}") from None
    norm_rows = norm_refs if refs is rewards else rollout_time_apply(rewards, mean, scale)
    return merged._replace_unchecked(
        original_rewards=rewards.clone(),
        rewards=norm_rows.to(rewards.dtype),
        rollout_group=RolloutGroup(group.row_counts, tuple(norm_refs.tolist())),
    )


def _normalize_float32_rows(merged: Trajectory, rewards: torch.Tensor, policy: GroupPolicy) -> Trajectory | None:
    """The common case in plain float64 arithmetic: one float32 row per rollout, the rows
    being the references. Two tensor ops instead of a dozen; None (the tensor path then
    saturates or raises) when a result lies beyond float32's range."""
    try:
        values = rewards.tolist()
        mean, scale = rollout_time_stats(values)
    except ValueError:
        return None  # the tensor path raises it, naming the slot
    if not policy.reward_normalization_use_std:
        scale = 1.0
    normalized = rollout_time_apply_floats(values, mean, scale)
    if normalized is None:
        return None
    rows = torch.tensor(normalized, dtype=torch.float32)
    return merged._replace_unchecked(
        original_rewards=rewards,  # the batch's own tensor (joined from the slots), not a caller's
        rewards=rows,
        rollout_group=RolloutGroup.unchecked(merged.logical_group().row_counts, tuple(rows.tolist())),
    )


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
