"""``TrioTransport``: an httpx transport with an O(1) connection pool on Trio sockets.

httpx's default transport (httpcore) rescans every pooled connection on every request
event (``_assign_requests_to_connections``), so at 128 concurrent requests most of the
time goes to the pool. This transport keeps, per origin, a stack of idle keep-alive
connections: a request pops one (or dials a new one), and a connection whose exchange
completed cleanly is pushed back. Nothing else is ever scanned. HTTP/1.1 framing is done
here directly (request line and headers out; status line, headers, and a
``Content-Length``, chunked or read-to-close body in), which costs a fraction of a
general-purpose state machine per request.

Scope: HTTP/1.1 over plain TCP (``http://``), one request at a time per connection, whole
bodies (the response body is read before ``handle_async_request`` returns, which suits
JSON APIs). A request that fails or is cancelled closes its connection: for servers that
abort work when the client goes away, cancelling is disconnecting. Errors are raised as
httpx's own exceptions, so callers map them as they would for any transport.
"""

from __future__ import annotations

import select
from collections import deque

import httpx
import trio

__all__ = ["TrioTransport"]

MAX_HEAD = 64 * 1024
RECV = 65536
_HAS_POLL = hasattr(select, "poll")


class _Conn:
    """One keep-alive connection: its Trio socket and any bytes read past an answer.

    I/O goes through the Trio socket itself (``send``/``recv``), not ``SocketStream``:
    one request is one ``send`` and a few ``recv`` s, and the stream's conflict
    detector and error-translation context managers cost more than that here.
    """

    __slots__ = ("buf", "sock")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.sock = stream.socket  # owns the connection from here on (TCP_NODELAY is set)
        self.buf = b""

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

    def close(self) -> None:
        self.sock.close()


class TrioTransport(httpx.AsyncBaseTransport):
    """An HTTP/1.1 keep-alive transport for httpx on Trio.

    Args:
        connect_timeout: seconds to open a TCP connection (an ``extensions["timeout"]``
            ``connect`` value on the request wins).
        max_idle_per_origin: idle connections kept per ``host:port``; extra ones close.
    """

    def __init__(self, *, connect_timeout: float = 10.0, max_idle_per_origin: int = 1024) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle_per_origin = max_idle_per_origin
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
        data = _encode_request(request, body)

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
                sent = await conn.sock.send(data)
                if sent < len(data):
                    view = memoryview(data)[sent:]
                    while view:
                        view = view[await conn.sock.send(view) :]
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise httpx.WriteError(str(exc) or "write failed", request=request) from exc
            response, reusable = await _read_response(conn, request, timeouts.get("read"))
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


def _encode_request(request: httpx.Request, body: bytes) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    has_length = False
    for name, value in request.headers.raw:
        lname = name.lower()
        if lname == b"content-length":
            has_length = True
        elif lname == b"transfer-encoding":
            continue  # the body is already whole: send it with a length
        if b":" in name:
            raise httpx.LocalProtocolError(f"invalid header {name!r}", request=request)
        lines.append(b"%s: %s" % (name, value))
    if not has_length and (body or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"content-length: %d" % len(body))
    head = b"\r\n".join(lines)
    if head.count(b"\n") != len(lines) - 1 or head.count(b"\r") != len(lines) - 1:
        # a CR or LF inside a request target, header name or value would split it
        raise httpx.LocalProtocolError("invalid header: CR or LF in a request line or header", request=request)
    return b"%s\r\n\r\n%s" % (head, body)


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


