"""``areal.experimental.openai``: ``ArealOpenAI`` is not adapted yet (a typed error says so)."""

from __future__ import annotations

from typing import Any

from ._errors import ArealCompatError

__all__ = ["ArealOpenAI"]


class ArealOpenAI:
    """Not served yet: AReaL's engine-backed OpenAI client.

    Raises:
        ArealCompatError: always; write the agent with ``async def run(data, **extra_kwargs)``
            and an ``openai.AsyncOpenAI(base_url=extra_kwargs["base_url"])`` client, which
            rollout_trio's agent workflows serve from the engine (docs/areal.md).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ArealCompatError(
            "areal.experimental.openai.ArealOpenAI: not adapted; use an agent class with "
            "`async def run(data, **extra_kwargs)` and AsyncOpenAI(base_url=extra_kwargs['base_url'])"
        )
