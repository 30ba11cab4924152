"""Serving metrics: ``/metrics`` (Prometheus text), ``/live`` (the live page), ``/live.json``.

:func:`metrics_app` is the ASGI app, on the package's one HTTP layer (limits included);
:func:`open_metrics_server` runs it on Hypercorn next to an executor, with the loop-lag watch. ``rollout-trio serve`` answers
the same three paths from its own app (:func:`metrics_response` and friends).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .._http import HTTPApp, Request, Response, ServerLimits, json_bytes
from ._metrics import ExecutorMetrics, watch_loop_lag
from ._page import PAGE_HTML
from ._snapshot import snapshot_from_text

log = logging.getLogger("rollout_trio.observe")

#: The most connections the metrics server beside a run keeps open at once.
METRICS_CONNECTION_CAP = 64

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


async def _observer(name: str, fn: Any, *args: Any) -> None:
    """Run one observer task: its failure is logged and stops it alone."""
    try:
        await fn(*args)
    except Exception:
        log.exception("the %s failed and stopped; the run goes on without it", name)


async def _serve_observer(
    app: Any, host: str, port: int, limits: ServerLimits, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
) -> None:
    """``serve_app`` as an observer: an error before it listens is the caller's (raised),
    one after it is logged and stops the server alone."""
    from .._http import serve_app

    started = False

    class _Status:
        def started(self, value: Any = None) -> None:
            nonlocal started
            started = True
            task_status.started(value)

    try:
        await serve_app(app, host, port, limits, task_status=_Status())
    except Exception:
        if not started:
            raise
        log.exception("the metrics server failed and stopped; the run goes on without it")


@asynccontextmanager
async def open_metrics_server(
    metrics: ExecutorMetrics,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    loop_lag_interval: float = 0.25,
    connection_cap: int = METRICS_CONNECTION_CAP,
) -> AsyncIterator[str]:
    """Serve ``metrics`` on ``host:port`` (0: a free port) for the block; yields the base URL.

    Also watches the Trio loop's lag (``rollout_trio_loop_lag_seconds``). Leaving the block
    stops the server. The server is an observer of the block, never part of it: at most
    ``connection_cap`` connections are open at once (more get 503 and are closed, so
    clients cannot take the descriptors a run needs), and once it listens, a failure of the
    server or of the loop-lag watch is logged and stops that observer, never the block.

    Raises:
        OSError: the address cannot be bound.
    """
    limits = ServerLimits(connection_cap=connection_cap, max_body_bytes=64 * 1024, read_deadline=10.0, keep_alive_timeout=30.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_observer, "loop-lag watch", watch_loop_lag, metrics.loop_lag, loop_lag_interval)
        bound = await nursery.start(_serve_observer, metrics_app(metrics.registry, limits=limits), host, port, limits)
        bound_host, bound_port = bound[0]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        try:
            yield f"http://{shown}:{bound_port}"
        finally:
            nursery.cancel_scope.cancel()
