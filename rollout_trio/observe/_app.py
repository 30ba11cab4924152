"""Serving metrics: ``/metrics`` (Prometheus text), ``/live`` (the live page), ``/live.json``.

:func:`metrics_app` is the ASGI app, on the package's one HTTP layer (limits included);
:func:`open_metrics_server` runs it on Hypercorn next to an executor, with the loop-lag watch. ``rollout-trio serve`` answers
the same three paths from its own app (:func:`metrics_response` and friends).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .._http import HTTPApp, Request, Response, ServerLimits, json_bytes
from ._metrics import ExecutorMetrics, watch_loop_lag
from ._page import PAGE_HTML
from ._snapshot import snapshot_from_text

__all__ = ["live_json_response", "live_page_response", "metrics_app", "metrics_response", "open_metrics_server"]


def metrics_response(registry: CollectorRegistry) -> Response:
    """``registry`` in Prometheus text format."""
    return Response(200, generate_latest(registry), CONTENT_TYPE_LATEST)


def live_json_response(registry: CollectorRegistry, source: str) -> Response:
    """The :mod:`snapshot <rollout_trio.observe._snapshot>` the live page polls."""
    return Response(200, json_bytes(snapshot_from_text(generate_latest(registry).decode(), source)))


def live_page_response() -> Response:
    """The live page (self-contained: no script, style or font from the network)."""
    return Response(200, PAGE_HTML.encode(), "text/html; charset=utf-8")


def _error_body(status: int, message: str) -> bytes:
    return json_bytes({"error": {"message": message, "code": status}})


def metrics_app(registry: CollectorRegistry, *, source: str = "executor", limits: ServerLimits | None = None) -> HTTPApp:
    """An ASGI app serving ``registry``: ``/metrics``, ``/live``, ``/live.json`` (``/`` redirects to ``/live``)."""

    async def metrics(_request: Request) -> Response:
        return metrics_response(registry)

    async def live_json(_request: Request) -> Response:
        return live_json_response(registry, source)

    async def live(_request: Request) -> Response:
        return live_page_response()

    async def root(_request: Request) -> Response:
        return Response(307, b"", None, headers=(("location", "/live"),))

    routes = {("GET", "/metrics"): metrics, ("GET", "/live.json"): live_json, ("GET", "/live"): live, ("GET", "/"): root}
    return HTTPApp(routes, limits=limits or ServerLimits(), error_body=_error_body)


@asynccontextmanager
async def open_metrics_server(
    metrics: ExecutorMetrics, host: str = "127.0.0.1", port: int = 0, *, loop_lag_interval: float = 0.25
) -> AsyncIterator[str]:
    """Serve ``metrics`` on ``host:port`` (0: a free port) for the block; yields the base URL.

    Also watches the Trio loop's lag (``rollout_trio_loop_lag_seconds``). Leaving the block
    stops the server.

    Raises:
        OSError: the address cannot be bound.
    """
    from .._http import serve_app

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop_lag, metrics.loop_lag, loop_lag_interval)
        bound = await nursery.start(serve_app, metrics_app(metrics.registry), host, port, ServerLimits())
        bound_host, bound_port = bound[0]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        try:
            yield f"http://{shown}:{bound_port}"
        finally:
            nursery.cancel_scope.cancel()
