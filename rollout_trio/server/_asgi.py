"""The SGLang-protocol routes as an ASGI app, with the shared limits and bearer auth.

The same app serves sockets (through :func:`~rollout_trio.server.serve_app` on Hypercorn)
and in-process callers (``httpx.ASGITransport``). Beyond what :class:`~rollout_trio._http.HTTPApp`
does for every server (limits, bodies, JSON off the event loop), per request it:

* refuses a missing or wrong ``Authorization: Bearer`` when an api key is set (401;
  ``/health`` stays open so load balancers can probe);
* structures a large ``/generate`` body in the worker thread that decoded it;
* runs the route while watching for a disconnect: a client that hangs up cancels its
  route (its generation stops, as SGLang aborts a request whose client went away).

Errors are ``{"error": {"message": ..., "code": status}}``, as SGLang answers them.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from .._http import HTTPApp, HTTPError, Request, Response, ServerLimits, json_bytes
from ._schema import BadRequest, GenerateBody, parse_body
from ._sglang_app import EngineFailure, SGLangApp
from ._sglang_app import Route as AppRoute

__all__ = ["sglang_asgi"]

log = logging.getLogger("rollout_trio.server")

#: Bodies worth structuring in the thread that decodes them (the long token lists).
_STRUCTURED = {("POST", "/generate"): (GenerateBody, "generate")}


def _error_body(status: int, message: str) -> bytes:
    return json_bytes({"error": {"message": message, "code": status}})


def _reply(status: int, data: Any) -> Response:
    if data is None:
        return Response(status, b"")
    try:
        return Response(status, json_bytes(data))
    except ValueError as exc:  # NaN in an answer: a bug, answered like one
        return Response(500, _error_body(500, f"the answer is not JSON: {exc}"))


async def _answer(route: AppRoute, data: Any, request: Request) -> Response:
    try:
        reply = await route(data)
    except BadRequest as exc:
        raise HTTPError(400, str(exc)) from None
    except EngineFailure as exc:
        raise HTTPError(500, str(exc)) from None
    if isinstance(reply.json, Response):  # a non-JSON answer: /metrics, the live page
        return reply.json
    return _reply(reply.status, reply.json)


def _endpoint(key: tuple[str, str], route: AppRoute) -> Any:
    structured = _STRUCTURED.get(key)

    def convert(data: Any) -> Any:
        if structured is None or not isinstance(data, dict):
            return data
        try:
            return parse_body(structured[0], data, structured[1])
        except BadRequest as exc:
            raise HTTPError(400, str(exc)) from None

    async def endpoint(request: Request) -> Response:
        data = await request.json(convert)
        response = await request.unless_disconnected(lambda: _answer(route, data, request))
        return response if response is not None else Response(499)  # the client went away: nobody reads this

    return endpoint


def _bearer(api_key: str) -> Any:
    """Every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (401 otherwise)."""
    expected = f"Bearer {api_key}".encode()

    def guard(request: Request) -> None:
        if request.path == "/health":
            return
        given = (request.header("authorization") or "").encode("latin-1")
        if not hmac.compare_digest(given, expected):
            what = "missing" if not given else "wrong"
            raise HTTPError(
                401, f"{what} api key: send 'Authorization: Bearer <key>'", headers=(("www-authenticate", "Bearer"),)
            )

    return guard


def sglang_asgi(app: SGLangApp, *, api_key: str | None = None, limits: ServerLimits | None = None) -> HTTPApp:
    """The ASGI app serving ``app``'s routes with ``limits`` and, when set, ``api_key``."""
    if api_key is not None and not api_key:
        raise ValueError("sglang_asgi.api_key: must be a non-empty string or None")
    routes = {key: _endpoint(key, route) for key, route in app.routes.items()}
    return HTTPApp(
        routes,
        limits=limits or ServerLimits(),
        error_body=_error_body,
        guard=_bearer(api_key) if api_key is not None else None,
    )
