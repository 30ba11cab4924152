"""Single-turn RLVR: chat prompt in, one completion, a verifiable reward, one training row.

:class:`RLVRWorkflow` is the class form with the reference's reward signature;
:func:`rlvr_workflow` the function form the main job uses (``reward(text, data)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import trio

from .. import workflow_context
from .._config import GenerationConfig
from .._io import ModelRequest
from ..phases import phase
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow
from ._common import as_reward_function, default_data_extract_prompt, default_get_input_ids, load_tokenizer, prompt_ids, resolve_callable

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["RLVRWorkflow", "RewardFn", "rlvr_workflow"]

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
        async with phase("generate"):
            resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=config, tokenizer=tokenizer))
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        async with phase("reward"):
            reward = await trio.to_thread.run_sync(reward_fn, text, data, limiter=limiter)
        return Trajectory.from_response(resp, reward)

    workflow.__qualname__ = f"rlvr_workflow({getattr(reward_fn, '__name__', 'reward')})"
    return workflow


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn RLVR as a class (spec §10.1): one completion per episode, one row.

    Args:
        reward_fn: ``reward_fn(prompt, completion, prompt_ids, completion_ids, **data)``:
            a callable or an import string (wrapped in a thread-isolated
            :class:`~rollout_trio.rewards.RewardFunction`, an import string resolved on the
            first episode), or a :class:`~rollout_trio.rewards.RewardFunction` you
            configured (for process isolation, timeouts, retries).
        gconfig: sampling settings; the tokenizer's eos and pad ids are added as stop ids.
        tokenizer: a tokenizer with a chat template, or a local path to load one from.
        enable_thinking: passed to the chat template.
        get_input_ids_fn: ``(prompt, tokenizer, enable_thinking) -> ids`` (or an import string).
        data_extract_prompt_fn: ``(data) -> prompt`` (or an import string); default
            ``data["messages"]``.

    The row is prompt then completion: ``loss_mask`` 0/1, ``logprobs`` 0.0 on the
    prompt, ``versions`` -1 on the prompt, ``turn_ids`` -1 then 0, ``rewards`` the
    reward, ``is_truncated`` whether the completion hit its length limit.

    Raises:
        TypeError: ``reward_fn`` is not a callable or an import string.
        ValueError: ``tokenizer`` or a callable's import string names nothing loadable.
        WorkflowContractError: ``gconfig`` with the tokenizer's stop ids breaks a rule.
    """

    def __init__(
        self,
        reward_fn: Any,
        gconfig: GenerationConfig | None = None,
        tokenizer: Any = None,
        *,
        enable_thinking: bool = False,
        get_input_ids_fn: Callable[..., list[int]] | str = default_get_input_ids,
        data_extract_prompt_fn: Callable[[Any], Any] | str = default_data_extract_prompt,
    ) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        self.gconfig = (gconfig or GenerationConfig()).new(n_samples=1).with_stop_and_pad_token_ids(self.tokenizer)
        self.reward = as_reward_function(reward_fn)
        self.enable_thinking = enable_thinking
        self.get_input_ids_fn = resolve_callable(get_input_ids_fn, "get_input_ids_fn")
        self.data_extract_prompt_fn = resolve_callable(data_extract_prompt_fn, "data_extract_prompt_fn")

    def __repr__(self) -> str:
        return f"RLVRWorkflow({self.reward!r})"

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> Trajectory:
        prompt = self.data_extract_prompt_fn(data)
        ids = await prompt_ids(lambda: self.get_input_ids_fn(prompt, self.tokenizer, self.enable_thinking), prompt)
        async with phase("generate"):
            resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=self.gconfig, tokenizer=self.tokenizer))
        prompt_str = self.tokenizer.decode(list(resp.input_tokens))
        completion_str = self.tokenizer.decode(list(resp.output_tokens))
        async with phase("reward"):
            reward = await self.reward(prompt_str, completion_str, list(resp.input_tokens), list(resp.output_tokens), **data)
        workflow_context.stats_recorder().record(workflow_context.stat_scope(), {"reward": float(reward)})
        turn_ids = torch.tensor([[-1] * resp.input_len + [0] * resp.output_len], dtype=torch.int32)
        return Trajectory.from_response(resp, reward, turn_ids=turn_ids)
