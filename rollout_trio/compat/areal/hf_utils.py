"""``areal.utils.hf_utils``: ``apply_chat_template``, ``load_hf_tokenizer``."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["apply_chat_template", "load_hf_processor_and_tokenizer", "load_hf_tokenizer"]


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *, tokenize: bool = True, **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template``; with ``tokenize`` a ``list[int]`` whatever transformers returns."""
    result = tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    if tokenize and not isinstance(result, list):
        result = result["input_ids"]
    return list(result) if tokenize else result


@functools.lru_cache(maxsize=8)
def load_hf_tokenizer(model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None) -> Any:
    """The tokenizer of a local model directory (pad id defaulting to eos, as AReaL does)."""
    import transformers

    kwargs = {"padding_side": padding_side} if padding_side is not None else {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_name_or_path, use_fast=fast_tokenizer, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


@functools.lru_cache(maxsize=8)
def load_hf_processor_and_tokenizer(
    model_name_or_path: str, fast_tokenizer: bool = True, padding_side: str | None = None
) -> tuple[Any, Any]:
    """``(processor or None, tokenizer)`` of a local model directory."""
    import transformers

    tokenizer = load_hf_tokenizer(model_name_or_path, fast_tokenizer, padding_side)
    try:
        processor = transformers.AutoProcessor.from_pretrained(model_name_or_path)
    except Exception:
        processor = None
    return processor, tokenizer
