"""Single-turn RLVR: chat prompt in, one completion, a verifiable reward, one training row."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from .. import workflow_context
from .._config import GenerationConfig
from .._io import ModelRequest
from .._trajectory import Trajectory

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["RewardFn", "rlvr_workflow"]

#: ``reward(completion_text, data) -> float``: synchronous, run in a worker thread.
RewardFn = Callable[[str, Mapping[str, Any]], float]

# Reward functions are user code that may be slow; a few threads at most, shared by all episodes.
_REWARD_LIMITER = trio.CapacityLimiter(4)


def rlvr_workflow(
    tokenizer: Any,
    reward_fn: RewardFn,
    gconfig: GenerationConfig | None = None,
    *,
    limiter: trio.CapacityLimiter | None = None,
) -> Callable[[InferenceEngine, Mapping[str, Any]], Any]:
    """A workflow for ``data = {"messages": [...], ...}``: generate once, score, pack one row.

    The chat template is applied once per group (the slots share the group's processor
    cache), the reward function runs in a thread behind ``limiter``, and the row is
    :meth:`Trajectory.from_response` with ``rewards = [reward]``.

    Args:
        tokenizer: a tokenizer with a chat template.
        reward_fn: ``reward(completion_text, data) -> float``.
        gconfig: sampling settings; the tokenizer's eos and pad ids are added as stop ids.
        limiter: bounds concurrent reward threads (default: 4 for all RLVR workflows).
    """
    config = (gconfig or GenerationConfig()).with_stop_and_pad_token_ids(tokenizer)
    limiter = limiter or _REWARD_LIMITER

    def tokenize(messages: list[dict[str, str]]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    async def prompt_ids(messages: list[dict[str, str]]) -> list[int]:
        cache = workflow_context.get().processor_cache
        compute = lambda: trio.to_thread.run_sync(tokenize, messages)  # noqa: E731
        if cache is None:
            return await compute()
        key = ("chat_template", tuple((m["role"], m["content"]) for m in messages))
        return await cache.get_or_compute(key, compute)

    async def workflow(engine: InferenceEngine, data: Mapping[str, Any]) -> Trajectory:
        ids = await prompt_ids(data["messages"])
        resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=config, tokenizer=tokenizer))
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await trio.to_thread.run_sync(reward_fn, text, data, limiter=limiter)
        return Trajectory.from_response(resp, reward)

    workflow.__qualname__ = f"rlvr_workflow({getattr(reward_fn, '__name__', 'reward')})"
    return workflow
