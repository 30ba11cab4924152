"""Chat templating with tools, and Hermes/Qwen tool-call parsing of model output.

A tokenizer whose chat template knows ``tools`` (Qwen2.5, Hermes, Llama 3.1 ...) gets
them natively. For one that does not (the built-in tiny model's ChatML), the tool
schemas go into the system message and tool calls / results are written into message
text in the Hermes convention, so the model sees the same thing either way.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

import trio

from ._schema import ChatMessage, Tool

__all__ = ["ChatTemplate", "parse_tool_calls", "prompt_chars"]

#: Conversations with at most this many characters are templated on the event loop: a
#: thread hop costs more than rendering them (DESIGN decision 4 sends *long* inputs to threads).
INLINE_CHARS = 4096

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_TOOLS_PREAMBLE = (
    "# Tools\n\n"
    "You can call the functions described inside <tools></tools> below, one JSON schema per line:\n"
    "<tools>\n{schemas}\n</tools>\n\n"
    "To call a function, answer with one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}\n</tool_call>'
)


def _tool_call_text(name: str, arguments: str) -> str:
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


class ChatTemplate:
    """Renders requests to prompt token ids with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer: must have a chat template (tokenizer.chat_template is None)")
        self.tokenizer = tokenizer
        self.native_tools = "tools" in str(tokenizer.chat_template)

    def messages_for_template(self, messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> list[dict[str, Any]]:
        """The message dicts handed to the template (tools written in when it lacks them)."""
        if self.native_tools:
            return [m.as_template_dict() for m in messages]
        out: list[dict[str, Any]] = []
        for m in messages:
            content = m.content or ""
            if m.role == "assistant" and m.tool_calls:
                calls = "\n".join(_tool_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
                content = f"{content}\n{calls}" if content else calls
                out.append({"role": "assistant", "content": content})
            elif m.role == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
            else:
                out.append({"role": "system" if m.role == "developer" else m.role, "content": m.template_content()})
        if tools:
            preamble = _TOOLS_PREAMBLE.format(schemas="\n".join(json.dumps(t.as_dict(), ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{preamble}"}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out

    async def aprompt_ids(self, messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> list[int]:
        """:meth:`prompt_ids` on the event loop for short conversations, in a thread for long ones."""
        if prompt_chars(messages, tools) > INLINE_CHARS:
            return await trio.to_thread.run_sync(self.prompt_ids, messages, tools)
        await trio.lowlevel.checkpoint()
        return self.prompt_ids(messages, tools)

    def prompt_ids(self, messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> list[int]:
        """Token ids of the conversation with the assistant's generation prompt (blocking)."""
        kwargs: dict[str, Any] = {}
        if tools and self.native_tools:
            kwargs["tools"] = [t.as_dict() for t in tools]
        conversation = self.messages_for_template(messages, tools)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (pure Python) tokenizer
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
            )
            return list(ids)
        # What apply_chat_template(tokenize=True) does for a fast tokenizer (render, then
        # encode without special tokens), minus resetting the backend's truncation and
        # padding on every call: ~40 of ~140 us per completion.
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(backend.encode(text, add_special_tokens=False).ids)


def prompt_chars(messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> int:
    """About how many characters the template renders (what tokenizing costs grows with)."""
    size = sum(len(m.content or "") + sum(len(c.function.arguments) for c in m.tool_calls) for m in messages)
    return size + sum(len(str(t.function.parameters or "")) + len(t.function.description or "") for t in tools)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into content and OpenAI ``tool_calls``.

    Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block becomes a
    tool call; the text around them is the content (None when empty). If any block is
    not such a JSON object, nothing is parsed: the whole text is the content, so a
    malformed call reaches the agent as text rather than as an error.
    """
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        if not isinstance(args, (dict, str)):
            return text, []
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
            }
        )
    content = _TOOL_CALL.sub("", text).strip()
    return (content or None), calls
