"""Per-episode sessions: the interactions an agent's completions produced, and its rewards.

One session per episode; its random key is the api key the agent sends, so concurrent
episodes never see each other's interactions. Rewards follow spec §8.3: the agent's
return value sets rewards (a float goes to the last completion, a dict by completion
id), then a discounted sum runs newest to oldest over the session's creation order,
then the export style picks the rows.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import trio

from .._interaction import Interaction

__all__ = ["AgentSession", "ExportStyle", "assign_rewards"]

logger = logging.getLogger("rollout_trio.agents")

ExportStyle = Literal["individual", "concat"]
EXPORT_STYLES: tuple[str, ...] = ("individual", "concat")


def _message_key(m: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a message when a later request repeats it (clients add extra keys)."""
    calls = tuple(
        (c.get("function", {}).get("name"), c.get("function", {}).get("arguments")) for c in (m.get("tool_calls") or ())
    )
    return (m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"))


class AgentSession:
    """The interactions of one episode, in creation order.

    Attributes:
        key: the session's api key (``Authorization: Bearer <key>``).
        chat_template_type: ``"hf"`` (each completion its own row) or ``"concat"``
            (a completion's row extends its parent's).
        interactions: completion id -> :class:`~rollout_trio.Interaction`.
    """

    def __init__(self, *, chat_template_type: Literal["hf", "concat"] = "hf", label: str = "") -> None:
        self.key = f"sk-rt-{secrets.token_hex(16)}"
        self.label = label
        self.chat_template_type = chat_template_type
        self.interactions: dict[str, Interaction] = {}
        self.ended = False
        self._in_flight: set[trio.CancelScope] = set()
        self._discounted = False
        # Completion id -> the message keys its conversation continues from (its messages
        # plus output), computed once: find_parent compares against every earlier one.
        self._prefix_keys: dict[str, list[tuple[Any, ...]]] = {}

    def __repr__(self) -> str:
        return f"<AgentSession {self.label!r} {len(self.interactions)} interactions{' ended' if self.ended else ''}>"

    # ---------------------------------------------------------------- recording

    def find_parent(self, messages: list[dict[str, Any]]) -> Interaction | None:
        """The longest earlier interaction whose messages plus output prefix ``messages``."""
        keys = [_message_key(m) for m in messages]
        best: Interaction | None = None
        best_len = -1
        for cid, inter in self.interactions.items():
            prefix = self._prefix_keys.get(cid)
            if prefix is None:
                prefix = self._prefix_keys[cid] = [_message_key(m) for m in [*inter.messages, *(inter.output_message_list or ())]]
            if best_len < len(prefix) <= len(keys) and keys[: len(prefix)] == prefix:
                best, best_len = inter, len(prefix)
        return best

    def record(self, interaction: Interaction) -> None:
        """Add a finished completion."""
        assert interaction.interaction_id is not None
        self.interactions[interaction.interaction_id] = interaction

    @contextmanager
    def generation_scope(self) -> Iterator[trio.CancelScope]:
        """A cancel scope around one in-flight generation; :meth:`end` cancels it."""
        scope = trio.CancelScope()
        if self.ended:
            scope.cancel()
        self._in_flight.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._in_flight.discard(scope)

    def end(self) -> None:
        """Refuse new completions and cancel the in-flight ones (their engine calls abort)."""
        self.ended = True
        for scope in self._in_flight:
            scope.cancel()
        self._in_flight.clear()

    # ---------------------------------------------------------------- rewards

    def set_reward(self, interaction_id: str, reward: float) -> None:
        """Set one completion's reward.

        Raises:
            ValueError: no completion of this session has that id.
        """
        try:
            self.interactions[interaction_id].reward = reward
        except KeyError:
            raise ValueError(
                f"rewards[{interaction_id!r}]: no completion of this episode has that id "
                f"(known: {sorted(self.interactions)})"
            ) from None

    def set_last_reward(self, reward: float) -> None:
        """Set the reward of the most recent completion."""
        if not self.interactions:
            raise ValueError("reward: the agent returned a reward but made no chat completion")
        next(reversed(self.interactions.values())).reward = reward

    def apply_discount(self, discount: float) -> None:
        """Newest to oldest: ``G = G * discount + r``; each reward becomes its ``G``.

        An unset reward counts as 0.0. Callable once per session.
        """
        if self._discounted:
            raise RuntimeError("apply_discount should only be called once per session")
        self._discounted = True
        items = list(self.interactions.values())
        if items and items[-1].reward is None:
            logger.warning("%r: the most recent completion has no reward; unset rewards count as 0.0", self)
        g = 0.0
        for inter in reversed(items):
            g = g * discount + (inter.reward if inter.reward is not None else 0.0)
            inter.reward = g

    def export(self, style: ExportStyle) -> dict[str, Interaction]:
        """The interactions that become rows: all (``individual``) or the leaves (``concat``)."""
        if style not in EXPORT_STYLES:
            raise ValueError(f"export_style: must be one of {EXPORT_STYLES}, got {style!r}")
        items = {k: v for k, v in self.interactions.items() if v.has_tensor_data}
        if style == "individual":
            return items
        hf = [k for k, v in items.items() if v.chat_template_type != "concat"]
        if hf:
            raise ValueError(f"export_style 'concat': every interaction must use chat_template_type 'concat'; {hf} do not")
        parents = {id(v.parent) for v in items.values() if v.parent is not None}
        return {k: v for k, v in items.items() if id(v) not in parents}


def _reward_value(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number, got {value!r}")
    return float(value)


def assign_rewards(session: AgentSession, rewards: Any) -> None:
    """Apply an agent's return value: a float to the last completion, a dict by completion id.

    Raises:
        ValueError: any other type (``int``, ``bool`` and ``None`` included), a dict key
            that is no completion of the session, a non-finite reward.
    """
    if isinstance(rewards, float):
        session.set_last_reward(_reward_value(rewards, "reward"))
    elif isinstance(rewards, Mapping):
        for key, value in rewards.items():
            session.set_reward(key, _reward_value(value, f"rewards[{key!r}]"))
    else:
        raise ValueError(
            f"Invalid reward type: {type(rewards)}; an agent's run() must return a float "
            "(the last completion's reward) or a dict {completion_id: reward}"
        )

