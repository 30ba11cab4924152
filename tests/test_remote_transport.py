"""TrioTransport: HTTP/1.1 framing, keep-alive pooling, stale connections, cancel = disconnect."""

from __future__ import annotations

import httpx
import pytest
import trio

from rollout_trio.engines._transport import TrioTransport


class RawServer:
    """Answers each request on a connection with the next scripted raw bytes."""

    def __init__(self, *answers: bytes, close_after: int | None = None) -> None:
        self.answers = list(answers)
        self.close_after = close_after
        self.connections = 0
        self.disconnects = 0
        self.port = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._conn, listeners)

    async def _conn(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        served = 0
        async with stream:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        self.disconnects += 1
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
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
                for _ in range(3):
                    out.append(await client.get(f"http://127.0.0.1:{server.port}/"))
                    await trio.sleep(0.05)  # let the close arrive
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
