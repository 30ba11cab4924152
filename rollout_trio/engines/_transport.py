"""``TrioTransport``: an httpx transport with an O(1) connection pool on Trio sockets.

httpx's default transport (httpcore) rescans every pooled connection on every request
event (``_assign_requests_to_connections``), so at 128 concurrent requests most of the
time goes to the pool. This transport keeps, per origin, a stack of idle keep-alive
connections: a request pops one (or dials a new one), and a connection whose exchange
completed cleanly is pushed back. Nothing else is ever scanned.

Every byte of HTTP/1.1 framing goes through h11 (one ``h11.Connection`` per socket):
conflicting or malformed ``Content-Length``, unknown transfer codings, bad chunk sizes
and truncated bodies are h11 protocol errors. A connection is reused only when h11 says
both sides finished the exchange cleanly *and* nothing was left over after the answer
(bytes after a complete response belong to no request); after any error it is closed.

Scope: HTTP/1.1 over plain TCP (``http://``), one request at a time per connection, whole
bodies (the response body is read before ``handle_async_request`` returns, which suits
JSON APIs) of at most ``max_body_bytes``. A request that fails or is cancelled closes its
connection: for servers that abort work when the client goes away, cancelling is
disconnecting. Errors are raised as httpx's own exceptions, so callers map them as they
would for any transport.
"""

from __future__ import annotations

import select
from collections import deque

import h11
import httpx
import trio

__all__ = ["ResponseTooLarge", "TrioTransport"]

MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024
RECV = 65536
_HAS_POLL = hasattr(select, "poll")


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The response body exceeds the transport's ``max_body_bytes``."""


