"""Hostile servers against the engine's client side (issue 34, items 2 and 6).

A server, a router or anything answering the engine's HTTP calls is untrusted: every
decoded body is bounded after decompression (gzip, deflate, br, stacked), JSON of any
depth or encoding gives a typed error, and a router listing bad worker URLs costs those
entries only. Real servers on loopback (raw bytes written by the test), no mocks.
"""

from __future__ import annotations

import gzip
import logging
import tracemalloc
import zlib
from typing import Any

import brotli
import httpx
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollout_trio import EngineConnectError, EngineProtocolError, GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine, TrioTransport
from rollout_trio.engines._remote_http import HttpSession, RetryPolicy
from rollout_trio.engines._remote_wire import HttpCall
from rollout_trio.engines._routing import parse_worker_list

from .conftest_remote import FakeServer, Raw, Reply, default_reply, sglang_body

LIMIT = 64 * 1024
G = GenerationConfig(max_new_tokens=4)


def _compress(coding: str, data: bytes) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, compresslevel=6)
    if coding == "deflate":
        return zlib.compress(data)
    if coding == "raw-deflate":  # what some servers send as 'deflate'
        c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
        return c.compress(data) + c.flush()
    assert coding == "br"
    return brotli.compress(data, quality=5)


def encoded(payload: bytes, codings: list[str]) -> tuple[bytes, str]:
    """``payload`` with ``codings`` applied in order, and the Content-Encoding header for it."""
    for coding in codings:
        payload = _compress(coding, payload)
    return payload, ", ".join("deflate" if c == "raw-deflate" else c for c in codings)


def answer(body: bytes, coding: str, *, status: int = 200, chunked: bool = False) -> bytes:
    head = b"HTTP/1.1 %d X\r\nconnection: close\r\n" % status
    if coding:
        head += b"content-encoding: " + coding.encode() + b"\r\n"
    if chunked:
        pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        return head + b"transfer-encoding: chunked\r\n\r\n" + framed
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def padded_json(size: int) -> bytes:
    """A JSON object of about ``size`` bytes (mostly spaces: a few bytes once compressed)."""
    return b'{"ok": true' + b" " * max(0, size - 12) + b"}"


