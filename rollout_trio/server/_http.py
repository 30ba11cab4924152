"""A small HTTP/1.1 server on Trio sockets and h11.

Enough for a JSON API on loopback: keep-alive, ``Content-Length`` bodies, one request at
a time per connection, and *disconnect detection*: while a handler runs, the connection
is watched, and a client that hangs up cancels its handler (the way SGLang aborts a
request whose client went away).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import attrs
import h11
import trio

__all__ = ["HttpServer", "Request", "Response", "json_response"]

log = logging.getLogger("rollout_trio.server")

MAX_BODY = 64 * 1024 * 1024
IDLE_TIMEOUT = 600.0  # seconds a keep-alive connection may sit idle
READ_TIMEOUT = 60.0  # seconds to receive one request once it started


@attrs.frozen
class Request:
    """An HTTP request with its whole body."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON (``None`` for an empty body); ``ValueError`` if it is not JSON."""
        if not self.body.strip():
            return None
        return json.loads(self.body)


@attrs.frozen
class Response:
    """An HTTP response with a complete body."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"


def json_response(data: Any, status: int = 200) -> Response:
    """A JSON response."""
    return Response(status, json.dumps(data, separators=(",", ":")).encode())


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """Serves ``handler`` on TCP listeners.

    A handler is cancelled when its client disconnects; exceptions it raises become a
    500 with ``{"error": {"message": ...}}``. A connection idle for ``idle_timeout`` s
    between requests, or taking over ``read_timeout`` s to send one, is closed.
    """

    def __init__(
        self, handler: Handler, *, idle_timeout: float = IDLE_TIMEOUT, read_timeout: float = READ_TIMEOUT
    ) -> None:
        self.handler = handler
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 picks a free port) until cancelled.

        ``task_status.started`` reports the listeners (``listener.socket.getsockname()``
        gives the bound port).
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(trio.serve_listeners, self._connection, [listener])
            task_status.started(listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BODY)
        try:
            async with stream:
                while True:
                    request = await self._read_request(conn, stream)
                    if request is None:
                        return
                    response, disconnected = await self._run_handler(request, conn, stream)
                    if disconnected:
                        return
                    await self._send(conn, stream, response)
                    if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                        return
                    try:
                        conn.start_next_cycle()
                    except h11.LocalProtocolError:
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, h11.ProtocolError, OSError):
            return  # the client went away, stalled past a timeout, or spoke broken HTTP: drop it

    async def _read_request(self, conn: h11.Connection, stream: trio.SocketStream) -> Request | None:
        head: h11.Request | None = None
        chunks: list[bytes] = []
        timeout = self.idle_timeout
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                with trio.fail_after(timeout):
                    data = await stream.receive_some(65536)
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                head = event
                timeout = self.read_timeout
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                target = head.target.decode("latin-1")
                parts = urlsplit(target)
                return Request(
                    method=head.method.decode("ascii"),
                    path=parts.path,
                    query=dict(parse_qsl(parts.query)),
                    headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers},
                    body=b"".join(chunks),
                )
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    async def _run_handler(
        self, request: Request, conn: h11.Connection, stream: trio.SocketStream
    ) -> tuple[Response, bool]:
        disconnected = False
        response = Response(500, b"")

        async def watch(cancel: trio.CancelScope) -> None:
            nonlocal disconnected
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if data:
                conn.receive_data(data)  # a pipelined request: keep it, stop watching
                return
            disconnected = True
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:
                response = await self.handler(request)
            except Exception as exc:  # a bug in a handler must not kill the server
                log.exception("handler for %s %s failed", request.method, request.path)
                response = json_response({"error": {"message": f"{type(exc).__name__}: {exc}"}}, 500)
            nursery.cancel_scope.cancel()
        return response, disconnected

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, response: Response) -> None:
        headers = [("content-length", str(len(response.body)))]
        if response.body or response.content_type != "application/json":
            headers.append(("content-type", response.content_type))
        data = conn.send(h11.Response(status_code=response.status, headers=headers))
        data += conn.send(h11.Data(data=response.body)) if response.body else b""
        data += conn.send(h11.EndOfMessage())
        await stream.send_all(data)
