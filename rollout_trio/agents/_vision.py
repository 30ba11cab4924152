"""Chat requests with OpenAI ``image_url`` parts: their images decoded (data URLs and local
files, never the network) and the prompt made by the model's processor."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from .._images import decode_image
from ._schema import APIError, ChatMessage, Tool
from ._template import ChatTemplate

__all__ = ["vision_prompt"]


def _image(url: str, where: str, *, max_pixels: int, local_files: bool) -> Any:
    if url.startswith("data:"):
        return decode_image(url, where=where, max_pixels=max_pixels, allow_paths=False)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp", "ws", "wss"):
        raise APIError(400, f"{where}: {scheme} URLs are not fetched (send a data:image/ URL or a local file)", param=where)
    path = unquote(urlparse(url).path) if scheme == "file" else url
    if scheme not in ("", "file") or not os.path.isabs(path):
        raise APIError(400, f"{where}: must be a data:image/...;base64 URL or an absolute local file path", param=where)
    if not local_files:
        raise APIError(400, f"{where}: this endpoint reads no local files (send a data:image/ URL)", param=where)
    if not os.path.isfile(path):
        raise APIError(400, f"{where}: no such file", param=where)
    return decode_image(os.path.realpath(path), where=where, max_pixels=max_pixels, allow_paths=True)


def vision_prompt(
    template: ChatTemplate,
    processor: Any,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
    *,
    max_pixels: int,
    local_files: bool,
) -> tuple[list[int], dict[str, Any]]:
    """The prompt's token ids (placeholders expanded) and the :class:`~rollout_trio.ModelRequest`
    fields of its images (blocking: call it in a thread).

    Raises:
        APIError: 400 for an image that is not taken (a network URL, a missing file) or
            breaks a rule (undecodable, over the pixel budget, ...), naming the part.
        ImageInputError: from the request's checks (the caller maps it to 400).
    """
    images = []
    for i, m in enumerate(messages):
        k = 0
        for j, (kind, url) in enumerate(m.parts):
            if kind == "image":
                images.append(_image(url, f"messages[{i}].content[{j}].image_url.url", max_pixels=max_pixels, local_files=local_files))
                k += 1
    kwargs: dict[str, Any] = {}
    if tools and template.native_tools:
        kwargs["tools"] = [t.as_dict() for t in tools]
    conversation = template.messages_for_template(messages, tools)
    text = template.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
    out = processor(images=images, text=[text], padding=False, return_tensors="pt")
    mm = {key: value for key, value in out.items() if key not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    fields = {"image_data": tuple(images), "processor": processor, "multi_modal_input": mm, "max_image_pixels": max_pixels}
    return out["input_ids"][0].tolist(), fields
