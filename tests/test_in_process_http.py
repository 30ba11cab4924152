"""InProcessTransport and InProcessClient answer as the ASGI app does, on every request.

The in-process path hands a request's head and body to the app without ASGI messages
(and, with InProcessClient, without httpx's auth, redirect and cookie machinery while
nothing asks for it). Differential: every request gets the same status, headers and body
as through ``httpx.ASGITransport(app)``; what the short path skips falls back to
``httpx.AsyncClient.send`` when it is asked for.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio._http import HTTPApp, HTTPError, InProcessClient, InProcessTransport, Request, Response, ServerLimits
from rollout_trio.agents import InProcessClient as PublicClient
from rollout_trio.agents import InProcessTransport as PublicTransport
from rollout_trio.agents import OpenAIEndpoint
from rollout_trio.agents._clients import open_agent_client

from .agent_helpers import TOKENIZER, texts_engine

LIMITS = ServerLimits(max_body_bytes=64, max_header_bytes=600)


async def _echo(request: Request) -> Response:
    body = await request.body()
    return Response(200, body, content_type="application/octet-stream", headers=(("x-len", str(len(body))),))


async def _json(request: Request) -> Response:
    value = await request.json()
    return Response(200, json.dumps({"got": value, "q": request.header("x-q")}).encode())


async def _teapot(request: Request) -> Response:
    raise HTTPError(418, "short and stout", headers=(("x-why", "tea"),))


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug in a route")


async def _cookie(request: Request) -> Response:
    return Response(200, b"{}", headers=(("set-cookie", "flavour=oat; Path=/"),))


async def _redirect(request: Request) -> Response:
    return Response(307, b"", content_type=None, headers=(("location", "/json"),))


APP = HTTPApp(
    {
        ("POST", "/echo"): _echo,
        ("PUT", "/echo"): _echo,
        ("POST", "/json"): _json,
        ("GET", "/json"): _json,
        ("POST", "/teapot"): _teapot,
        ("GET", "/boom"): _boom,
        ("GET", "/cookie"): _cookie,
        ("GET", "/redirect"): _redirect,
    },
    limits=LIMITS,
    error_body=lambda status, message: json.dumps({"status": status, "message": message}).encode(),
)


def _answer(r: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    return r.status_code, sorted(r.headers.multi_items()), r.content


class Chunks(httpx.AsyncByteStream):
    """A streamed body in 7-byte chunks (an iterator object: nothing left to finalize if unread)."""

    def __init__(self, body: bytes) -> None:
        self.parts = [body[i : i + 7] for i in range(0, len(body), 7)]

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        if not self.parts:
            raise StopAsyncIteration
        return self.parts.pop(0)


requests = st.fixed_dictionaries(
    {
        "method": st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
        "path": st.sampled_from(["/echo", "/json", "/teapot", "/boom", "/cookie", "/nowhere", "/echo/", "/json?x=1"]),
        "body": st.one_of(st.binary(max_size=100), st.sampled_from([b'{"a": [1, 2]}', b"[", b'"\xff"', b"  ", b"[" * 40 + b"]" * 40])),
        "streamed": st.booleans(),
        "header": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=700),
    }
)


@given(requests)
@settings(max_examples=150, deadline=None)
def test_the_in_process_transport_and_client_answer_every_request_as_the_asgi_app_does(req: dict[str, Any]) -> None:
    """For any method, path, body (whole or streamed) and header size: the same status,
    headers and body through InProcessTransport, through InProcessClient and through
    ``httpx.ASGITransport`` (404, 405, 413, 431, 400 for bad JSON, 418, 500 included)."""

    async def main() -> None:
        answers = []
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=APP), base_url="http://t"),
            httpx.AsyncClient(transport=InProcessTransport(APP), base_url="http://t"),
            InProcessClient(APP, base_url="http://t"),
        ]
        for client in clients:
            async with client:
                headers = {"x-q": req["header"]}
                if req["streamed"]:  # no content-length: transfer-encoding chunked
                    request = httpx.Request(req["method"], "http://t" + req["path"], stream=Chunks(req["body"]), headers=headers)
                    r = await client.send(request)
                else:
                    r = await client.request(req["method"], req["path"], content=req["body"], headers=headers)
                answers.append(_answer(r))
        assert answers[1] == answers[0]
        assert answers[2] == answers[0]

    trio.run(main)


async def test_the_head_limit_falls_at_the_same_byte_with_a_query_string() -> None:
    """Every header size around max_header_bytes, on a path with a query: 431 from the same size on."""
    statuses: dict[str, list[int]] = {"asgi": [], "in_process": []}
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=APP), base_url="http://t") as asgi,
        InProcessClient(APP, base_url="http://t") as in_process,
    ):
        for size in range(400, 600):
            for name, client in (("asgi", asgi), ("in_process", in_process)):
                r = await client.post("/json?x=1", content=b"1", headers={"x-q": "q" * size})
                statuses[name].append(r.status_code)
    assert statuses["in_process"] == statuses["asgi"]
    assert set(statuses["asgi"]) == {200, 431}


async def test_a_streamed_body_past_the_limit_is_refused_without_reading_the_rest() -> None:
    """413 once the body passes max_body_bytes; the stream is read one chunk past the limit at most."""
    read = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal read
        while True:
            read += 10
            yield b"x" * 10

    async with InProcessClient(APP, base_url="http://t") as client:
        r = await client.post("/echo", content=endless())
    assert r.status_code == 413
    assert r.json()["message"] == "body: over the limit of 64 bytes (max_body_bytes=64)"
    assert read == 70


async def test_the_client_short_path_leaves_the_response_as_httpx_does() -> None:
    """Read, closed, its elapsed time set, its request attached; stream=True leaves it to read."""
    async with InProcessClient(APP, base_url="http://t") as client:
        r = await client.post("/echo", content=b"hello")
        assert (r.content, r.is_closed, r.is_stream_consumed, r.request.url.path) == (b"hello", True, True, "/echo")
        assert r.elapsed.total_seconds() >= 0
        async with client.stream("POST", "/echo", content=b"streamed") as s:
            assert not s.is_closed
            assert [part async for part in s.aiter_bytes()] == [b"streamed"]
        assert s.is_closed and s.elapsed.total_seconds() >= 0
    with pytest.raises(RuntimeError, match="closed"):
        await client.get("/json")


async def test_the_client_keeps_cookies_honours_auth_hooks_and_redirects() -> None:
    """What the short path skips comes back when asked for: a cookie the app sets is sent
    back, an auth header, request and response hooks run, a redirect is followed on request."""
    seen: list[str] = []

    async def on_request(request: httpx.Request) -> None:
        seen.append(f"request {request.url.path}")

    async def on_response(response: httpx.Response) -> None:
        seen.append(f"response {response.status_code}")

    async with InProcessClient(APP, base_url="http://t") as client:
        await client.get("/cookie")
        assert client.cookies.get("flavour") == "oat"
        r = await client.request("GET", "/json", content=b"1")
        assert r.request.headers["cookie"] == "flavour=oat"
        r = await client.request("GET", "/json", content=b"2", auth=httpx.BasicAuth("u", "p"))
        assert r.request.headers["authorization"] == httpx.BasicAuth("u", "p")._auth_header
        assert (await client.get("/redirect")).status_code == 307
        r = await client.request("GET", "/redirect", follow_redirects=True, content=b"3")
        assert (r.status_code, r.json()["got"], [h.status_code for h in r.history]) == (200, 3, [307])
    async with InProcessClient(APP, base_url="http://t", event_hooks={"request": [on_request], "response": [on_response]}) as client:
        await client.post("/teapot")
    assert seen == ["request /teapot", "response 418"]


async def test_the_client_merges_each_url_once_and_again_after_base_url_changes() -> None:
    """A relative URL is merged with base_url once and kept; a new base_url drops what was kept."""
    async with InProcessClient(APP, base_url="http://t/a/") as client:
        assert str(client.build_request("GET", "json").url) == "http://t/a/json"
        assert client._merge_url("json") is client._merge_url("json")  # parsed once
        client.base_url = "http://t/b/"
        assert str(client.build_request("GET", "json").url) == "http://t/b/json"


async def test_inline_agents_get_the_in_process_client_of_the_endpoint() -> None:
    """The endpoint's transport and client are the root-exported ones; an agent's httpx client is the short-path one."""
    endpoint = OpenAIEndpoint(texts_engine(["ok"]), TOKENIZER)
    transport = endpoint.in_process_transport()
    assert isinstance(transport, PublicTransport) and PublicTransport is InProcessTransport
    client = open_agent_client("httpx", transport, "http://agent/v1/")
    assert isinstance(client, PublicClient) and PublicClient is InProcessClient
    with endpoint.session() as s:
        async with client:
            r = await client.post(
                "chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers={"authorization": f"Bearer {s.key}"}
            )
        assert r.json()["choices"][0]["message"]["content"] == "ok"
        assert len(s.interactions) == 1
