"""The ASGI side every server of the package shares: routing, limits, bodies, disconnects.

One :class:`HTTPApp` serves ``rollout-trio serve``'s SGLang routes and the agent
endpoint's OpenAI routes, over a socket (:func:`~rollout_trio._http.serve_app`) or in
process (:class:`~rollout_trio._http.InProcessTransport`, or any ASGI client). Per request it:

* refuses a head larger than ``limits.max_header_bytes`` (431) whether it arrived in
  one piece or several, and a request framed twice (``Content-Length`` and
  ``Transfer-Encoding``: 400); both answers close the connection;
* matches ``(method, path)`` exactly: no redirects (a trailing slash is a 404);
* gives handlers a :class:`Request` whose body is read within ``limits.read_deadline``
  seconds (408) and ``limits.max_body_bytes`` bytes (413), and whose JSON is decoded off
  the event loop when large; nesting too deep or bad UTF-8 is a 400, never a 500;
* runs a handler's work while watching for ``http.disconnect`` when asked
  (:meth:`Request.unless_disconnected`): a client that hangs up cancels it.

A handler's unexpected exception is logged and answered 500; the server keeps serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, TypeVar

import attrs
import trio

from ._limits import ServerLimits

__all__ = ["ClientGone", "HTTPApp", "HTTPError", "Request", "Response", "json_bytes"]

log = logging.getLogger("rollout_trio.server")

T = TypeVar("T")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Bodies up to this size are decoded on the event loop (a thread hop costs more).
INLINE_JSON_BYTES = 64 * 1024
_parsers: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("rollout_trio_http_parsers")


class HTTPError(Exception):
    """Answer ``status`` with ``message`` (``close``: then close the connection)."""

    def __init__(
        self, status: int, message: str, *, close: bool = False, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected before its request was read: nobody to answer."""


