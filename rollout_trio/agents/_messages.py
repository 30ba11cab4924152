"""``POST /v1/messages``: the Anthropic Messages API (with tool use) on the agent endpoint.

A Messages body is translated into a chat completion request (``system`` a system message,
``tool_use`` blocks assistant tool calls, ``tool_result`` blocks tool messages, ``image``
blocks with a base64 source data URLs) and served by the same code as chat completions,
so the interaction recorded is the one a chat completion of that conversation records.
Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
The session key is taken from ``x-api-key`` (what the Anthropic SDK sends) or from
``Authorization: Bearer`` (its ``auth_token``).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from .._http import HTTPError, Request, Response, json_bytes
from ._schema import APIError, ChatCompletionRequest
from ._sse import message_events, sse_response

if TYPE_CHECKING:
    from ._endpoint import OpenAIEndpoint

__all__ = ["MESSAGES_PATH", "anthropic_error", "create_message", "messages_to_chat"]

MESSAGES_PATH = "/v1/messages"
logger = logging.getLogger("rollout_trio.agents")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                408: "timeout_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error"}  # fmt: skip
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_error(status: int, message: str) -> bytes:
    """Anthropic's error body for ``status``: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return json_bytes({"type": "error", "error": {"type": kind, "message": message}})


def _bad(param: str, rule: str) -> APIError:
    return APIError(400, f"{param}: {rule}", param=param)


def _text(value: Any, where: str) -> str:
    """Text content: a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(
            where,
            f"must be a string or a list of content blocks, got {type(value).__name__}",
        )
    out = []
    for j, block in enumerate(value):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise _bad(
                f"{where}[{j}]", "must be a text block {'type': 'text', 'text': ...}"
            )
        out.append(block["text"])
    return "".join(out)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise _bad(
            f"{where}.source",
            "must be a base64 source {'type': 'base64', 'media_type', 'data'}",
        )
    if not isinstance(source.get("media_type"), str) or not isinstance(
        source.get("data"), str
    ):
        raise _bad(f"{where}.source", "media_type and data must be strings")
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"},
    }


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    at = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(at, f"must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role == "system":  # a mid-conversation system message (what the Claude Code CLI sends)
        return [{"role": "system", "content": _text(m.get("content"), f"{at}.content")}]
    if role not in ("user", "assistant"):
        raise _bad(f"{at}.role", f"must be 'user', 'assistant' or 'system', got {role!r}")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(
            f"{at}.content",
            f"must be a string or a list of content blocks, got {type(content).__name__}",
        )
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{at}.content[{j}]"
        if not isinstance(block, dict):
            raise _bad(where, f"must be an object, got {type(block).__name__}")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{where}.text", "must be a string")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(block, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(
                block.get("name"), str
            ):
                raise _bad(where, "a tool_use block needs string id and name")
            if not isinstance(block.get("input", {}), dict):
                raise _bad(f"{where}.input", "must be an object")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{where}.tool_use_id", "must be a string")
            tools.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": _text(block.get("content", ""), f"{where}.content"),
                }
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # this endpoint produces none; a client echoing one back loses nothing
        else:
            raise _bad(
                f"{where}.type",
                f"unknown or misplaced content block type {kind!r} in a {role} message",
            )
    text_only = all(p["type"] == "text" for p in parts)
    body: Any = "".join(p["text"] for p in parts) if text_only else parts
    out = list(tools)
    if calls:
        out.append({"role": "assistant", "content": body or None, "tool_calls": calls})
    elif parts or not tools:
        out.append({"role": role, "content": body})
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools", f"must be a list, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name", "must be a string")
        if tool.get("type") not in (None, "custom"):
            raise _bad(
                f"tools[{i}].type",
                f"only client tools (with input_schema) are supported, got {tool.get('type')!r}",
            )
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "")
    if mapped is None:
        raise _bad("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
    return mapped


def messages_to_chat(body: Any) -> dict[str, Any]:
    """The chat completion body equivalent to a Messages body.

    Raises:
        APIError: 400 naming the field and the rule (unknown block types included).
    """
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(body).__name__}")
    if not isinstance(body.get("max_tokens"), int) or isinstance(
        body.get("max_tokens"), bool
    ):
        raise _bad("max_tokens", "is required and must be an integer")
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise _bad("messages", "is required and must be a list of messages")
    messages = (
        []
        if body.get("system") is None
        else [{"role": "system", "content": _text(body["system"], "system")}]
    )
    for i, m in enumerate(raw):
        messages += _message(m, i)
    chat: dict[str, Any] = {
        "messages": messages,
        "tools": _tools(body),
        "max_tokens": body["max_tokens"],
    }
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if body.get("temperature") is not None and not (
        isinstance(body["temperature"], (int, float)) and 0 <= body["temperature"] <= 1
    ):
        raise _bad(
            "temperature", f"must be between 0 and 1, got {body['temperature']!r}"
        )
    for src, dst in (
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stop_sequences", "stop"),
        ("stream", "stream"),
    ):
        if body.get(src) is not None:
            chat[dst] = body[src]
    return chat


def session_key_header(request: Request) -> str:
    """The ``Authorization`` value carrying the session key: ``x-api-key`` as a bearer, or the header."""
    key = request.header("x-api-key")
    return f"Bearer {key}" if key else (request.header("authorization") or "")


async def create_message(
    endpoint: OpenAIEndpoint, request: Request, in_caller: bool
) -> Response:
    """Serve one ``POST /v1/messages``: a ``message`` object, or Anthropic's error shape."""
    try:
        return await _create(endpoint, request, in_caller)
    except APIError as exc:
        return Response(exc.status, anthropic_error(exc.status, exc.message))
    except HTTPError as exc:  # the body's limits (413 too large, 408 too slow): in Anthropic's shape too
        close = (("connection", "close"),) if exc.close else ()
        return Response(exc.status, anthropic_error(exc.status, exc.message), headers=exc.headers + close)
    except (
        Exception
    ) as exc:  # an engine failure: a 500 body, never a dropped connection
        logger.error("message failed", exc_info=exc)
        return Response(500, anthropic_error(500, f"{type(exc).__name__}: {exc}"))


async def _create(
    endpoint: OpenAIEndpoint, request: Request, in_caller: bool
) -> Response:
    session = endpoint._authorize(session_key_header(request))

    def parse(body: Any) -> ChatCompletionRequest:
        return endpoint.parse_chat(messages_to_chat(body))

    req: ChatCompletionRequest = await request.json(parse)
    rid, resp, message, finish, tokens = await endpoint.run_chat(
        session, request, req, in_caller, prefix="msg_"
    )
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        try:
            args = json.loads(call["function"]["arguments"])
        except ValueError:
            args = None
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": args if isinstance(args, dict) else {}})  # fmt: skip
    if not content:
        content.append({"type": "text", "text": ""})
    message_obj = {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": endpoint.model_name,
        "content": content,
        "stop_reason": _STOP.get(finish, "end_turn"),
        "stop_sequence": None,
        "usage": {"input_tokens": resp.input_len, "output_tokens": len(tokens)},
    }
    return (
        sse_response(message_events(message_obj))
        if req.stream
        else Response(200, json_bytes(message_obj))
    )
