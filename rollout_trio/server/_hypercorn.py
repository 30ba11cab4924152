"""Serving an ASGI app on Hypercorn's Trio worker, with a cap on open connections.

Hypercorn does the HTTP (h11 framing, head size, keep-alive, graceful close); this module
only owns the listening sockets so that it can count connections: beyond
``limits.max_connections`` a new connection is answered 503 and closed at once, so a
flood of idle sockets cannot exhaust the server's file descriptors.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

import trio
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import wrap_app
from starlette.types import ASGIApp

from ._asgi import ServerLimits

__all__ = ["serve_app"]

log = logging.getLogger("rollout_trio.server")

_BUSY_BODY = b'{"error":{"message":"too many open connections (max_connections)","code":503}}'
# A fixed answer sent before any request was read (no parser is involved).
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _SlotStream:
    """A connection's stream that gives its slot back when closed or when the peer leaves.

    When a client closes an idle keep-alive connection, Hypercorn's connection task (and
    its socket) lingers until the keep-alive timer ends; the socket is closed and the slot
    freed as soon as the end of the stream is read instead.
    """

    def __init__(self, stream: trio.SocketStream, slots: trio.Semaphore) -> None:
        self._stream = stream
        self._slots: trio.Semaphore | None = slots

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)

    def free(self) -> None:
        """Give the slot back (once)."""
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._stream.receive_some(max_bytes)
        if not data:  # the peer is gone: nothing more can be answered on this connection
            await self.aclose()
        return data

    async def aclose(self) -> None:
        self.free()
        await self._stream.aclose()


def hypercorn_config(limits: ServerLimits, *, graceful_timeout: float = 10.0) -> Config:
    """Hypercorn's settings for ``limits`` (logging through ``rollout_trio.server``)."""
    config = Config()
    config.keep_alive_timeout = limits.keep_alive_timeout
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.graceful_timeout = graceful_timeout
    config.errorlog = log
    config.accesslog = logging.getLogger("rollout_trio.server.access")
    config.include_server_header = False
    return config


async def serve_app(
    app: ASGIApp,
    host: str,
    port: int,
    limits: ServerLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    graceful_timeout: float = 10.0,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` (0: a free port) until ``shutdown_trigger`` returns.

    ``task_status.started`` reports the bound ``(host, port)`` pairs. On shutdown, new
    connections stop, idle ones close, and requests still running get
    ``graceful_timeout`` seconds to finish before they are cancelled.
    Cancelling the caller's scope stops everything at once.
    """
    config = hypercorn_config(limits, graceful_timeout=graceful_timeout)
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]  # Starlette's ASGI types
    context = WorkerContext(None)
    slots = trio.Semaphore(limits.max_connections)
    listeners = await trio.open_tcp_listeners(port, host=host)

    async def connection(stream: trio.SocketStream) -> None:
        try:
            slots.acquire_nowait()
        except trio.WouldBlock:
            log.warning("refused a connection: max_connections=%d are open", limits.max_connections)
            async with stream:
                try:
                    await stream.send_all(_BUSY)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            return
        counted = _SlotStream(stream, slots)
        try:
            await TCPServer(wrapped, config, context, ConnectionState({}), counted)  # type: ignore[arg-type]
        except Exception:
            # One connection's failure ends that connection, never the server: sglang-router
            # speaks HTTP/2 to its workers, and Hypercorn 0.18 closing an h2 connection
            # (send_eof) can race a stream's send_all into BusyResourceError.
            log.warning("a connection ended with an error", exc_info=True)
        finally:
            counted.free()

    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(partial(trio.serve_listeners, connection, listeners, handler_nursery=connections))
            task_status.started([listener.socket.getsockname()[:2] for listener in listeners])
            if shutdown_trigger is None:
                await trio.sleep_forever()
            await shutdown_trigger()
            accepting.cancel_scope.cancel()
        for listener in listeners:
            await listener.aclose()
        await context.terminated.set()  # idle keep-alive connections close now
        connections.cancel_scope.deadline = trio.current_time() + graceful_timeout