async def _read_response(conn: _Conn, request: httpx.Request, timeout: float | None) -> tuple[httpx.Response, bool]:
    """Read one response; returns it and whether the connection may be reused."""
    buf = conn.buf
    while True:  # skip 1xx interim answers
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise httpx.RemoteProtocolError("response head too large", request=request)
            data = await _receive(conn, request, timeout)
            if not data:
                raise httpx.RemoteProtocolError(
                    "server disconnected without sending a complete response", request=request
                )
            buf += data
        head, buf = buf[:end], buf[end + 4 :]
        lines = head.split(b"\r\n")
        try:
            version, status_text, *reason = lines[0].split(b" ", 2)
            status = int(status_text)
        except ValueError:
            raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}", request=request) from None
        if not version.startswith(b"HTTP/1.") or not 100 <= status <= 999:
            raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}", request=request)
        if status >= 200 or status == 101:
            break
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    chunked = False
    encoded = False
    close = version == b"HTTP/1.0"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}", request=request)
        value = value.strip()
        headers.append((name, value))
        lname = name.lower()
        if lname == b"content-length":
            try:
                length = int(value)
            except ValueError:
                raise httpx.RemoteProtocolError(f"bad content-length {value!r}", request=request) from None
            if length < 0:
                raise httpx.RemoteProtocolError(f"bad content-length {value!r}", request=request)
        elif lname == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
        elif lname == b"content-encoding":
            encoded = value.lower() not in (b"", b"identity")
        elif lname == b"connection":
            token = value.lower()
            if b"close" in token:
                close = True
            elif b"keep-alive" in token:
                close = False
    if request.method == "HEAD" or status in (204, 304):
        body = b""
    elif chunked:
        body, buf = await _read_chunked(conn, buf, request, timeout)
    elif length is not None:
        while len(buf) < length:
            data = await _receive(conn, request, timeout)
            if not data:
                raise httpx.RemoteProtocolError(
                    f"server disconnected after {len(buf)} of {length} body bytes", request=request
                )
            buf += data
        body, buf = buf[:length], buf[length:]
    else:
        chunks = [buf]
        while data := await _receive(conn, request, timeout):
            chunks.append(data)
        body, buf, close = b"".join(chunks), b"", True
    conn.buf = b""
    return _response(status, headers, body, encoded, version, reason, request), not close and not buf


def _response(
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    encoded: bool,
    version: bytes,
    reason: list[bytes],
    request: httpx.Request,
) -> httpx.Response:
    """The whole answer as a read ``httpx.Response``.

    Built from a stream (``content=`` would add headers the server did not send and
    decode the body through httpx's chunker). A body with no ``Content-Encoding`` is its
    own content, so it is set as read (about 10 us less per request than ``read()``); if
    httpx ever stops honouring that, ``response.content`` raises ``ResponseNotRead`` and
    both callers (``client.send`` and ``HttpSession``) read the stream instead. An encoded
    body is decoded by ``read()``.
    """
    response = httpx.Response(
        status,
        headers=headers,
        stream=httpx.ByteStream(body),
        extensions={"http_version": version, "reason_phrase": reason[0] if reason else b""},
        request=request,
    )
    if encoded:
        response.read()
    else:
        response._content = body  # what read() would produce through the identity decoder
        response.is_stream_consumed = True
        response.is_closed = True
    return response


async def _read_chunked(conn: _Conn, buf: bytes, request: httpx.Request, timeout: float | None) -> tuple[bytes, bytes]:
    out: list[bytes] = []

    async def more(buf: bytes) -> bytes:
        data = await _receive(conn, request, timeout)
        if not data:
            raise httpx.RemoteProtocolError("server disconnected inside a chunked body", request=request)
        return buf + data

    while True:
        while (eol := buf.find(b"\r\n")) < 0:
            buf = await more(buf)
        try:
            size = int(buf[:eol].split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise httpx.RemoteProtocolError(f"bad chunk size line {buf[:eol][:50]!r}", request=request) from None
        buf = buf[eol + 2 :]
        if size == 0:
            while True:  # trailers, up to an empty line
                while (eol := buf.find(b"\r\n")) < 0:
                    buf = await more(buf)
                line, buf = buf[:eol], buf[eol + 2 :]
                if not line:
                    return b"".join(out), buf
        while len(buf) < size + 2:
            buf = await more(buf)
        if buf[size : size + 2] != b"\r\n":
            raise httpx.RemoteProtocolError("chunk not followed by CRLF", request=request)
        out.append(buf[:size])
        buf = buf[size + 2 :]
