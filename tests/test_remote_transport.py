"""TrioTransport: HTTP/1.1 framing, keep-alive pooling, stale connections, cancel = disconnect."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio

from rollout_trio import EngineConnectError, EngineProtocolError, EngineServerError, EngineTimeoutError
from rollout_trio.engines._remote_http import HttpSession
from rollout_trio.engines._remote_wire import HttpCall
from rollout_trio.engines._transport import TrioTransport, _Conn, _Origin


class RawServer:
    """Answers each request on a connection with the next scripted raw bytes."""

    def __init__(self, *answers: bytes, close_after: int | None = None) -> None:
        self.answers = list(answers)
        self.close_after = close_after
        self.connections = 0
        self.disconnects = 0
        self.closed = 0  # connections this server has closed
        self.port = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._conn, listeners)

    async def _conn(self, stream: trio.SocketStream) -> None:
        try:
            await self._serve(stream)
        finally:
            self.closed += 1

    async def _read_head(self, stream: trio.SocketStream, buf: bytes) -> tuple[bytes, bytes] | None:
        """The next request head and the bytes after it; None (counted) if the client left."""
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                self.disconnects += 1
                return None
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        return head, rest

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        served = 0
        async with stream:
            buf = b""
            while True:
                got = await self._read_head(stream, buf)
                if got is None:
                    return
                head, buf = got
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        length = int(v)
                while len(buf) < length:
                    buf += await stream.receive_some(65536)
                buf = buf[length:]
                answer = self.answers.pop(0) if self.answers else b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                if answer == b"STALL":
                    if not await stream.receive_some(65536):
                        self.disconnects += 1
                    return
                await stream.send_all(answer)
                served += 1
                _, _, body = answer.rpartition(b"\r\n\r\n")
                if body and b"content-length" not in answer and b"chunked" not in answer:
                    return  # a read-to-close body ends with the connection
                if self.close_after is not None and served >= self.close_after:
                    return


async def exchange(server: RawServer, n: int = 1, method: str = "POST") -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=TrioTransport()) as client:
        return [await client.request(method, f"http://127.0.0.1:{server.port}/x", json={"a": 1}) for _ in range(n)]


async def with_server(server: RawServer, fn):  # type: ignore[no-untyped-def]
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        try:
            return await fn()
        finally:
            nursery.cancel_scope.cancel()


async def test_keep_alive_reuses_one_connection() -> None:
    server = RawServer()
    with trio.fail_after(5):
        rs = await with_server(server, lambda: exchange(server, 5))
    assert [r.text for r in rs] == ["ok"] * 5 and server.connections == 1


async def test_chunked_and_close_delimited_bodies() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4;x=y\r\nabcd\r\n3\r\nefg\r\n0\r\nt: 1\r\n\r\n"
    tail = b"HTTP/1.1 200 OK\r\n\r\nuntil-close"
    server = RawServer(b"HTTP/1.1 100 Continue\r\n\r\n" + chunked, tail)
    with trio.fail_after(5):
        rs = await with_server(server, lambda: exchange(server, 3))
    assert [r.content for r in rs] == [b"abcdefg", b"until-close", b"ok"]
    assert server.connections == 2  # the read-to-close answer ended its connection


async def test_server_closing_idle_connection_is_detected() -> None:
    server = RawServer(close_after=1)
    with trio.fail_after(5):

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(transport=TrioTransport()) as client:
                out = []
                for i in range(3):
                    out.append(await client.get(f"http://127.0.0.1:{server.port}/"))
                    while server.closed <= i:  # the server has closed it (on loopback: arrived)
                        await trio.sleep(0.001)
                return out

        rs = await with_server(server, run)
    assert [r.status_code for r in rs] == [200] * 3 and server.connections == 3


@pytest.mark.parametrize(
    "answer, error",
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", httpx.RemoteProtocolError),
        (b"garbage\r\n\r\n", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", httpx.RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", httpx.RemoteProtocolError),
        (b"", httpx.RemoteProtocolError),
    ],
)
async def test_broken_answers_raise_httpx_errors(answer: bytes, error: type[Exception]) -> None:
    server = RawServer(answer, close_after=1)
    with trio.fail_after(5):
        with pytest.RaisesGroup(error):  # raised inside the server's nursery
            await with_server(server, lambda: exchange(server))


async def test_cancel_closes_the_connection() -> None:
    server = RawServer(b"STALL")
    with trio.fail_after(5):

        async def run() -> None:
            with trio.move_on_after(0.2):
                await exchange(server)
            with trio.fail_after(2):
                while not server.disconnects:
                    await trio.sleep(0.01)

        await with_server(server, run)
    assert server.disconnects == 1


async def test_a_cancelled_caller_sends_nothing_even_on_a_kept_connection() -> None:
    """The transport writes with the socket's own send (no Trio checkpoint there): an
    exchange entered already cancelled raises Cancelled before it writes a byte."""
    server = RawServer()
    seen: list[int] = []

    async def run() -> None:
        async with httpx.AsyncClient(transport=TrioTransport()) as client:
            url = f"http://127.0.0.1:{server.port}/x"
            assert (await client.post(url, json={})).content == b"ok"  # one kept connection
            with trio.CancelScope() as scope:
                scope.cancel()
                await client.post(url, json={})
            assert scope.cancelled_caught
            assert (await client.post(url, json={})).content == b"ok"  # the connection was not spoiled
            seen.append(server.connections)

    with trio.fail_after(5):
        await with_server(server, run)
    assert seen == [1] and server.answers == []


async def test_an_exchange_is_a_checkpoint_even_when_the_answer_is_already_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Invariant (Trio's checkpoint rule): exchange is a cancel point and a schedule point
    even when the answer was waiting in the socket, so no read had to wait."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        theirs.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        monkeypatch.setattr(_Conn, "stale", lambda self: False)  # the waiting answer would make it stale
        transport = TrioTransport()
        pool = transport._origins[("peer", 1)] = _Origin(1)
        transport._keep(pool, _Conn(trio.SocketStream(trio.socket.from_stdlib_socket(mine))))
        try:
            with trio.testing.assert_checkpoints():
                answer = await transport.exchange(("peer", 1), b"GET / HTTP/1.1\r\nhost: peer\r\n\r\n", {})
        finally:
            await transport.aclose()
        assert (answer.status, answer.content) == (200, b"ok")
        assert theirs.recv(100).startswith(b"GET / HTTP/1.1")


async def test_connect_errors_and_scheme() -> None:
    with trio.fail_after(5):
        async with httpx.AsyncClient(transport=TrioTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get("http://127.0.0.1:1/")
            with pytest.raises(httpx.UnsupportedProtocol):
                await client.get("https://127.0.0.1:1/")
            with pytest.raises(httpx.LocalProtocolError):
                await client.get("http://127.0.0.1:1/", headers={"x": "a\r\nb"})


async def test_head_and_204_have_no_body() -> None:
    server = RawServer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", b"HTTP/1.1 204 No Content\r\n\r\n")
    with trio.fail_after(5):

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(transport=TrioTransport()) as client:
                url = f"http://127.0.0.1:{server.port}/"
                return [await client.head(url), await client.delete(url), await client.get(url)]

        rs = await with_server(server, run)
    assert [(r.status_code, r.content) for r in rs] == [(200, b""), (204, b""), (200, b"ok")]
    assert server.connections == 1


async def test_encoded_bodies_are_decoded_and_plain_ones_read_once() -> None:
    packed = gzip.compress(b'{"a": 1}')
    server = RawServer(
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(packed), packed),
        b'HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n{"b": 2}',
    )
    with trio.fail_after(5):
        rs = await with_server(server, lambda: exchange(server, 2))
    assert [r.json() for r in rs] == [{"a": 1}, {"b": 2}]
    assert all(r.is_closed and r.is_stream_consumed for r in rs)
    assert rs[1].headers["content-length"] == "8" and rs[1].http_version == "HTTP/1.1"


async def test_the_sessions_own_framing_decodes_an_encoded_answer_however_the_header_is_spelled() -> None:
    """HttpSession's direct path reads a plain answer's bytes as they came and decodes any
    answer carrying a Content-Encoding header (the transport notes the header, whatever its case)."""
    packed = gzip.compress(b'{"a": 1}')
    server = RawServer(
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(packed), packed),
        b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(packed), packed),
        b'HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n{"b": 2}',
    )

    async def calls() -> list[Any]:
        transport = TrioTransport()
        async with httpx.AsyncClient(transport=transport, timeout=None) as client:
            session = HttpSession(client, transport)
            base = f"http://127.0.0.1:{server.port}"
            return [await session.call(base, HttpCall("POST", "/x", {}), timeout=5, direct=True) for _ in range(3)]

    with trio.fail_after(5):
        assert await with_server(server, calls) == [{"a": 1}, {"a": 1}, {"b": 2}]
    assert server.connections == 1


# --------------------------------------------------------------------- HttpSession: client and direct paths

BASE = "http://127.0.0.1:9"


async def session_call(transport: httpx.AsyncBaseTransport, call: HttpCall, *, direct: bool, **kw: Any) -> Any:
    kw.setdefault("timeout", 5.0)
    async with httpx.AsyncClient(transport=transport, timeout=None) as client:
        return await HttpSession(client, transport).call(BASE, call, direct=direct, **kw)


@pytest.mark.parametrize("direct", [True, False])
async def test_session_sends_the_same_request_on_both_paths(direct: bool) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": 1})

    transport = httpx.MockTransport(handler)
    assert await session_call(transport, HttpCall("POST", "/generate", {"a": [1, 2]}), direct=direct) == {"ok": 1}
    pause_call = HttpCall("POST", "/pause", None, {"mode": "abort"})
    assert await session_call(transport, pause_call, direct=direct) == {"ok": 1}
    assert await session_call(transport, HttpCall("GET", "/health"), direct=direct, expect_json=False) is None
    post, pause, health = seen
    assert (post.method, str(post.url)) == ("POST", BASE + "/generate")
    assert json.loads(post.content) == {"a": [1, 2]}
    assert post.headers["host"] == "127.0.0.1:9"
    assert post.headers["content-type"] == "application/json"
    assert post.headers["content-length"] == str(len(post.content))
    assert post.extensions["timeout"] == httpx.Timeout(None).as_dict()
    assert (str(pause.url), pause.content, pause.headers["content-length"]) == (BASE + "/pause?mode=abort", b"", "0")
    assert "content-type" not in pause.headers
    assert health.method == "GET" and "content-length" not in health.headers


def _raises(exc: Callable[[], Exception]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc()

    return handler


def _answers(response: Callable[[], httpx.Response]) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: response()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    "handler, error",
    [
        (_raises(lambda: httpx.ConnectError("refused")), EngineConnectError),
        (_raises(lambda: httpx.ReadTimeout("slow")), EngineTimeoutError),
        (_raises(lambda: httpx.RemoteProtocolError("cut short")), EngineConnectError),
        (_answers(lambda: httpx.Response(503, json={"error": {"message": "busy"}})), EngineServerError),
        (_answers(lambda: httpx.Response(404, text="no such path")), EngineServerError),
        (_answers(lambda: httpx.Response(200, text="<html>")), EngineProtocolError),
    ],
)
async def test_session_maps_errors_alike_on_both_paths(direct: bool, handler: Any, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        await session_call(httpx.MockTransport(handler), HttpCall("POST", "/generate", {}), direct=direct)
    assert f"POST {BASE}/generate" in str(info.value)
    if error in (EngineConnectError, EngineTimeoutError):
        assert isinstance(info.value.__cause__, httpx.TransportError)
    if error is EngineServerError:
        assert info.value.status_code in (503, 404)  # type: ignore[attr-defined]
        assert "busy" in str(info.value) or "no such path" in str(info.value)


async def _stall(request: httpx.Request) -> httpx.Response:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("direct", [True, False])
async def test_session_timeout_bounds_a_stalled_answer(direct: bool, autojump_clock: trio.abc.Clock) -> None:
    with pytest.raises(EngineTimeoutError, match="no complete answer within 30 s"):
        await session_call(httpx.MockTransport(_stall), HttpCall("POST", "/generate", {}), direct=direct, timeout=30)


@pytest.mark.parametrize("direct", [True, False])
async def test_session_leaves_the_callers_cancellation_alone(direct: bool, autojump_clock: trio.abc.Clock) -> None:
    with trio.move_on_after(1) as scope:
        await session_call(httpx.MockTransport(_stall), HttpCall("POST", "/generate", {}), direct=direct, timeout=60)
    assert scope.cancelled_caught  # Cancelled went through, not mapped to an EngineError


class StreamingTransport(httpx.AsyncBaseTransport):
    """Answers with a body still to be read (as httpx's own transports do)."""

    def __init__(self, *chunks: bytes, fail: bool = False) -> None:
        self.chunks = chunks
        self.fail = fail
        self.closed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self

        class Body(httpx.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                for chunk in transport.chunks:
                    yield chunk
                if transport.fail:
                    raise httpx.ReadError("connection reset")

            async def aclose(self) -> None:
                transport.closed += 1

        return httpx.Response(200, stream=Body())


async def test_direct_path_reads_and_closes_a_streamed_answer() -> None:
    ok = StreamingTransport(b'{"a": ', b"1}")
    assert await session_call(ok, HttpCall("POST", "/generate", {}), direct=True) == {"a": 1}
    assert ok.closed == 1
    broken = StreamingTransport(b'{"a": ', fail=True)
    with pytest.raises(EngineConnectError) as info:
        await session_call(broken, HttpCall("POST", "/generate", {}), direct=True)
    assert isinstance(info.value.__cause__, httpx.ReadError) and broken.closed >= 1


# --------------------------------------------------------------------- malformed answers (h11 framing)

EVIL = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nEVIL"  # an answer to no request

MALFORMED = {
    "conflicting content-length": b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 5\r\n\r\nabcde",
    "content-length +3": b"HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\nabc",
    "content-length 1_0": b"HTTP/1.1 200 OK\r\ncontent-length: 1_0\r\n\r\n0123456789",
    "content-length -1": b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    "content-length with spaces inside": b"HTTP/1.1 200 OK\r\ncontent-length: 1 0\r\n\r\n0123456789",
    "transfer-encoding xchunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: xchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "transfer-encoding gzip, chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "chunk size +3": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n+3\r\nabc\r\n0\r\n\r\n",
    "chunk size 0x3": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
    "chunk without its CRLF": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n",
    "truncated body": b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",
    "truncated chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
    "status line garbage": b"HTTP/1.1 2OO OK\r\ncontent-length: 0\r\n\r\n",
    "header without a colon": b"HTTP/1.1 200 OK\r\nbad header\r\ncontent-length: 0\r\n\r\n",
}


TRUNCATED = {"truncated body", "truncated chunk"}


class CorpusServer(RawServer):
    """Sends one scripted answer, then an answer to no request (a truncated one: closes)."""

    def __init__(self, answer: bytes, *, truncated: bool) -> None:
        super().__init__(answer if truncated else answer + EVIL, close_after=1)


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_answers_raise_and_never_leak_into_the_next_request(name: str) -> None:
    server = CorpusServer(MALFORMED[name], truncated=name in TRUNCATED)

    async def run() -> tuple[list[BaseException], httpx.Response]:
        errors: list[BaseException] = []
        async with httpx.AsyncClient(transport=TrioTransport()) as client:
            url = f"http://127.0.0.1:{server.port}/x"
            try:
                bad = await client.post(url, json={"a": 1})
            except httpx.RemoteProtocolError as exc:
                errors.append(exc)
            else:
                raise AssertionError(f"accepted {bad.status_code} {bad.content!r}")
            return errors, await client.post(url, json={"a": 2})

    with trio.fail_after(5):
        errors, after = await with_server(server, run)
    assert len(errors) == 1
    assert after.content == b"ok"  # the next request's own answer, on a new connection
    assert server.connections == 2


async def test_a_late_answer_to_no_request_on_an_idle_connection_is_never_read() -> None:
    """Bytes a server writes on an idle keep-alive connection retire it."""
    sent = trio.Event()

    class Late(RawServer):
        async def _conn(self, stream: trio.SocketStream) -> None:
            self.connections += 1
            async with stream:
                first = self.connections == 1
                await stream.receive_some(65536)
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfirst")
                if first:
                    await stream.send_all(EVIL)
                    sent.set()
                    with contextlib.suppress(trio.BrokenResourceError):  # a reset: EVIL was never read
                        await stream.receive_some(65536)  # until the client drops it
                    return
                await stream.send_all(b"")

    server = Late()

    async def run() -> list[bytes]:
        async with httpx.AsyncClient(transport=TrioTransport()) as client:
            url = f"http://127.0.0.1:{server.port}/x"
            one = await client.get(url)
            await sent.wait()  # on loopback, the unsolicited bytes are in our socket's buffer now
            two = await client.get(url)
            return [one.content, two.content]

    with trio.fail_after(5):
        assert await with_server(server, run) == [b"first", b"first"]
    assert server.connections == 2


async def test_http_1_0_close_framing_reads_to_close_and_never_reuses() -> None:
    server = RawServer(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil close", b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nhi")
    with trio.fail_after(5):
        rs = await with_server(server, lambda: exchange(server, 3))
    assert [r.content for r in rs] == [b"until close", b"hi", b"ok"]
    assert [r.http_version for r in rs] == ["HTTP/1.0", "HTTP/1.0", "HTTP/1.1"]
    assert server.connections == 3  # HTTP/1.0 without keep-alive closes after each answer


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000,
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"64\r\n" + b"x" * 100 + b"\r\n" + b"64\r\n" + b"y" * 100 + b"\r\n0\r\n\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_response_bodies_are_bounded(answer: bytes) -> None:
    assert TrioTransport().max_body_bytes == 64 * 1024 * 1024
    server = RawServer(answer, close_after=1)

    async def run() -> Any:
        transport = TrioTransport(max_body_bytes=150)
        async with httpx.AsyncClient(transport=transport, timeout=None) as client:
            with pytest.raises(EngineProtocolError, match="max_body_bytes=150"):
                await HttpSession(client, transport).call(
                    f"http://127.0.0.1:{server.port}", HttpCall("POST", "/generate", {}), timeout=5, direct=True
                )
            return (await client.get(f"http://127.0.0.1:{server.port}/")).content

    with trio.fail_after(5):
        assert await with_server(server, run) == b"ok"
    assert server.connections == 2


def test_transport_uses_only_httpx_public_api() -> None:
    import inspect

    from rollout_trio.engines import _transport

    source = inspect.getsource(_transport)
    assert "._content" not in source and "response._" not in source


# --------------------------------------------------------------------- connection limits and local errors

# A client process with few file descriptors: 400 requests at once to one healthy server,
# through the default pool, then through one without a cap. Prints, per pool, what became
# of each request and which servers the engine marked down.
LOW_FD_CLIENT = r"""
import collections, json, resource, sys
import trio
from rollout_trio import EngineError, GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine, RetryPolicy, TrioTransport

address, fds = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (fds, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

async def run(transport):
    outcomes = collections.Counter()
    async with RemoteEngine(address, "sglang", transport=transport, retry=RetryPolicy(attempts=1), health_interval=3600) as engine:
        async def one():
            try:
                await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=2)))
                outcomes["ok"] += 1
            except EngineError as exc:
                outcomes[type(exc).__name__] += 1
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(400):
                    nursery.start_soon(one)
        return {"outcomes": outcomes, "down": [s.base_url for s in engine.servers if not s.up]}

async def main():
    out = {"default": await run(TrioTransport())}
    try:
        from rollout_trio.engines import ConnectionLimits
    except ImportError:  # no limits to lift
        out["uncapped"] = await run(TrioTransport())
    else:
        out["uncapped"] = await run(TrioTransport(limits=ConnectionLimits(max_connections=100_000)))
    print(json.dumps(out))

trio.run(main)
"""


async def test_out_of_file_descriptors_waits_or_fails_locally_and_never_blames_the_server() -> None:
    """With 96 fds, 400 requests at once to a healthy server: the default pool caps connections
    below the limit, so all succeed; a pool without a cap runs out, and those requests fail
    as EngineLocalError. Either way the server is never marked down."""
    import os
    import sys

    from .conftest_remote import ROOT, FakeServer, default_reply, sglang_body

    async def script(method: str, path: str, body: Any) -> Any:
        if path == "/generate":
            return 200, sglang_body([7, 8])
        return await default_reply(method, path, body)

    server = FakeServer(script)
    env = {**os.environ, "PYTHONPATH": ROOT}
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            done = await trio.run_process(
                [sys.executable, "-c", LOW_FD_CLIENT, server.address, "96"],
                capture_stdout=True, capture_stderr=True, env=env, check=False,
            )
            nursery.cancel_scope.cancel()
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert result["default"] == {"outcomes": {"ok": 400}, "down": []}
    uncapped = result["uncapped"]
    assert uncapped["down"] == []
    outcomes = uncapped["outcomes"]
    assert set(outcomes) <= {"ok", "EngineLocalError"} and outcomes.get("EngineLocalError", 0) > 0, outcomes
    assert sum(outcomes.values()) == 400


class HoldServer(RawServer):
    """Answers "ok" to every request, but only once ``release`` is set; counts requests held."""

    def __init__(self) -> None:
        super().__init__()
        self.release = trio.Event()
        self.held = 0

    async def _serve(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream:
            while True:
                if await self._read_head(stream, b"") is None:
                    return
                self.held += 1
                await self.release.wait()
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")


async def test_requests_beyond_the_per_server_limit_wait_for_a_connection() -> None:
    from rollout_trio.engines import ConnectionLimits

    server = HoldServer()

    async def run() -> list[int]:
        limits = ConnectionLimits(max_connections_per_server=2)
        async with httpx.AsyncClient(transport=TrioTransport(limits=limits)) as client:
            url = f"http://127.0.0.1:{server.port}/"
            codes: list[int] = []

            async def one() -> None:
                codes.append((await client.get(url)).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(one)
                while server.held < 2:
                    await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert (server.connections, server.held) == (2, 2)  # three requests wait for a slot
                server.release.set()
            return codes

    with trio.fail_after(5):
        assert await with_server(server, run) == [200] * 5
    assert server.connections == 2  # the waiting requests reused the two connections


async def test_waiting_for_a_slot_is_bounded_by_the_pool_timeout() -> None:
    from rollout_trio.engines import ConnectionLimits

    server = HoldServer()

    async def run() -> None:
        transport = TrioTransport(limits=ConnectionLimits(max_connections_per_server=1))
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5, pool=0.05)) as client:
            url = f"http://127.0.0.1:{server.port}/"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.get, url)
                while server.held < 1:
                    await trio.sleep(0.001)
                with pytest.raises(httpx.PoolTimeout):
                    await client.get(url)
                server.release.set()

    with trio.fail_after(5):
        await with_server(server, run)
    assert server.connections == 1


async def test_idle_connections_expire_and_extra_ones_close(mock_clock: trio.testing.MockClock) -> None:
    from rollout_trio.engines import ConnectionLimits

    server = HoldServer()
    server.release.set()

    async def run() -> None:
        limits = ConnectionLimits(max_keepalive_per_server=1, keepalive_expiry=4.0)
        async with httpx.AsyncClient(transport=TrioTransport(limits=limits)) as client:
            url = f"http://127.0.0.1:{server.port}/"
            await client.get(url)
            mock_clock.jump(3.9)
            await client.get(url)  # still fresh: reused
            assert server.connections == 1
            mock_clock.jump(4.1)
            await client.get(url)  # expired: closed, and a new connection made
            assert server.connections == 2
            while server.disconnects < 1:
                await trio.sleep(0)
            async with trio.open_nursery() as nursery:  # two at once: two connections, one kept
                for _ in range(2):
                    nursery.start_soon(client.get, url)
            while server.disconnects < 2:
                await trio.sleep(0)
            assert server.connections == 3

    with trio.fail_after(60):  # on the mock clock, which the test moves by 8 s
        await with_server(server, run)


def test_connection_limits_are_checked() -> None:
    from rollout_trio.engines import ConnectionLimits

    with pytest.raises(ValueError, match="max_connections_per_server"):
        ConnectionLimits(max_connections_per_server=0)
    with pytest.raises(ValueError, match="keepalive_expiry"):
        ConnectionLimits(keepalive_expiry=0)
    assert TrioTransport(limits=ConnectionLimits(max_connections=7)).max_connections == 7