@attrs.frozen
class Response:
    """A whole answer: status, body bytes, content type and extra headers."""

    status: int = 200
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON; NaN and infinities are refused (``ValueError``), as JSON has none."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else None
    except RecursionError:
        raise HTTPError(400, "body: JSON nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise HTTPError(400, f"body: not JSON ({exc})") from None


def _convert(raw: bytes, convert: Callable[[Any], T]) -> T:
    return convert(_loads(raw))


def _parser_limiter() -> trio.CapacityLimiter:
    try:
        return _parsers.get()
    except LookupError:
        limiter = trio.CapacityLimiter(2)
        _parsers.set(limiter)
        return limiter


class Request:
    """One request: its head, and its body read within the server's limits."""

    def __init__(self, scope: Scope, receive: Receive, limits: ServerLimits, *, body: bytes | None = None) -> None:
        self.scope = scope
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.limits = limits
        self._receive = receive
        self._body = body  # the whole body, when the caller handed it over (in process)
        self._headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            self._headers.setdefault(bytes(name).lower(), bytes(value))

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (latin-1, as HTTP heads are), or None."""
        value = self._headers.get(name.lower().encode())
        return None if value is None else value.decode("latin-1")

    async def body(self) -> bytes:
        """The whole body.

        Raises:
            HTTPError: 413 over ``max_body_bytes``, 408 past ``read_deadline`` (the rest is
                unread, so the connection closes).
            ClientGone: the client disconnected first.
        """
        limit = self.limits.max_body_bytes
        declared = self.header("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise HTTPError(
                413, f"body: {int(declared)} bytes is over the limit of {limit} bytes (max_body_bytes={limit})", close=True
            )
        if self._body is not None:  # already in memory: nothing to wait for
            if len(self._body) > limit:
                raise HTTPError(413, f"body: over the limit of {limit} bytes (max_body_bytes={limit})", close=True)
            return self._body
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.limits.read_deadline) as deadline:
            more = True
            while more:
                message = await self._receive()
                if message["type"] != "http.request":
                    raise ClientGone()
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                size += len(chunk)
                if size > limit:
                    raise HTTPError(413, f"body: over the limit of {limit} bytes (max_body_bytes={limit})", close=True)
                chunks.append(chunk)
        if deadline.cancelled_caught:
            raise HTTPError(
                408, f"body: not received within read_deadline={self.limits.read_deadline} s", close=True
            )
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def json(self, convert: Callable[[Any], T] | None = None) -> Any:
        """The body decoded as JSON (None if empty), then passed through ``convert``.

        Large bodies are decoded and converted in a worker thread, so one client's
        megabytes do not stall every other request.
        """
        raw = await self.body()
        fn: Callable[[Any], Any] = convert if convert is not None else _identity
        if len(raw) <= INLINE_JSON_BYTES:
            return _convert(raw, fn)
        return await trio.to_thread.run_sync(_convert, raw, fn, limiter=_parser_limiter())

    async def unless_disconnected(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """``await work()``, cancelled if the client disconnects meanwhile (then None).

        Call it once the body is read: ``receive()`` then only reports the disconnect.
        """
        result: T | None = None
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._until_disconnect, nursery.cancel_scope)
            try:
                result = await work()
            except Exception as exc:  # raised below, outside the nursery's exception group
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return result

    async def _until_disconnect(self, cancel: trio.CancelScope) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        cancel.cancel()


def _identity(value: Any) -> Any:
    return value


Handler = Callable[[Request], Awaitable[Response]]
ErrorBody = Callable[[int, str], bytes]


def _head_size(scope: Scope) -> int:
    size = len(scope["method"]) + len(scope.get("raw_path") or scope["path"]) + len(scope.get("query_string", b""))
    return size + 12 + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class HTTPApp:
    """An ASGI app answering ``routes[(method, path)]`` within ``limits``.

    Args:
        routes: ``(method, path) -> handler``; paths match exactly.
        limits: the limits each request is held to.
        error_body: the JSON body of an error answer ``(status, message) -> bytes``.
        guard: called before every handler; an :class:`HTTPError` it raises is the answer
            (authentication).
    """

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Handler],
        *,
        limits: ServerLimits,
        error_body: ErrorBody,
        guard: Callable[[Request], None] | None = None,
    ) -> None:
        self.routes = dict(routes)
        self.limits = limits
        self.error_body = error_body
        self.guard = guard
        self._methods: dict[str, list[str]] = {}
        for method, path in self.routes:
            self._methods.setdefault(path, []).append(method)

    def error(self, status: int, message: str, *, close: bool = False, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        """An error answer in this app's body shape."""
        extra = (("connection", "close"),) if close else ()
        return Response(status, self.error_body(status, message), headers=headers + extra)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets: not served
            return
        try:
            response = await self._respond(scope, receive)
        except ClientGone:
            return
        await send_response(send, response)

    async def respond_in_memory(self, scope: Scope, body: bytes) -> Response:
        """The answer to a request whose head (an ASGI ``http`` scope) and whole body the
        caller holds: what :meth:`__call__` sends, with no ASGI messages and no read
        deadline (nothing is in transit). Used by in-process transports in the caller's task.

        Args:
            scope: ``method``, ``path`` and ``headers`` (lower-case names, as bytes).
            body: the request's body.

        Returns:
            The answer, under the same limits, routes and error bodies as a served request.
        """
        return await self._respond(scope, _never_disconnects, body)

    async def _respond(self, scope: Scope, receive: Receive, body: bytes | None = None) -> Response:
        if _head_size(scope) > self.limits.max_header_bytes:
            return self.error(431, f"request head exceeds max_header_bytes={self.limits.max_header_bytes}", close=True)
        request = Request(scope, receive, self.limits, body=body)
        if request.header("content-length") is not None and request.header("transfer-encoding") is not None:
            return self.error(400, "request framed twice: both Content-Length and Transfer-Encoding", close=True)
        handler = self.routes.get((request.method, request.path))
        if handler is None:
            allowed = self._methods.get(request.path)
            if allowed is None:
                return self.error(404, f"no endpoint {request.path}")
            return self.error(
                405, f"method {request.method} not allowed on {request.path}", headers=(("allow", ", ".join(allowed)),)
            )
        try:
            if self.guard is not None:
                self.guard(request)
            return await handler(request)
        except HTTPError as exc:
            return self.error(exc.status, exc.message, close=exc.close, headers=exc.headers)
        except ClientGone:
            raise
        except Exception as exc:  # a bug in a route must not kill the server
            log.exception("%s %s failed", request.method, request.path)
            return self.error(500, f"{type(exc).__name__}: {exc}")


async def _never_disconnects() -> Message:
    """``receive`` of a request handed over whole, in the caller's task: its caller's
    cancellation, not a disconnect message, ends the work."""
    await trio.sleep_forever()


def response_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """The head of ``response`` as sent: its length, its content type (if it has a body), its extra headers."""
    headers = [(b"content-length", str(len(response.body)).encode())]
    if response.content_type is not None and response.body:
        headers.append((b"content-type", response.content_type.encode()))
    headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.headers]
    return headers


async def send_response(send: Send, response: Response) -> None:
    """Send ``response`` whole; a client already gone is not an error."""
    headers = response_headers(response)
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
        # The client left meanwhile. (Hypercorn can report it as BusyResourceError: its
        # send_eof of a half-closed connection races the answer's send_all.)
        pass


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
