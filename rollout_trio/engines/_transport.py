"""``TrioTransport``: an httpx transport with an O(1), bounded connection pool on Trio's I/O waits.

httpx's default transport (httpcore) rescans every pooled connection on every request
event (``_assign_requests_to_connections``), so at 128 concurrent requests most of the
time goes to the pool. This transport keeps, per origin, a stack of idle keep-alive
connections: a request pops one (or dials a new one), and a connection whose exchange
completed cleanly is pushed back. Nothing else is ever scanned.

Limits (:class:`ConnectionLimits`, like httpx's ``Limits``): requests in flight per
server and in all, idle connections kept per server, and how long one may stay idle.
A request beyond a limit waits for a slot (within the caller's deadline, or the
request's ``pool`` timeout). Running out of local resources while connecting (file
descriptors, ephemeral ports) raises :class:`LocalResourceError`: the server is not
to blame for it.

Responses are parsed by httptools (llhttp, the C parser of uvicorn and aiohttp), in its
strict mode, plus the rules llhttp leaves to the caller: a transfer coding other than
exactly ``chunked`` and an HTTP version other than 1.x are errors. A connection is reused
only when the answer was complete, keep-alive, and nothing followed it (bytes after a
complete response belong to no request); after any error it is closed. Requests are
framed here (``Content-Length`` bodies) and their heads checked: a CR, LF or NUL in a
header or the target is a local protocol error, as it was with h11.

Scope: HTTP/1.1 over plain TCP (``http://``), one request at a time per connection, whole
bodies (the response body is read before ``handle_async_request`` returns, which suits
JSON APIs) of at most ``max_body_bytes``, as received and once its ``Content-Encoding``
is undone (inflated incrementally by :mod:`rollout_trio._bounded`, stopping at the limit;
the answer handed to httpx carries the decoded body and no ``Content-Encoding``). A request that fails or is cancelled closes its
connection: for servers that abort work when the client goes away, cancelling is
disconnecting. Errors are raised as httpx's own exceptions, so callers map them as they
would for any transport.
"""

from __future__ import annotations

import errno
import re
import select
import socket
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import httptools
import httpx
import trio

from .._bounded import BadContent, BodyTooLarge, Inflater

__all__ = [
    "ConnectionLimits", "LocalResourceError", "ResponseDecodingError", "ResponseTooLarge", "TrioTransport", "frame_head",
]  # fmt: skip

MAX_HEAD = 64 * 1024
MAX_BODY = 64 * 1024 * 1024
RECV = 65536
_HAS_POLL = hasattr(select, "poll")

#: errno values that mean "this machine is out of something", never "the server failed".
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
_BAD_TARGET = re.compile(rb"[\x00-\x20\x7f]")


class ResponseTooLarge(httpx.RemoteProtocolError):
    """The response body exceeds the transport's ``max_body_bytes``."""


class ResponseDecodingError(httpx.DecodingError):
    """The response's ``Content-Encoding`` is unknown, or its body is corrupt in it."""


class LocalResourceError(httpx.ConnectError):
    """This machine ran out of a resource to open a connection (file descriptors, ports).

    A :class:`httpx.ConnectError` (nothing reached the server), raised as a distinct
    type so callers never blame the server for it.
    """


