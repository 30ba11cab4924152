"""``POST /v1/responses``: the OpenAI Responses API (openai-agents' default) on the agent endpoint.

A Responses body is translated into a chat completion request (``instructions`` a system
message, ``input`` items messages, ``function_call`` items assistant tool calls,
``function_call_output`` items tool messages) and served by the same code as chat
completions, so the interaction recorded is the one a chat completion of that
conversation records. The answer is a ``response`` object whose ``output`` holds a
``message`` item (``output_text``) and one ``function_call`` item per tool call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._http import Request, Response, json_bytes
from ._schema import APIError, ChatCompletionRequest
from ._sse import response_events, sse_response

if TYPE_CHECKING:
    from ._endpoint import OpenAIEndpoint

__all__ = ["RESPONSES_PATH", "create_response", "responses_to_chat"]

RESPONSES_PATH = "/v1/responses"
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("system", "developer", "user", "assistant")


def _bad(param: str, rule: str) -> APIError:
    return APIError(400, f"{param}: {rule}", param=param)


def _content(value: Any, where: str) -> Any:
    """A message item's content as chat content (text, or text and image_url parts)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(
            where,
            f"must be a string or a list of content parts, got {type(value).__name__}",
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _bad(at, f"must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise _bad(f"{at}.text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad(
                    f"{at}.image_url", "must be a string (a data URL or a local file)"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise _bad(
                f"{at}.type",
                f"unknown content part type {kind!r}; expected one of input_text, output_text, input_image",
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad(
                "instructions", f"must be a string, got {type(instructions).__name__}"
            )
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise _bad("input", "is required")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad(
            "input", f"must be a string or a list of items, got {type(items).__name__}"
        )
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(
                    f"{at}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}"
                )
            messages.append(
                {
                    "role": role,
                    "content": _content(item.get("content"), f"{at}.content"),
                }
            )
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if not isinstance(item.get(field), str):
                    raise _bad(f"{at}.{field}", "must be a string")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(
                    {"role": "assistant", "content": None, "tool_calls": [call]}
                )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{at}.call_id", "must be a string")
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _content(output, f"{at}.output"),
                }
            )
        elif kind == "reasoning":
            continue  # this endpoint produces none; a client echoing one back loses nothing
        else:
            raise _bad(
                f"{at}.type",
                f"unknown item type {kind!r}; expected message, function_call or function_call_output",
            )
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("tools", f"must be a list, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(f"tools[{i}].type", "only function tools are supported")
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}].name", "must be a string")
        fn = {
            k: tool[k]
            for k in ("name", "description", "parameters")
            if tool.get(k) is not None
        }
        out.append({"type": "function", "function": fn})
    return out


def responses_to_chat(body: Any) -> dict[str, Any]:
    """The chat completion body equivalent to a Responses body.

    Raises:
        APIError: 400 naming the field and the rule (unknown item or part types included).
    """
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(body).__name__}")
    chat: dict[str, Any] = {"messages": _messages(body), "tools": _tools(body)}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("max_output_tokens", "max_tokens"), ("stream", "stream")):  # fmt: skip
        if body.get(src) is not None:
            chat[dst] = body[src]
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _bad("include", f"must be a list, got {type(include).__name__}")
    chat["logprobs"] = _LOGPROBS_INCLUDE in include or bool(
        body.get("top_logprobs") is not None
    )
    return chat


async def create_response(
    endpoint: OpenAIEndpoint, request: Request, in_caller: bool
) -> Response:
    """Serve one ``POST /v1/responses``: the ``response`` object, or its stream events."""
    session = endpoint._authorize(request.header("authorization") or "")

    def parse(body: Any) -> ChatCompletionRequest:
        return endpoint.parse_chat(responses_to_chat(body))

    req: ChatCompletionRequest = await request.json(parse)
    rid, resp, message, finish, tokens = await endpoint.run_chat(
        session, request, req, in_caller, prefix="resp_"
    )
    output: list[dict[str, Any]] = []
    text = message.get("content") or ""
    if text or not message.get("tool_calls"):
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if req.logprobs:
            part["logprobs"] = [
                {**endpoint._token_logprob(t, lp), "top_logprobs": []}
                for t, lp in zip(tokens, resp.output_logprobs, strict=False)
            ]
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid[5:]}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for k, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        output.append({"type": "function_call", "id": f"fc_{rid[5:]}_{k}", "call_id": call["id"], "name": fn["name"],
                       "arguments": fn["arguments"], "status": "completed"})  # fmt: skip
    incomplete = finish == "length"
    response = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": endpoint.model_name,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [
            {"type": "function", **t.as_dict()["function"], "strict": False}
            for t in req.tools
        ],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "usage": {
            "input_tokens": resp.input_len,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": len(tokens),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": resp.input_len + len(tokens),
        },
    }
    return (
        sse_response(response_events(response))
        if req.stream
        else Response(200, json_bytes(response))
    )
