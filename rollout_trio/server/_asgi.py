"""The SGLang-protocol routes as a Starlette (ASGI) app, with body limits and bearer auth.

The same app serves sockets (through :func:`~rollout_trio.server.serve_app` on Hypercorn)
and in-process callers (``httpx.ASGITransport``). Per request it:

* refuses a missing or wrong ``Authorization: Bearer`` when an api key is set (401;
  ``/health`` stays open so load balancers can probe);
* reads the body whole within ``limits.read_deadline`` seconds (408) and at most
  ``limits.max_body_bytes`` bytes (413, at once when ``Content-Length`` says so);
* runs the route while watching for ``http.disconnect``: a client that hangs up cancels
  its route (its generation stops, as SGLang aborts a request whose client went away).

Errors are ``{"error": {"message": ..., "code": status}}``, as SGLang answers them.
"""

from __future__ import annotations

import hmac
import json
import logging
from contextlib import aclosing
from typing import Any

import attrs
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .._validate import rule
from ._schema import BadRequest
from ._sglang_app import EngineFailure, SGLangApp
from ._sglang_app import Route as AppRoute

__all__ = ["ServerLimits", "sglang_asgi"]

log = logging.getLogger("rollout_trio.server")

_encode = json.JSONEncoder(separators=(",", ":")).encode


def _positive(text: str) -> Any:
    return rule(text, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)


@attrs.frozen(kw_only=True)
class ServerLimits:
    """What one client may ask of the server.

    Attributes:
        max_body_bytes: the largest request body (HTTP 413 beyond it).
        read_deadline: seconds to receive a whole request body once its head arrived
            (HTTP 408 after it); the head itself must arrive within ``keep_alive_timeout``.
        keep_alive_timeout: seconds an idle connection stays open (and the most a
            request head may take to arrive).
        max_connections: open connections at once; more are answered 503 and closed.
        max_header_bytes: the largest request head (h11's default, 16 KiB).
    """

    max_body_bytes: int = attrs.field(default=16 * 1024 * 1024, validator=_positive("max_body_bytes > 0"))
    read_deadline: float = attrs.field(default=60.0, validator=_positive("read_deadline > 0"))
    keep_alive_timeout: float = attrs.field(default=75.0, validator=_positive("keep_alive_timeout > 0"))
    max_connections: int = attrs.field(default=1024, validator=_positive("max_connections > 0"))
    max_header_bytes: int = attrs.field(default=16 * 1024, validator=_positive("max_header_bytes > 0"))


class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(status: int, data: Any, headers: dict[str, str] | None = None) -> Response:
    if data is None:
        return Response(b"", status_code=status, headers=headers)
    return Response(_encode(data), status_code=status, media_type="application/json", headers=headers)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json(status, {"error": {"message": message, "code": status}}, headers)


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise _RequestError(413, f"request body of {declared} bytes exceeds max_body_bytes={limits.max_body_bytes}")
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(limits.read_deadline) as scope:
        async with aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise _RequestError(413, f"request body exceeds max_body_bytes={limits.max_body_bytes}")
                chunks.append(chunk)
    if scope.cancelled_caught:
        raise _RequestError(408, f"request body not received within read_deadline={limits.read_deadline} s")
    return b"".join(chunks)


async def _until_disconnect(receive: Receive, cancel: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel.cancel()


async def _read_json(request: Request, limits: ServerLimits) -> Any:
    raw = await _read_body(request, limits)
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError as exc:  # UnicodeDecodeError included
        raise _RequestError(400, f"{request.url.path}: the body is not JSON: {exc}") from None


async def _answer(route: AppRoute, data: Any, request: Request) -> Response:
    try:
        reply = await route(data)
    except BadRequest as exc:
        return _error(400, str(exc))
    except EngineFailure as exc:
        return _error(500, str(exc))
    except Exception as exc:  # a bug in a route must not kill the server
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, f"{type(exc).__name__}: {exc}")
    if isinstance(reply.json, Response):  # a non-JSON answer (/metrics, the live page) as is
        return reply.json
    return _json(reply.status, reply.json)


def _endpoint(route: AppRoute, limits: ServerLimits) -> Any:
    async def endpoint(request: Request) -> Response:
        try:
            data = await _read_json(request, limits)
        except _RequestError as exc:  # the rest of the body is unread: this connection is done
            return _error(exc.status, str(exc), {"connection": "close"})
        response: Response | None = None
        async with trio.open_nursery() as nursery:  # the body is read: receive() now only reports a disconnect
            nursery.start_soon(_until_disconnect, request.receive, nursery.cancel_scope)
            response = await _answer(route, data, request)
            nursery.cancel_scope.cancel()
        if response is None:  # the client went away: nobody reads this
            return Response(b"", status_code=499)
        return response

    return endpoint


class _BearerAuth:
    """Every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                what = "missing" if not given else "wrong"
                response = _error(
                    401, f"{what} api key: send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error(404, f"no endpoint {_request.url.path}")
    if exc.status_code == 405:
        return _error(405, f"method {_request.method} not allowed on {_request.url.path}")
    return _error(exc.status_code, str(exc.detail))


def sglang_asgi(app: SGLangApp, *, api_key: str | None = None, limits: ServerLimits | None = None) -> ASGIApp:
    """The ASGI app serving ``app``'s routes with ``limits`` and, when set, ``api_key``."""
    if api_key is not None and not api_key:
        raise ValueError("sglang_asgi.api_key: must be a non-empty string or None")
    limits = limits or ServerLimits()
    routes = [
        Route(path, _endpoint(route, limits), methods=[method]) for (method, path), route in app.routes.items()
    ]
    asgi: ASGIApp = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    if api_key is not None:
        asgi = _BearerAuth(asgi, api_key)
    return asgi