def _default_max_connections() -> int:
    """Three quarters of the soft file-descriptor limit: the rest stays for everything else."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 4096
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(8, soft * 3 // 4)


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ConnectionLimits.{attribute.name}: must be an integer >= 1, got {value!r}")


def _expiry(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"ConnectionLimits.{attribute.name}: must be > 0 seconds or None, got {value!r}")


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """How many connections :class:`TrioTransport` opens and keeps (like httpx's ``Limits``).

    Args:
        max_connections_per_server: requests in flight to one ``host:port`` at once (each
            holds one connection); more wait for a slot.
        max_connections: requests in flight to all servers at once. Defaults to three
            quarters of the process's soft ``RLIMIT_NOFILE`` when the transport is made.
        max_keepalive_per_server: idle connections kept per server; extra ones close.
        keepalive_expiry: seconds an idle connection is kept (None: until the server
            closes it). Below the 5 s keep-alive timeout of uvicorn (SGLang, vLLM) and
            Hypercorn, so the client retires a connection before the server can close
            it under a request being sent.
    """

    max_connections_per_server: int = attrs.field(default=1024, validator=_positive)
    max_connections: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    max_keepalive_per_server: int = attrs.field(default=1024, validator=_positive)
    keepalive_expiry: float | None = attrs.field(default=4.0, validator=_expiry)


class _Response:
    """httptools' callbacks for one response: collects the head and body, enforces the rules."""

    __slots__ = (
        "body", "complete", "encoded", "eof_delimited", "head_bytes", "head_done", "headers", "keep_alive",
        "max_body", "parser", "reason", "size", "skip_body", "status", "trailing", "version",
    )  # fmt: skip

    def __init__(self, max_body: int, skip_body: bool) -> None:
        self.max_body = max_body
        self.skip_body = skip_body  # a HEAD request: the head is the whole answer
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.head_bytes = 0
        self.status = 0
        self.reason = b""
        self.version = "1.1"
        self.head_done = self.complete = self.trailing = self.keep_alive = self.eof_delimited = False
        self.encoded = False  # a Content-Encoding header came: the body is not the content as sent

    # -- httptools callbacks (an exception raised here stops the parse)

    def on_message_begin(self) -> None:
        if self.complete:  # a second message after the answer: it answers no request
            self.trailing = True
            raise _Stop

    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self.status = status = parser.get_status_code()
        self.version = version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise _Malformed(f"unsupported HTTP version {version}")
        if 100 <= status < 200:
            self.headers = []  # an interim answer: the real one follows
            return
        self.head_done = True
        has_length = False
        for name, value in self.headers:
            lname = name.lower()
            if lname == b"transfer-encoding" and value.strip().lower() != b"chunked":
                raise _Malformed(f"unsupported transfer-encoding {value.decode('latin-1')!r}")
            if lname == b"content-length" or lname == b"transfer-encoding":
                has_length = True
            elif lname == b"content-encoding":
                self.encoded = True
        if self.skip_body:
            self.complete = True
            self.keep_alive = parser.should_keep_alive()
            raise _Stop
        self.eof_delimited = not has_length and status not in (204, 304)

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:
            raise ResponseTooLarge(f"response body exceeds max_body_bytes={self.max_body} (read {self.size} bytes)")
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.head_done:  # else an interim (1xx) answer ended
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()  # read now: llhttp resets it after

    @property
    def content(self) -> bytes:
        """The body as received (no Content-Encoding decoded)."""
        body = self.body
        return body[0] if len(body) == 1 else b"".join(body)

    def decoded(self, request: httpx.Request | None, what: str = "response") -> bytes:
        """The body with its ``Content-Encoding`` undone, at most ``max_body`` bytes
        decoded (:mod:`rollout_trio._bounded`; inflating stops at the limit).

        Raises:
            ResponseTooLarge: the decoded body is over ``max_body``.
            ResponseDecodingError: an unknown coding, or a corrupt body.
        """
        if not self.encoded:
            return self.content
        coding = ",".join(v.decode("latin-1") for n, v in self.headers if n.lower() == b"content-encoding")
        try:
            inflater = Inflater(coding, self.max_body, what=what)
            for piece in self.body:
                inflater.feed(piece)
            return inflater.finish()
        except BodyTooLarge as exc:
            raise ResponseTooLarge(str(exc), request=request) from None
        except BadContent as exc:
            raise ResponseDecodingError(str(exc), request=request) from None

    async def adecoded(self, request: httpx.Request | None) -> bytes:
        """:meth:`decoded`, in a worker thread when the body is encoded and over 64 KiB
        (inflating up to the limit takes tens of milliseconds: other requests go on)."""
        if not self.encoded or self.size <= 64 * 1024:
            return self.decoded(request)
        return await trio.to_thread.run_sync(self.decoded, request)

    def plain_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers without ``Content-Encoding`` (what describes :meth:`decoded`)."""
        if not self.encoded:
            return self.headers
        return [(n, v) for n, v in self.headers if n.lower() != b"content-encoding"]

    # -- driving

    def feed(self, data: bytes, request: httpx.Request | None) -> None:
        """Parse ``data``; raise ``httpx.RemoteProtocolError`` (or ResponseTooLarge) if malformed."""
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD and not self._head_ended_within(data):
                raise httpx.RemoteProtocolError(f"malformed response: head exceeds {MAX_HEAD} bytes", request=request)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Stop):
                if self.skip_body and not self.trailing:
                    self.trailing = not data.endswith(b"\r\n\r\n") or data.count(b"\r\n\r\n") != 1
                return
            if isinstance(cause, ResponseTooLarge):
                raise ResponseTooLarge(str(cause), request=request) from None
            raise httpx.RemoteProtocolError(f"malformed response: {cause or exc}", request=request) from None
        except httptools.HttpParserUpgrade:
            raise httpx.RemoteProtocolError("malformed response: a protocol upgrade was not asked for", request=request) from None
        except httptools.HttpParserError as exc:
            raise httpx.RemoteProtocolError(f"malformed response: {exc}", request=request) from None

    def _head_ended_within(self, data: bytes) -> bool:
        # The bound applies to the head only: a body may follow it in the same read.
        return b"\r\n\r\n" in data and self.head_bytes - len(data) + data.index(b"\r\n\r\n") + 4 <= MAX_HEAD

    def end_of_stream(self, request: httpx.Request | None) -> None:
        """The server closed: fine only for a body delimited by the close itself."""
        if self.head_done and self.eof_delimited:
            self.complete = True
            self.keep_alive = False
            return
        raise httpx.RemoteProtocolError("server disconnected without sending a complete response", request=request)


class _Stop(Exception):
    """Raised from a callback to stop the parse where the answer ends."""


class _Malformed(Exception):
    """A rule llhttp leaves to its caller was broken."""


class _Conn:
    """One keep-alive connection: its non-blocking socket, and when it went idle.

    I/O is the standard library socket's own ``send``/``recv``, waiting with
    ``trio.lowlevel.wait_writable``/``wait_readable`` only when the kernel says it would
    block: a Trio socket wraps each call in a checkpoint sandwich (an async context manager
    and a helper coroutine), and ``SocketStream`` adds a conflict detector and error
    translation on top. :meth:`TrioTransport.exchange` keeps the checkpoint rule itself
    (one cancel point before it sends, one schedule point after).
    """

    __slots__ = ("idle_since", "sock")

    def __init__(self, stream: trio.SocketStream) -> None:
        # Owns the connection from here on (the socket options, TCP_NODELAY included, stay).
        self.sock = socket.socket(fileno=stream.socket.detach())
        self.sock.setblocking(False)
        self.idle_since = 0.0

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
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()


class _Origin:
    """One server's idle connections and request slots."""

    __slots__ = ("idle", "slots")

    def __init__(self, limit: int) -> None:
        self.idle: deque[_Conn] = deque()
        self.slots = trio.Semaphore(limit)


class TrioTransport(httpx.AsyncBaseTransport):
    """An HTTP/1.1 keep-alive transport for httpx on Trio.

    Args:
        connect_timeout: seconds to open a TCP connection (an ``extensions["timeout"]``
            ``connect`` value on the request wins).
        limits: connection limits (see :class:`ConnectionLimits`).
        max_body_bytes: the largest response body read, as received and once decoded; a
            larger one raises :class:`ResponseTooLarge` (an ``httpx.RemoteProtocolError``).
    """

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        limits: ConnectionLimits | None = None,
        max_body_bytes: int = MAX_BODY,
    ) -> None:
        if not max_body_bytes > 0:
            raise ValueError(f"TrioTransport.max_body_bytes: must be > 0, got {max_body_bytes!r}")
        self.connect_timeout = connect_timeout
        self.limits = limits = limits or ConnectionLimits()
        self.max_connections = limits.max_connections or _default_max_connections()
        self.max_body_bytes = max_body_bytes
        self._origins: dict[tuple[str, int], _Origin] = {}
        # The servers with an idle connection, oldest first (an ordered set): making room
        # takes the first, never a walk over every server's pool.
        self._with_idle: dict[_Origin, None] = {}
        self._slots = trio.Semaphore(self.max_connections)
        self._idle_count = 0
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on a pooled (or new) connection and read the whole answer."""
        if self._closed:
            raise RuntimeError("TrioTransport: closed")
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"TrioTransport speaks plain http://, got {url.scheme}://", request=request)
        key = (url.host, url.port or 80)
        try:
            body = request.content  # already read for byte bodies (the common case)
        except httpx.RequestNotRead:
            body = await request.aread()
        timeouts = request.extensions.get("timeout") or {}
        answer = await self.exchange(key, _frame(request, body), timeouts, head=request.method == "HEAD", request=request)
        content = await answer.adecoded(request)  # bounded: never httpx's whole-body inflate
        response = httpx.Response(
            answer.status,
            headers=answer.plain_headers(),
            stream=httpx.ByteStream(content),
            extensions={"http_version": b"HTTP/" + answer.version.encode(), "reason_phrase": answer.reason},
            request=request,
        )
        response.read()  # a ByteStream, no Content-Encoding left: no I/O, no decoding
        return response

    async def exchange(
        self,
        origin: tuple[str, int],
        data: bytes,
        timeouts: Mapping[str, float | None],
        *,
        head: bool = False,
        request: httpx.Request | None = None,
    ) -> _Response:
        """Send the framed request ``data`` to ``origin`` and read the whole answer.

        What ``handle_async_request`` does once the request is framed; callers that frame
        their own requests (``HttpSession``'s hot path) call it directly and read the
        answer's ``status``, ``headers``, ``encoded`` (a ``Content-Encoding`` header came)
        and ``content``. Raises httpx's exceptions.
        """
        if self._closed:
            raise RuntimeError("TrioTransport: closed")
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sends nothing (a cancel point)
        pool = self._origins.get(origin)
        if pool is None:
            pool = self._origins[origin] = _Origin(self.limits.max_connections_per_server)
        await self._acquire(pool, request, timeouts.get("pool"))
        try:
            conn = self._pop_idle(pool)
            if conn is None:
                if len(self._origins) > 1 and self._idle_count and self._in_flight() + self._idle_count > self.max_connections:
                    self._evict_one()  # another server's idle connection makes room for this one
                conn = await self._connect(origin, timeouts.get("connect", self.connect_timeout), request)
            reusable = False
            try:
                await _send(conn.sock, data, request)
                # A schedule point, as a Trio socket's send is: other tasks run while the
                # server answers, so the read below often finds the answer there already
                # (no wait registered with the kernel; at 128 requests in flight that is
                # cheaper than reading at once).
                await trio.lowlevel.cancel_shielded_checkpoint()
                answer = await _read_response(conn, request, timeouts.get("read"), self.max_body_bytes, head)
                reusable = answer.keep_alive and not answer.trailing and not answer.eof_delimited
            finally:
                if reusable and not self._closed:
                    self._keep(pool, conn)
                else:
                    conn.close()
        finally:
            pool.slots.release()
            self._slots.release()
        return answer

    async def _acquire(self, origin: _Origin, request: httpx.Request | None, timeout: float | None) -> None:
        """Take a slot of the server and one of the whole pool, waiting when none is free."""
        try:  # the common case: free slots, no scheduling round trip
            origin.slots.acquire_nowait()
        except trio.WouldBlock:
            await self._wait(origin.slots, request, timeout)
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            try:
                await self._wait(self._slots, request, timeout)
            except BaseException:
                origin.slots.release()
                raise

    @staticmethod
    async def _wait(slots: trio.Semaphore, request: httpx.Request | None, timeout: float | None) -> None:
        try:
            with trio.fail_after(timeout if timeout is not None else float("inf")):
                await slots.acquire()
        except trio.TooSlowError:
            raise httpx.PoolTimeout("no connection slot became free in time", request=request) from None

    def _in_flight(self) -> int:
        return self.max_connections - self._slots.value

    def _pop_idle(self, origin: _Origin) -> _Conn | None:
        idle = origin.idle
        if not idle:
            return None
        expiry = self.limits.keepalive_expiry
        oldest_kept = trio.current_time() - expiry if expiry is not None else float("-inf")
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            if not idle:
                self._with_idle.pop(origin, None)
            if conn.idle_since < oldest_kept or conn.stale():
                conn.close()
                continue
            return conn
        return None

    def _keep(self, origin: _Origin, conn: _Conn) -> None:
        idle = origin.idle
        now = trio.current_time()
        expiry = self.limits.keepalive_expiry
        if idle and expiry is not None and idle[0].idle_since < now - expiry:  # retire the oldest, O(1)
            idle.popleft().close()
            self._idle_count -= 1
        if len(idle) >= self.limits.max_keepalive_per_server:
            conn.close()
            return
        conn.idle_since = now
        idle.append(conn)
        self._idle_count += 1
        self._with_idle[origin] = None

    def _evict_one(self) -> None:
        origin = next(iter(self._with_idle), None)  # O(1): only servers holding an idle connection are listed
        if origin is not None:
            origin.idle.popleft().close()
            self._idle_count -= 1
            if not origin.idle:
                del self._with_idle[origin]

    async def _connect(self, origin: tuple[str, int], timeout: float | None, request: httpx.Request | None) -> _Conn:
        try:
            with trio.fail_after(timeout if timeout is not None else float("inf")):
                stream = await trio.open_tcp_stream(*origin)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out", request=request) from None
        except OSError as exc:
            local = _local_errno(exc)
            if local is not None:
                raise LocalResourceError(
                    f"out of local resources connecting to {origin[0]}:{origin[1]}: {errno.errorcode[local]} "
                    f"({exc.strerror or exc})", request=request,
                ) from exc
            raise httpx.ConnectError(f"{exc.strerror or exc} ({origin[0]}:{origin[1]})", request=request) from exc
        return _Conn(stream)

    async def aclose(self) -> None:
        """Close every idle connection."""
        self._closed = True
        origins, self._origins = self._origins, {}
        self._with_idle = {}
        for origin in origins.values():
            for conn in origin.idle:
                conn.close()
        self._idle_count = 0
        await trio.lowlevel.checkpoint()


def _local_errno(exc: BaseException) -> int | None:
    """The local-resource errno behind ``exc`` (Trio wraps failed attempts in a group)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in LOCAL_ERRNOS:
            return e.errno
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)
    return None


