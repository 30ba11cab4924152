"""The typed body of ``POST /v1/chat/completions`` and OpenAI-style error bodies.

Bodies are structured with cattrs into frozen attrs classes; anything that does not fit
becomes an :class:`APIError` naming the field path and the rule (an HTTP 4xx with the
``{"error": {"message", "type", "param", "code"}}`` body OpenAI clients understand).
Unknown keys are ignored, as OpenAI-compatible servers do (clients send ``user``,
``stream_options``, ``seed`` ...).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from .._http import check_text, strict_converter
from .._http._convert import finite_float, strict_bool, strict_int, strict_str

__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "FunctionCall", "Tool", "ToolCall", "parse_request"]

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error the endpoint answers with an OpenAI-shaped body and a 4xx/5xx status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 - the wire name
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen
class FunctionCall:
    """``{"name": ..., "arguments": "<json text>"}``."""

    name: str
    arguments: str = "{}"


@attrs.frozen
class ToolCall:
    """A tool call inside an assistant message."""

    function: FunctionCall
    id: str = ""
    type: Literal["function"] = "function"


@attrs.frozen
class ChatMessage:
    """One message; ``content`` is flattened to text (text parts joined)."""

    role: Role
    content: str | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    #: A message with ``image_url`` parts: every part in order, ``("text", text)`` or
    #: ``("image", url)``; empty for a text-only message.
    parts: tuple[tuple[str, str], ...] = ()

    @property
    def image_urls(self) -> list[str]:
        """The urls of the message's ``image_url`` parts, in order."""
        return [value for kind, value in self.parts if kind == "image"]

    def template_content(self) -> Any:
        """The content as a chat template takes it: the text, or the parts with one
        ``{"type": "image"}`` per image (which the template turns into its placeholder)."""
        if not self.parts:
            return self.content if self.content is not None else ""
        return [{"type": "image"} if kind == "image" else {"type": "text", "text": value} for kind, value in self.parts]

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (``arguments`` parsed back to a dict)."""
        out: dict[str, Any] = {"role": self.role, "content": self.template_content()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def as_openai_dict(self) -> dict[str, Any]:
        """The message in OpenAI's wire form (what an interaction records)."""
        content: Any = self.content
        if self.parts:
            content = [
                {"type": "image_url", "image_url": {"url": value}} if kind == "image" else {"type": "text", "text": value}
                for kind, value in self.parts
            ]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