SIZES = [10, LIMIT // 2, LIMIT - 20, LIMIT + 1, 4 * LIMIT, 256 * LIMIT]
KINDS = ["json", "deep", "utf8", "unknown-coding", "corrupt", "truncated"]
CODINGS = ["gzip", "deflate", "raw-deflate", "br"]


def hostile_answers() -> st.SearchStrategy[tuple[int, str, tuple[str, ...], bool, float]]:
    """A server's answer, described (built by :func:`build`): a JSON body from far below
    to far above the limit, through 0-3 stacked codings, sometimes corrupted, cut short,
    deep, not UTF-8 or in an unknown coding; chunked or with a length."""
    return st.tuples(
        st.sampled_from(SIZES),
        st.sampled_from(KINDS),
        st.lists(st.sampled_from(CODINGS), max_size=3).map(tuple),
        st.booleans(),
        st.floats(0, 1, exclude_max=True),
    )


def build(spec: tuple[int, str, tuple[str, ...], bool, float]) -> tuple[bytes, str, Any]:
    """``(raw answer, 'ok' | 'too large' | 'bad' | 'any' | 'any value', expected value)`` for ``spec``."""
    size, kind, codings, chunked, where = spec
    payload = padded_json(size)
    if kind == "deep":
        depth = max(size // 2, 1100)  # past MAX_JSON_DEPTH always
        payload = b"[" * depth + b"]" * depth
    elif kind == "utf8":
        payload = b'{"text": "\xff\xfe' + b" " * size + b'"}'
    body, coding = encoded(payload, list(codings))
    if kind == "unknown-coding":
        return answer(body, coding + ", zstd" if coding else "zstd", chunked=chunked), "bad", None
    if kind == "corrupt" and codings:
        at = int(where * len(body))
        body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1 :]
        # Raw deflate and brotli carry no checksum (gzip's CRC-32 and zlib's Adler-32 do): a
        # flipped byte through those alone may decode to other valid JSON ({"h3": true}).
        unchecked = all(c in ("raw-deflate", "br") for c in codings)
        return answer(body, coding, chunked=chunked), "any value" if unchecked else "any", None
    if kind == "truncated" and codings:
        return answer(body[: int(where * len(body))], coding, chunked=chunked), "any", None
    if len(payload) > LIMIT or len(body) > LIMIT:
        return answer(body, coding, chunked=chunked), "too large", None
    if kind in ("deep", "utf8"):
        return answer(body, coding, chunked=chunked), "bad", None
    return answer(body, coding, chunked=chunked), "ok", {"ok": True}


def _length(buf: bytes) -> int:
    for line in buf.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


class RawServer:
    """Answers every request with the same raw bytes, then closes; a client that hangs up
    mid-answer (as it should, past its limit) is no error."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.port = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._conn, listeners)

    async def _conn(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                buf = b""
                while b"\r\n\r\n" not in buf or len(buf) < buf.index(b"\r\n\r\n") + 4 + _length(buf):
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                await stream.send_all(self.raw)
            except trio.BrokenResourceError:
                pass


async def _call_twice(raw: bytes) -> list[Any]:
    """The answer ``raw`` read through both of HttpSession's paths; errors returned."""
    server = RawServer(raw)
    out: list[Any] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        transport = TrioTransport(max_body_bytes=LIMIT)
        async with httpx.AsyncClient(transport=transport, timeout=None) as client:
            session = HttpSession(client, transport)
            for direct in (True, False):
                try:
                    out.append(await session.call(f"http://127.0.0.1:{server.port}", HttpCall("POST", "/generate", {}), timeout=10, direct=direct))
                except Exception as exc:  # noqa: BLE001 - the property inspects what came out
                    out.append(exc)
        nursery.cancel_scope.cancel()
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_answers())
@example((256 * LIMIT, "json", ("gzip",), False, 0.0))
@example((256 * LIMIT, "json", ("br",), True, 0.0))
@example((256 * LIMIT, "json", ("deflate", "gzip", "raw-deflate"), False, 0.0))
@example((10, "deep", (), False, 0.0))
@example((LIMIT // 2, "deep", ("gzip",), False, 0.0))
@example((10, "corrupt", ("raw-deflate",), False, 0.25))  # decodes to {"h3": true}: no checksum to fail
def test_any_answer_decodes_within_the_limit_or_is_a_protocol_error(spec: tuple[int, str, tuple[str, ...], bool, float]) -> None:
    """Invariant: whatever a server answers (bombs up to 256x the limit through stacked
    codings, corrupt or cut streams, deep JSON, invalid UTF-8, an unknown coding), both
    paths of HttpSession either return its JSON value, when it is valid and at most the
    limit once decoded, or raise EngineProtocolError (naming max_body_bytes when that
    was the rule broken), never anything else (a corrupt stream in codings without a
    checksum may decode to another JSON value); decoding holds a few times the limit."""
    raw, outcome, value = build(spec)
    tracemalloc.start()
    try:
        results = trio.run(_call_twice, raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for result in results:
        if outcome == "ok":
            assert result == value
        elif outcome == "any":
            assert result == {"ok": True} or isinstance(result, EngineProtocolError), repr(result)[:300]
        elif outcome == "any value":  # some JSON value, or the protocol error; never another exception
            assert isinstance(result, EngineProtocolError) or not isinstance(result, BaseException), repr(result)[:300]
        else:
            assert isinstance(result, EngineProtocolError), repr(result)[:300]
            if outcome == "too large":
                assert f"max_body_bytes={LIMIT}" in str(result)
    assert peak < 8 * LIMIT + len(raw) * 4 + 4 * 1024 * 1024


# --------------------------------------------------------------------- the engine's paths


def _engine(*addresses: str, **kw: Any) -> RemoteEngine:
    kw.setdefault("setup_timeout", 3)
    kw.setdefault("seed", 0)
    kw.setdefault("retry", RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.02))
    kw.setdefault("transport", TrioTransport(max_body_bytes=LIMIT))
    return RemoteEngine(list(addresses), "sglang", **kw) if addresses else RemoteEngine(**kw)


BOMB = answer(*encoded(padded_json(1024 * LIMIT), ["gzip"]))  # 64 MiB of JSON from ~64 KiB


def _script(**paths: Reply) -> Any:
    async def script(method: str, path: str, body: Any) -> Reply:
        if path in paths:
            return paths[path]
        if path == "/generate":
            return 200, sglang_body([7, 8, 9, 10])
        return await default_reply(method, path, body)

    return script


async def _serve(nursery: trio.Nursery, script: Any) -> FakeServer:
    server = FakeServer(script)
    await nursery.start(server.run)
    return server


async def test_a_gzip_bomb_as_a_generate_answer_is_a_protocol_error_naming_the_limit() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await _serve(nursery, _script(**{"/generate": Raw(BOMB)}))
            async with _engine(server.address) as eng:
                with pytest.raises(EngineProtocolError, match=f"max_body_bytes={LIMIT}"):
                    await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
            nursery.cancel_scope.cancel()
    assert len(server.paths("/generate")) == 1  # a protocol error: never retried


@pytest.mark.parametrize("path", ["/health", "/get_model_info"])
async def test_a_gzip_bomb_at_start_stops_the_engine_naming_the_limit(path: str) -> None:
    """On /health the engine used to start anyway (the bomb inflated whole); now the
    server never counts as healthy, and the error says why."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await _serve(nursery, _script(**{path: Raw(BOMB)}))
            with pytest.raises((EngineConnectError, EngineProtocolError), match=f"max_body_bytes={LIMIT}"):
                async with _engine(server.address, setup_timeout=1):
                    pass
            nursery.cancel_scope.cancel()


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "path, reply",
    [
        ("/generate", (200, DEEP)),
        ("/generate", (200, b'{"text": "\xff"}')),
        ("/generate", (500, DEEP)),  # an error status's body is read too
        ("/get_model_info", (200, DEEP)),
    ],
    ids=["deep-answer", "invalid-utf8", "deep-error-body", "deep-model-info"],
)
async def test_deep_or_invalid_json_from_a_server_is_a_typed_error(path: str, reply: Reply) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await _serve(nursery, _script(**{path: reply}))
            try:
                async with _engine(server.address, transport=TrioTransport()) as eng:
                    await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
            except EngineProtocolError as exc:
                assert "JSON" in str(exc) or "UTF-8" in str(exc)
            except Exception as exc:  # noqa: BLE001
                if reply[0] == 500:  # a server error carrying the (undecodable) body as text
                    from rollout_trio import EngineServerError

                    assert isinstance(exc, EngineServerError), repr(exc)
                else:
                    raise
            else:
                raise AssertionError("a hostile answer was accepted")
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------- the router's /workers

BAD_URLS = ["http://[::1", "http://a b:1", "http://h:99999", "ftp://h:1", "http://h:1/x?y", " ", "http://h:1\x00", "http://:1", "http://user@h:1"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(BAD_URLS), st.text(max_size=30), st.integers(), st.none()), max_size=6))
def test_parse_worker_list_keeps_the_good_urls_and_skips_the_rest(bad: list[Any]) -> None:
    """Invariant: whatever entries a router lists besides good ones, the good ones come
    back normalized, every other one is skipped, and nothing raises but
    EngineProtocolError for a body of the wrong shape."""
    good = ["http://127.0.0.1:30000", "127.0.0.2:30001"]
    workers: list[Any] = [{"url": good[0], "id": "a"}, *({"url": u} for u in bad), {"url": good[1]}]
    listed = parse_worker_list({"workers": workers}, "GET r/workers")
    urls = [u for u, _ in listed]
    assert urls[0] == "http://127.0.0.1:30000" and urls[-1] == "http://127.0.0.2:30001"
    for url in urls:
        httpx.URL(url + "/generate")  # every kept one builds a request
        assert url.startswith("http://")


@pytest.mark.parametrize("shape", ["workers", "urls"])
async def test_a_router_listing_bad_urls_costs_those_entries_only(shape: str, caplog: pytest.LogCaptureFixture) -> None:
    """At start and mid-run (check_fleet), a /workers list with malformed URLs is logged
    and skipped; the engine starts on the good worker and keeps generating."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            worker = await _serve(nursery, _script())
            good = f"http://{worker.address}"

            async def router(method: str, path: str, body: Any) -> Reply:
                if path == "/workers" and method == "GET":
                    urls = [*BAD_URLS, good]
                    if shape == "urls":
                        return 200, {"urls": urls}
                    return 200, {"workers": [{"url": u, "id": f"id{i}"} for i, u in enumerate(urls)]}
                return await _script()(method, path, body)

            gateway = await _serve(nursery, router)
            caplog.set_level(logging.WARNING, logger="rollout_trio")
            async with _engine(router=gateway.address, health_interval=3600) as eng:
                assert [s.base_url for s in eng.servers] == [good]
                await eng.check_fleet()  # the mid-run refresh reads the same list
                assert [s.base_url for s in eng.servers] == [good]
                resp = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
            nursery.cancel_scope.cancel()
    assert resp.output_tokens == (7, 8, 9, 10)
    assert any("skipped" in r.getMessage() for r in caplog.records)


async def test_a_gzip_bomb_as_the_routers_worker_list_is_a_protocol_error() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            gateway = await _serve(nursery, _script(**{"/workers": Raw(BOMB)}))
            with pytest.raises(EngineProtocolError, match=f"max_body_bytes={LIMIT}"):
                async with _engine(router=gateway.address, setup_timeout=2):
                    pass
            nursery.cancel_scope.cancel()
