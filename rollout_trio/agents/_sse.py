"""``stream=true`` answers: the finished answer of each API as its server-sent events.

The engine returns a completion whole, so a streamed request is generated and recorded
exactly as an unstreamed one (the same code, the same interaction), and its answer object
is then sent as the event sequence the API's SDKs parse: chat completion chunks ending in
``[DONE]``, Responses' ``response.*`` events, or Anthropic's ``message_*`` and
``content_block_*`` events. A client that leaves while the completion is generated
aborts it, as for an unstreamed request.
"""

from __future__ import annotations

import json
from typing import Any

from .._http import Response, json_bytes

__all__ = ["chat_events", "message_events", "response_events", "sse_response"]

EVENT_STREAM = "text/event-stream"


def sse_response(events: list[tuple[str | None, Any]]) -> Response:
    """A 200 ``text/event-stream`` answer of ``(event name or None, data)`` pairs."""
    out = bytearray()
    for name, data in events:
        if name is not None:
            out += f"event: {name}\n".encode()
        out += (
            b"data: "
            + (data.encode() if isinstance(data, str) else json_bytes(data))
            + b"\n\n"
        )
    return Response(
        200,
        bytes(out),
        content_type=EVENT_STREAM,
        headers=(("cache-control", "no-cache"),),
    )


def chat_events(completion: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """A ``chat.completion`` object as ``chat.completion.chunk`` events, usage last, then ``[DONE]``."""
    [choice] = completion["choices"]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"
    }
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [
            {"index": i, **call} for i, call in enumerate(message["tool_calls"])
        ]
    first = {
        "index": 0,
        "delta": delta,
        "finish_reason": None,
        "logprobs": choice.get("logprobs"),
    }
    last = {
        "index": 0,
        "delta": {},
        "finish_reason": choice["finish_reason"],
        "logprobs": None,
    }
    return [
        (None, {**head, "choices": [first]}),
        (None, {**head, "choices": [last]}),
        (None, {**head, "choices": [], "usage": completion["usage"]}),
        (None, "[DONE]"),
    ]


def response_events(response: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """A ``response`` object as Responses API stream events, ``response.completed`` last."""
    events: list[tuple[str | None, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    started = {**response, "status": "in_progress", "output": [], "usage": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            emit(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "content": []},
            )
            for j, part in enumerate(item["content"]):
                ids = {"item_id": item["id"], "output_index": i, "content_index": j}
                emit("response.content_part.added", **ids, part={**part, "text": ""})
                emit(
                    "response.output_text.delta",
                    **ids,
                    delta=part["text"],
                    logprobs=part.get("logprobs", []),
                )
                emit(
                    "response.output_text.done",
                    **ids,
                    text=part["text"],
                    logprobs=part.get("logprobs", []),
                )
                emit("response.content_part.done", **ids, part=part)
        else:  # a function call
            emit(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            ids = {"item_id": item["id"], "output_index": i}
            emit(
                "response.function_call_arguments.delta", **ids, delta=item["arguments"]
            )
            emit(
                "response.function_call_arguments.done",
                **ids,
                arguments=item["arguments"],
                name=item["name"],
            )
        emit("response.output_item.done", output_index=i, item=item)
    emit(
        "response.incomplete"
        if response["status"] == "incomplete"
        else "response.completed",
        response=response,
    )
    return events


def message_events(message: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """An Anthropic ``message`` object as Messages stream events, ``message_stop`` last."""
    usage = message["usage"]
    started = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0},
    }
    events: list[tuple[str | None, Any]] = [
        ("message_start", {"type": "message_start", "message": started})
    ]
    for i, block in enumerate(message["content"]):
        start: dict[str, Any]
        delta: dict[str, Any]
        if block["type"] == "text":
            start, delta = (
                {"type": "text", "text": ""},
                {"type": "text_delta", "text": block["text"]},
            )
        else:  # tool_use
            start = {**block, "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        events += [
            (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": start},
            ),
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": i, "delta": delta},
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    stop = {
        "stop_reason": message["stop_reason"],
        "stop_sequence": message["stop_sequence"],
    }
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": stop,
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events
