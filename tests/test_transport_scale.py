"""TrioTransport with more servers than connections (a fleet larger than the file
descriptors allow): making room by closing another server's idle connection takes
constant work, not a walk over every server's pool (an O(N^2) per fan-out at 10,000
servers). Stated without timing: the number of times any server's idle stack is tested
for emptiness, per request."""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any

import pytest
import trio

from rollout_trio.engines import _transport
from rollout_trio.engines._transport import ConnectionLimits, TrioTransport

SERVERS = 240
CAP = 40


class CountingDeque(deque):  # type: ignore[type-arg]
    tests = 0

    def __len__(self) -> int:  # ``if idle``, ``while idle`` and ``len(idle)`` all land here
        CountingDeque.tests += 1
        return super().__len__()


class CountingOrigin(_transport._Origin):
    __slots__ = ()

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.idle = CountingDeque()


async def answer(stream: trio.SocketStream) -> None:
    """An empty 200 to every request, keep-alive."""
    buf = b""
    try:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
            while b"\r\n\r\n" in buf:
                _, buf = buf.split(b"\r\n\r\n", 1)
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    except trio.BrokenResourceError:
        return


async def test_making_room_for_a_connection_never_walks_every_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_transport, "_Origin", CountingOrigin)
    async with trio.open_nursery() as servers:
        ports = []
        for _ in range(SERVERS):
            listeners = await servers.start(partial(trio.serve_tcp, answer, 0, host="127.0.0.1"))
            ports.append(listeners[0].socket.getsockname()[1])
        transport = TrioTransport(limits=ConnectionLimits(max_connections=CAP))
        request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        timeouts: dict[str, Any] = {}

        async def fan_out() -> None:
            async with trio.open_nursery() as nursery:
                for port in ports:
                    nursery.start_soon(transport.exchange, ("127.0.0.1", port), request, timeouts)

        await fan_out()  # every server's pool made; idle connections evicted to make room
        CountingDeque.tests = 0
        for _ in range(2):
            await fan_out()
        per_request = CountingDeque.tests / (2 * SERVERS)
        assert transport._idle_count <= CAP
        await transport.aclose()
        servers.cancel_scope.cancel()
    assert per_request <= 8, f"{per_request:.1f} idle-stack tests per request with {SERVERS} servers, {CAP} connections"
