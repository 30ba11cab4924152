"""Helpers for the agent tests: a scripted engine that answers with given texts."""

from __future__ import annotations

from collections.abc import Iterable

import trio

from rollout_trio import ModelResponse
from rollout_trio.models import byte_tokenizer
from rollout_trio.testing import ScriptedEngine

TOKENIZER = byte_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


def text_tokens(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False))


def texts_engine(texts: Iterable[str], *, version: int = 3) -> ScriptedEngine:
    """An engine whose k-th answer is the k-th text followed by ``<|im_end|>``."""
    queue = list(texts)

    def script(req):
        out = [*text_tokens(queue.pop(0)), IM_END]
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=out,
            output_logprobs=[-0.25] * len(out),
            output_versions=[version] * len(out),
            stop_reason="stop",
        )

    engine = ScriptedEngine(script)
    engine.tokenizer = TOKENIZER
    return engine


def hanging_engine(generating: int) -> tuple[ScriptedEngine, trio.Event]:
    """An engine whose requests never finish, and an event set once ``generating`` are in flight."""
    all_in = trio.Event()

    async def script(req):
        if len(engine.in_flight) == generating:
            all_in.set()
        await trio.sleep_forever()

    engine = ScriptedEngine(script)
    engine.tokenizer = TOKENIZER
    return engine, all_in