@attrs.frozen
class ToolFunction:
    """A function a tool exposes (``parameters`` is a JSON schema, passed through)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


@attrs.frozen
class Tool:
    """``{"type": "function", "function": {...}}``."""

    function: ToolFunction
    type: Literal["function"] = "function"

    def as_dict(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            fn["description"] = self.function.description
        if self.function.parameters is not None:
            fn["parameters"] = self.function.parameters
        return {"type": "function", "function": fn}


@attrs.frozen
class ChatCompletionRequest:
    """The fields of a chat completion request the endpoint honours."""

    messages: tuple[ChatMessage, ...]
    model: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False


def _content(value: Any, _: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value if value is None else check_text(value)
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content[{i}]: only text parts {{'type': 'text', 'text': str}} are supported")
            texts.append(part["text"])
        return check_text("".join(texts))
    raise ValueError(f"must be a string, a list of text parts or null, got {type(value).__name__}")


def _stop(value: Any, _: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (check_text(value),) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 4:
        return tuple(check_text(s) for s in value if s)
    raise ValueError("must be a string or a list of at most 4 strings")


def _optional(hook: Any) -> Any:
    return lambda value, _: None if value is None else hook(value)


def _make_converter() -> cattrs.Converter:
    # JSON values are taken as they are: no silent coercion of "1" to 1 or 1.5 to 1.
    c = strict_converter()
    c.register_structure_hook(float, finite_float)
    c.register_structure_hook(str | None, _optional(strict_str))
    c.register_structure_hook(int | None, _optional(strict_int))
    c.register_structure_hook(float | None, _optional(finite_float))
    c.register_structure_hook(bool | None, _optional(strict_bool))
    c.register_structure_hook(dict[str, Any] | None, _optional(_object))
    c.register_structure_hook(str | dict[str, Any] | None, _optional(_text_or_object))

    def role(value: Any, _: Any) -> str:
        if value not in ROLES:
            raise ValueError(f"must be one of {', '.join(ROLES)}, got {value!r}")
        return str(value)

    c.register_structure_hook_func(lambda t: t == Role, role)
    c.register_structure_hook_func(
        lambda t: t == Literal["function"], lambda v, _: v if v == "function" else _raise(f"must be 'function', got {v!r}")
    )
    for cls in (FunctionCall, ToolCall, ToolFunction, Tool):
        c.register_structure_hook(cls, cattrs.gen.make_dict_structure_fn(cls, c))
    msg_fn = cattrs.gen.make_dict_structure_fn(
        # ``parts`` is ours (set from image_url parts after structuring), never a client's key.
        ChatMessage, c, content=cattrs.gen.override(struct_hook=_content), parts=cattrs.gen.override(omit=True)
    )
    c.register_structure_hook(ChatMessage, msg_fn)
    req_fn = cattrs.gen.make_dict_structure_fn(ChatCompletionRequest, c, stop=cattrs.gen.override(struct_hook=_stop))
    c.register_structure_hook(ChatCompletionRequest, req_fn)
    return c


def _raise(message: str) -> Any:
    raise ValueError(message)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"must be an object, got {type(value).__name__}")
    return value


def _text_or_object(value: Any) -> str | dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        return check_text(value)
    raise ValueError(f"must be a string or an object, got {type(value).__name__}")


_converter = _make_converter()


def _first_error(exc: BaseException, path: str) -> tuple[str, str]:
    """The field path and message of the first leaf error of a cattrs validation error."""
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, _ = exc.group_exceptions()
        if with_notes:
            sub, note = with_notes[0]
            name = getattr(note, "name", None)
            index = getattr(note, "index", None)
            child = f"{path}.{name}" if name is not None else f"{path}[{index}]"
            return _first_error(sub, child)
        return _first_error(exc.exceptions[0], path)
    if isinstance(exc, KeyError):
        return path, "is required"
    if isinstance(exc, ForbiddenExtraKeysError):
        return path, str(exc)
    return path, str(exc)


def _check(req: ChatCompletionRequest, max_tokens_limit: int) -> None:
    if not req.messages:
        raise APIError(400, "messages: must hold at least one message", param="messages")
    if req.n != 1:
        raise APIError(400, f"n: only n=1 is supported, got {req.n}; send n requests instead", param="n")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise APIError(400, f"temperature: must be between 0 and 2, got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise APIError(400, f"top_p: must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_logprobs not in (None, 0):
        raise APIError(400, f"top_logprobs: only 0 is supported, got {req.top_logprobs}", param="top_logprobs")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and not 1 <= value <= max_tokens_limit:
            raise APIError(400, f"{name}: must be between 1 and {max_tokens_limit}, got {value}", param=name)
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(
                400, f"messages[{i}].content: required (null only for an assistant message with tool_calls)", param=f"messages[{i}].content"
            )
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages[{i}].tool_calls: only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")


def parse_request(body: Any, *, max_tokens_limit: int) -> ChatCompletionRequest:
    """Structure and check a decoded JSON body.

    Raises:
        APIError: 400 naming the first field that breaks a rule.
    """
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise APIError(400, "messages: is required", param="messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise APIError(400, f"messages: must be a list of message objects, got {type(messages).__name__}", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}]: must be an object, got {type(m).__name__}", param=f"messages[{i}]")
    messages, parts_of = _split_image_parts(messages)
    if parts_of:
        body = {**body, "messages": messages}
    try:
        req = _converter.structure(body, ChatCompletionRequest)
    except (ClassValidationError, IterableValidationError) as exc:
        path, message = _first_error(exc, "")
        path = path.lstrip(".")
        raise APIError(400, f"{path}: {message}", param=path) from None
    _check(req, max_tokens_limit)
    if parts_of:
        with_parts = [attrs.evolve(m, parts=parts_of[i]) if i in parts_of else m for i, m in enumerate(req.messages)]
        req = attrs.evolve(req, messages=type(req.messages)(with_parts))
    return req


#: ``image_url`` parts one request may carry.
MAX_IMAGE_PARTS = 32


def _split_image_parts(messages: list[Any]) -> tuple[list[Any], dict[int, tuple[tuple[str, str], ...]]]:
    """Messages with their ``image_url`` parts taken out (the text parts are checked as
    before), and each such message's parts in order."""
    out: list[Any] = []
    parts_of: dict[int, tuple[tuple[str, str], ...]] = {}
    n_images = 0
    for i, m in enumerate(messages):
        content = m.get("content")
        if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content)):
            out.append(m)
            continue
        parts: list[tuple[str, str]] = []
        texts: list[Any] = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                where = f"messages[{i}].content[{j}].image_url.url"
                if not isinstance(url, str) or not url:
                    raise APIError(400, f"{where}: must be a non-empty string (a data:image/ URL or a local file)", param=where)
                n_images += 1
                if n_images > MAX_IMAGE_PARTS:
                    raise APIError(400, f"{where}: at most {MAX_IMAGE_PARTS} image_url parts per request", param=where)
                parts.append(("image", url))
            else:
                texts.append(p)
                if isinstance(p, dict) and isinstance(p.get("text"), str):
                    parts.append(("text", p["text"]))
        if m.get("role") != "user":
            raise APIError(400, f"messages[{i}].content: image_url parts are taken in user messages only", param=f"messages[{i}].content")
        out.append({**m, "content": texts})
        parts_of[i] = tuple(parts)
    return out, parts_of
