"""What the built-in workflows share: tokenizers, prompt ids, reward wrapping."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import trio

from .. import workflow_context
from .._workflow import import_from_string
from ..rewards import RewardFunction

__all__ = ["as_reward_function", "default_data_extract_prompt", "default_get_input_ids", "load_tokenizer", "prompt_ids", "resolve_callable"]


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object, loading a local path string with transformers."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    if tokenizer is None:
        raise ValueError("tokenizer: required (a tokenizer or the path of one)")
    return tokenizer


def as_reward_function(reward_fn: Any) -> RewardFunction:
    """A :class:`RewardFunction` as-is; a callable or import string wrapped with the defaults
    (a thread, imported on first call)."""
    return reward_fn if isinstance(reward_fn, RewardFunction) else RewardFunction(reward_fn)


def resolve_callable(fn: Callable[..., Any] | str, what: str) -> Callable[..., Any]:
    """``fn``, or the callable an import string names."""
    obj = import_from_string(fn) if isinstance(fn, str) else fn
    if not callable(obj):
        raise TypeError(f"{what}: must be callable or an import string naming a callable, got {obj!r}")
    return obj


def default_data_extract_prompt(data: Mapping[str, Any]) -> Any:
    """``data["messages"]``."""
    return data["messages"]


def default_get_input_ids(messages: Any, tokenizer: Any, enable_thinking: bool) -> list[int]:
    """The chat template applied to ``messages`` with the assistant's generation prompt."""
    kwargs = {"enable_thinking": enable_thinking} if enable_thinking else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    return list(ids)


async def prompt_ids(compute: Callable[[], list[int]], prompt: Any) -> list[int]:
    """Run ``compute`` in a thread, once per group when the slots share a processor cache."""
    cache = workflow_context.get().processor_cache

    async def run() -> list[int]:
        return await trio.to_thread.run_sync(compute)

    if cache is None:
        return await run()
    try:
        key: Any = ("input_ids", json.dumps(prompt, sort_keys=True, default=repr))
    except (TypeError, ValueError):
        return await run()
    return await cache.get_or_compute(key, run)