class _Conn:
    """One keep-alive connection: its Trio socket and its h11 state machine.

    I/O goes through the Trio socket itself (``send``/``recv``), not ``SocketStream``:
    one request is one ``send`` and a few ``recv`` s, and the stream's conflict
    detector and error-translation context managers cost more than that here.
    """

    __slots__ = ("h11", "sock")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.sock = stream.socket  # owns the connection from here on (TCP_NODELAY is set)
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    def stale(self) -> bool:
        """Whether the server closed (or wrote to) the idle connection: it is then readable."""
        try:
            if _HAS_POLL:  # no FD_SETSIZE limit
                poller = select.poll()
                poller.register(self.sock.fileno(), select.POLLIN)
                return bool(poller.poll(0))
            readable, _, _ = select.select([self.sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly with nothing left over; if so, ready for the next."""
        conn = self.h11
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE or conn.trailing_data[0]:
            return False
        conn.start_next_cycle()
        return True

    def close(self) -> None:
        self.sock.close()


class TrioTransport(httpx.AsyncBaseTransport):
    """An HTTP/1.1 keep-alive transport for httpx on Trio.

    Args:
        connect_timeout: seconds to open a TCP connection (an ``extensions["timeout"]``
            ``connect`` value on the request wins).
        max_idle_per_origin: idle connections kept per ``host:port``; extra ones close.
        max_body_bytes: the largest response body read; a larger one raises
            :class:`ResponseTooLarge` (an ``httpx.RemoteProtocolError``).
    """

    def __init__(
        self, *, connect_timeout: float = 10.0, max_idle_per_origin: int = 1024, max_body_bytes: int = MAX_BODY
    ) -> None:
        if not max_body_bytes > 0:
            raise ValueError(f"TrioTransport.max_body_bytes: must be > 0, got {max_body_bytes!r}")
        self.connect_timeout = connect_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self.max_body_bytes = max_body_bytes
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on a pooled (or new) connection and read the whole answer."""
        if self._closed:
            raise RuntimeError("TrioTransport: closed")
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"TrioTransport speaks plain http://, got {url.scheme}://", request=request)
        origin = (url.host, url.port or 80)
        try:
            body = request.content  # already read for byte bodies (the common case)
        except httpx.RequestNotRead:
            body = await request.aread()
        timeouts = request.extensions.get("timeout") or {}
        events = _request_events(request, body)

        pool = self._idle.get(origin)
        conn: _Conn | None = None
        while pool:
            candidate = pool.pop()
            if candidate.stale():
                candidate.close()
                continue
            conn = candidate
            break
        if conn is None:
            conn = await self._connect(origin, timeouts.get("connect", self.connect_timeout), request)
        reusable = False
        try:
            try:
                data = b"".join([conn.h11.send(event) or b"" for event in events])
            except h11.LocalProtocolError as exc:
                raise httpx.LocalProtocolError(f"invalid request: {exc}", request=request) from exc
            try:
                sent = await conn.sock.send(data)
                if sent < len(data):
                    view = memoryview(data)[sent:]
                    while view:
                        view = view[await conn.sock.send(view) :]
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise httpx.WriteError(str(exc) or "write failed", request=request) from exc
            response = await _read_response(conn, request, timeouts.get("read"), self.max_body_bytes)
            reusable = conn.reusable()
        finally:
            if reusable and not self._closed:
                pool = self._idle.get(origin)
                if pool is None:
                    pool = self._idle[origin] = deque()
                if len(pool) < self.max_idle_per_origin:
                    pool.append(conn)
                else:
                    conn.close()
            else:
                conn.close()
        return response

    async def _connect(self, origin: tuple[str, int], timeout: float | None, request: httpx.Request) -> _Conn:
        try:
            with trio.fail_after(timeout if timeout is not None else float("inf")):
                stream = await trio.open_tcp_stream(*origin)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(f"{exc.strerror or exc} ({origin[0]}:{origin[1]})", request=request) from exc
        return _Conn(stream)

    async def aclose(self) -> None:
        """Close every idle connection."""
        self._closed = True
        pools, self._idle = self._idle, {}
        for pool in pools.values():
            for conn in pool:
                conn.close()
        await trio.lowlevel.checkpoint()


def _request_events(request: httpx.Request, body: bytes) -> list[h11.Event]:
    """The h11 events for ``request`` with its whole ``body`` (sent with a length)."""
    headers = []
    has_length = False
    for name, value in request.headers.raw:
        lname = name.lower()
        if lname == b"content-length":
            has_length = True
        elif lname == b"transfer-encoding":
            continue  # the body is already whole: send it with a length
        headers.append((name, value))
    if not has_length and (body or request.method in ("POST", "PUT", "PATCH")):
        headers.append((b"content-length", b"%d" % len(body)))
    try:
        head = h11.Request(method=request.method, target=request.url.raw_path, headers=headers)
    except h11.LocalProtocolError as exc:  # a CR, LF or NUL in a header or the target
        raise httpx.LocalProtocolError(f"invalid request: {exc}", request=request) from exc
    events: list[h11.Event] = [head]
    if body:
        events.append(h11.Data(data=body))
    events.append(h11.EndOfMessage())
    return events


async def _receive(conn: _Conn, request: httpx.Request, timeout: float | None) -> bytes:
    try:
        if timeout is None:
            return await conn.sock.recv(RECV)
        with trio.fail_after(timeout):
            return await conn.sock.recv(RECV)
    except trio.TooSlowError:
        raise httpx.ReadTimeout("read timed out", request=request) from None
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise httpx.ReadError(str(exc) or "read failed", request=request) from exc


async def _read_response(
    conn: _Conn, request: httpx.Request, timeout: float | None, max_body: int
) -> httpx.Response:
    """Read one whole response through h11 (interim 1xx answers skipped)."""
    machine = conn.h11
    head: h11.Response | None = None
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            event = machine.next_event()
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(f"malformed response: {exc}", request=request) from exc
        if event is h11.NEED_DATA:
            data = await _receive(conn, request, timeout)
            try:
                machine.receive_data(data)  # b"": the server closed its end
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(f"malformed response: {exc}", request=request) from exc
        elif type(event) is h11.Data:
            size += len(event.data)
            if size > max_body:
                raise ResponseTooLarge(
                    f"response body exceeds max_body_bytes={max_body} (read {size} bytes)", request=request
                )
            chunks.append(bytes(event.data))
        elif type(event) is h11.Response:
            head = event
        elif type(event) is h11.EndOfMessage:
            break
        elif type(event) is h11.InformationalResponse:
            continue
        else:  # ConnectionClosed (or PAUSED, which cannot happen mid-response)
            raise httpx.RemoteProtocolError(
                "server disconnected without sending a complete response", request=request
            )
    assert head is not None  # h11 emits the head before any body event
    response = httpx.Response(
        head.status_code,
        headers=head.headers.raw_items(),
        stream=httpx.ByteStream(b"".join(chunks)),
        extensions={"http_version": b"HTTP/" + head.http_version, "reason_phrase": head.reason},
        request=request,
    )
    response.read()  # a ByteStream: decodes Content-Encoding, no I/O
    return response
