"""Oversized and slow request bodies get each API's own error shape (issue 29): Anthropic's
``{"type": "error", "error": {"type": "request_too_large" | "timeout_error", ...}}`` on
``/v1/messages`` (413, 408), OpenAI's ``{"error": {...}}`` on chat completions and responses."""

import json

import httpx
import pytest
import trio

from rollout_trio.agents import OpenAIEndpoint

from .agent_helpers import texts_engine
from .test_agent_endpoint import asgi_scope

BIG = "x" * 2000
BODIES = {
    "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": BIG}]},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": BIG}]},
    "/v1/responses": {"input": BIG},
}


def assert_shape(path, body, anthropic_type):
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == anthropic_type, body
    else:
        assert "type" not in body and body["error"]["type"] == "invalid_request_error", body


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_body_over_the_size_limit_is_a_413_in_the_apis_shape(path):
    ep = OpenAIEndpoint(texts_engine([]), max_body_bytes=1000)
    with ep.session() as s:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=ep.app), base_url="http://agent") as client:
            r = await client.post(path, json=BODIES[path], headers={"authorization": f"Bearer {s.key}"})
    assert r.status_code == 413
    body = r.json()
    assert_shape(path, body, "request_too_large")
    assert "limit of 1000 bytes" in body["error"]["message"]
    assert s.interactions == {}


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_body_that_never_finishes_is_a_408_in_the_apis_shape(path, autojump_clock):
    ep = OpenAIEndpoint(texts_engine([]), body_timeout=5)
    sent = []
    started = False

    async def receive():
        nonlocal started
        if not started:
            started = True
            return {"type": "http.request", "body": b'{"messages": ', "more_body": True}
        await trio.sleep_forever()

    async def send(message):
        sent.append(message)

    with ep.session() as s:
        await ep.app(asgi_scope(s.key, path), receive, send)
    assert sent[0]["status"] == 408
    body = json.loads(sent[1]["body"])
    assert_shape(path, body, "timeout_error")
    assert "read_deadline=5" in body["error"]["message"]
