"""``Interaction``: one LLM call of an agent-style rollout, with its reward.

The reference calls it ``InteractionWithTokenLogpReward``. A workflow may return a
dict ``{interaction_id: Interaction}`` instead of a tensor dict; the interactions are
turned into rows by :func:`interactions_to_trajectory`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch

from ._errors import WorkflowContractError
from ._io import ModelResponse
from ._padding import concat_trajectories
from ._rollout_group import RolloutGroup, as_reward_scalar
from ._trajectory import Trajectory

__all__ = ["Interaction", "interactions_to_trajectory"]


@attrs.define(eq=False, kw_only=True)
class Interaction:
    """One model call and what it earned.

    Mutable on purpose: group reward normalization rewrites ``reward`` (keeping
    ``original_reward``) and the cached tensors in place. Identity, not value, is equality.

    Attributes:
        model_response: the engine's response (prompt and output tokens, logprobs, versions).
        reward: the reward of this call, or None while unknown.
        original_reward: the reward before normalization.
        rollout_reward: the reference reward of the whole logical rollout, if the
            rows of the rollout have different rewards.
        parent: the previous interaction of a multi-turn conversation.
        chat_template_type: "hf" (each call is its own row) or "concat" (a child's row
            extends its parent's row).
        messages: the chat messages sent.
        output_message_list: the messages the model produced.
        interaction_id: the completion id.
        rollout_index: which usable rollout of a group the interaction came from (set on merge).
        multi_modal_input: the processor's tensors of the prompt's images (a VLM call);
            the row then carries them (``multi_modal_input``, and ``mm_token_type_ids``
            marking the prompt's ``image_token_id`` positions).
        image_token_id: the image placeholder token of that call's processor.

    Raises:
        ValueError: ``chat_template_type`` is neither "hf" nor "concat".
    """

    model_response: ModelResponse | None = None
    reward: float | None = None
    original_reward: float | None = None
    rollout_reward: float | None = None
    parent: Interaction | None = None
    chat_template_type: Literal["hf", "concat"] = attrs.field(
        default="hf", validator=attrs.validators.in_(("hf", "concat"))
    )
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    output_message_list: list[dict[str, Any]] | None = None
    interaction_id: str | None = None
    rollout_index: int | None = None
    multi_modal_input: dict[str, Any] | None = None
    image_token_id: int | None = None
    _cache: Trajectory | None = attrs.field(default=None, alias="cache")

    @property
    def has_tensor_data(self) -> bool:
        """Whether the interaction can become a training row."""
        return self.model_response is not None or self._cache is not None

    @property
    def cache(self) -> Trajectory | None:
        """The cached tensor form, once built (or supplied)."""
        return self._cache

    @cache.setter
    def cache(self, value: Trajectory | None) -> None:
        self._cache = value

    def _sequences(self) -> tuple[list[int], list[int], list[float], list[int]]:
        resp = self.model_response
        if resp is None:
            raise WorkflowContractError("Interaction.model_response: must be set to build tensors, got None")
        n_in, n_out = resp.input_len, resp.output_len
        ids = [*resp.input_tokens, *resp.output_tokens]
        loss = [0] * n_in + [1] * n_out
        logp = [0.0] * n_in + list(resp.output_logprobs)
        vers = [-1] * n_in + list(resp.output_versions)
        parent = self.parent
        if self.chat_template_type == "concat" and parent is not None and parent.model_response is not None:
            p_ids, p_loss, p_logp, p_vers = parent._sequences()
            p = len(p_ids)
            if n_in > p and list(resp.input_tokens[:p]) == p_ids:
                # Reuse the parent's per-token data, then context tokens, then our output.
                ctx = n_in - p
                loss = p_loss + [0] * ctx + [1] * n_out
                logp = p_logp + [0.0] * ctx + list(resp.output_logprobs)
                vers = p_vers + [-1] * ctx + list(resp.output_versions)
        return ids, loss, logp, vers

    def to_trajectory(self) -> Trajectory:
        """The one-row tensor form (built once, then cached).

        ``rewards`` is ``reward`` (None counts as 0.0), ``original_rewards`` the
        ``original_reward`` if set, else the reward; ``is_truncated`` is
        ``stop_reason == "length"``.
        """
        if self._cache is not None:
            return self._cache
        ids, loss, logp, vers = self._sequences()
        assert self.model_response is not None
        reward = 0.0 if self.reward is None else as_reward_scalar(self.reward, what="Interaction.reward")
        original = reward if self.original_reward is None else as_reward_scalar(self.original_reward, what="Interaction.original_reward")
        extras: dict[str, Any] = {}
        if self.multi_modal_input is not None:
            types = _image_token_types(ids, self.image_token_id, self.model_response.input_len)
            extras = {"multi_modal_input": [self.multi_modal_input], "mm_token_type_ids": types}
        self._cache = Trajectory(
            input_ids=torch.tensor([ids], dtype=torch.int32),
            attention_mask=torch.ones(1, len(ids), dtype=torch.bool),
            loss_mask=torch.tensor([loss], dtype=torch.int32),
            logprobs=torch.tensor([logp], dtype=torch.float32),
            versions=torch.tensor([vers], dtype=torch.int32),
            rewards=torch.tensor([reward], dtype=torch.float32),
            original_rewards=torch.tensor([original], dtype=torch.float32),
            is_truncated=torch.tensor([self.model_response.stop_reason == "length"]),
            extras=extras,
        )
        return self._cache


def _image_token_types(ids: list[int], token: int | None, n_prompt: int) -> torch.Tensor:
    """``mm_token_type_ids`` of a VLM call's row: 1 on the prompt's image placeholders."""
    types = [int(t == token) for t in ids[:n_prompt]] + [0] * (len(ids) - n_prompt)
    return torch.tensor([types], dtype=torch.int32)


def _reference(bucket: list[Interaction], k: int) -> float | None:
    refs = {as_reward_scalar(i.rollout_reward, what=f"rollout {k}: rollout_reward") for i in bucket if i.rollout_reward is not None}
    if len(refs) > 1:
        raise WorkflowContractError(
            f"rollout {k}: interactions in one rollout must share rollout_reward; got {sorted(refs)}"
        )
    return refs.pop() if refs else None


def interactions_to_trajectory(interactions: Mapping[str, Interaction]) -> Trajectory:
    """Rows for every interaction, grouped into logical rollouts by ``rollout_index``.

    Rows of one rollout are contiguous, rollouts in order of first appearance
    (``rollout_index`` None counts as 0). Each rollout's reference is the one
    ``rollout_reward`` its interactions share.

    Args:
        interactions: ``{interaction id: Interaction}``, as a multi-turn workflow returns.

    Returns:
        One :class:`Trajectory` with a row per interaction.

    Raises:
        WorkflowContractError: an empty mapping, a value that is not an
            :class:`Interaction`, or one rollout's interactions holding two different
            ``rollout_reward`` values.
    """
    if not interactions:
        raise WorkflowContractError("interactions: needs at least one interaction, got an empty dict")
    buckets: dict[int, list[Interaction]] = {}
    for key, inter in interactions.items():
        if not isinstance(inter, Interaction):
            raise WorkflowContractError(f"interactions[{key!r}]: must be an Interaction, got {type(inter).__name__}")
        buckets.setdefault(inter.rollout_index or 0, []).append(inter)
    rows: list[Trajectory] = []
    counts: list[int] = []
    refs: list[float | None] = []
    for k, bucket in buckets.items():
        trajs = [i.to_trajectory() for i in bucket]
        rows.extend(trajs)
        counts.append(sum(t.batch_size for t in trajs))
        refs.append(_reference(bucket, k))
    if any("multi_modal_input" in t.extras for t in rows) and not all("multi_modal_input" in t.extras for t in rows):
        # Text-only calls beside VLM calls: rows of one layout (no images, no placeholders).
        rows = [t if "multi_modal_input" in t.extras else t._replace_unchecked(
            extras={**t.extras, "multi_modal_input": [None], "mm_token_type_ids": torch.zeros_like(t.input_ids, dtype=torch.int32)})
            for t in rows]  # fmt: skip
    merged = concat_trajectories(rows).to_dict()
    merged["rollout_group"] = RolloutGroup(tuple(counts), tuple(refs))
    return Trajectory.from_dict(merged)