_CHECKED_NAMES: set[bytes] = set()


def frame_head(method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """The request line and header lines of a request, checked as h11 checked them.

    Raises:
        httpx.LocalProtocolError: an illegal method, target or header name, or a CR, LF
            or NUL in a header value.
    """
    raw_method = method.encode("ascii")
    lines = [b"%s %s HTTP/1.1" % (raw_method, target)]
    values = []
    for name, value in headers:
        lname = name.lower()
        if lname not in _CHECKED_NAMES:
            if not _TOKEN.fullmatch(name):
                raise httpx.LocalProtocolError(f"invalid request: illegal header name {name!r}")
            if len(_CHECKED_NAMES) < 256:
                _CHECKED_NAMES.add(lname)
        values.append(value)
        lines.append(b"%s: %s" % (name, value))
    if _BAD_VALUE.search(b"".join(values)) or not _TOKEN.fullmatch(raw_method) or not target or _BAD_TARGET.search(target):
        raise httpx.LocalProtocolError(
            "invalid request: a CR, LF or NUL in a header value, or an illegal method or target"
        )
    return lines


def _frame(request: httpx.Request, body: bytes) -> bytes:
    """``request`` as bytes on the wire, its whole ``body`` sent with a length."""
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
        lines = frame_head(request.method, request.url.raw_path, headers)
    except httpx.LocalProtocolError as exc:
        raise httpx.LocalProtocolError(str(exc), request=request) from None
    lines.append(b"")
    lines.append(body)
    return b"\r\n".join(lines)


async def _send(sock: socket.socket, data: bytes, request: httpx.Request | None) -> None:
    """Send all of ``data``, waiting for the socket only when it would block."""
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
    except (trio.ClosedResourceError, OSError) as exc:
        raise httpx.WriteError(str(exc) or "write failed", request=request) from exc


async def _read_response(
    conn: _Conn, request: httpx.Request | None, timeout: float | None, max_body: int, head: bool
) -> _Response:
    """Read one whole response (interim 1xx answers skipped), each wait for data within
    ``timeout``. Not a checkpoint by itself when the answer is there already: the caller's."""
    answer = _Response(max_body, skip_body=head)
    sock = conn.sock
    while not answer.complete:
        try:
            data = sock.recv(RECV)
        except BlockingIOError:
            await _wait_readable(sock, request, timeout)
            continue
        except OSError as exc:
            raise httpx.ReadError(str(exc) or "read failed", request=request) from exc
        if not data:
            answer.end_of_stream(request)
            break
        answer.feed(data, request)
    return answer


async def _wait_readable(sock: socket.socket, request: httpx.Request | None, timeout: float | None) -> None:
    try:
        if timeout is None:
            await trio.lowlevel.wait_readable(sock)
            return
        with trio.fail_after(timeout):
            await trio.lowlevel.wait_readable(sock)
    except trio.TooSlowError:
        raise httpx.ReadTimeout("read timed out", request=request) from None
    except trio.ClosedResourceError as exc:
        raise httpx.ReadError(str(exc) or "read failed", request=request) from exc
