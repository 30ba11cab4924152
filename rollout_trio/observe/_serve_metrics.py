"""Metrics of ``rollout-trio serve``: read from the app's counters at scrape time, plus route timing.

The SGLang app already counts what it does (``app.counters``: generate requests by
outcome, abort requests, output tokens, weight updates); :class:`ServeMetrics` exposes those
as Prometheus counters without touching the request path, and times each route.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._metrics import LATENCY_BUCKETS

__all__ = ["ServeMetrics"]

_COUNTERS = (
    "generate_received",
    "generate_finished",
    "generate_aborted",
    "generate_cancelled",
    "generate_interrupted",
    "abort_requests",
    "output_tokens",
    "pauses",
    "weight_updates",
)

R = TypeVar("R")


class _AppCollector(Collector):
    def __init__(self, app: Any, window: float) -> None:
        self.app = app
        self.window = window
        self._history: collections.deque[tuple[float, float]] = collections.deque()

    def _tokens_per_second(self, tokens: float) -> float:
        """Output tokens per second between this scrape and the oldest one within the window."""
        now = time.monotonic()
        self._history.append((now, tokens))
        while len(self._history) > 2 and self._history[1][0] <= now - self.window:
            self._history.popleft()
        (t0, n0), (t1, n1) = self._history[0], self._history[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def collect(self) -> Iterable[Metric]:
        counters = self.app.counters
        for key in _COUNTERS:
            yield CounterMetricFamily(f"rollout_trio_serve_{key}", f"serve: {key.replace('_', ' ')}", value=counters[key])
        yield GaugeMetricFamily(
            "rollout_trio_serve_generate_in_flight", "serve: /generate requests in progress", value=len(self.app._live)
        )
        yield GaugeMetricFamily(
            "rollout_trio_serve_tokens_per_second",
            "serve: output tokens per second between scrapes",
            value=self._tokens_per_second(counters["output_tokens"]),
        )
        yield GaugeMetricFamily("rollout_trio_engine_version", "serve: the engine's weight version", value=self.app.engine.get_version())


class ServeMetrics:
    """The registry of one ``SGLangApp``: its counters, route timing and the loop lag."""

    def __init__(self, app: Any, *, rate_window: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_AppCollector(app, rate_window))
        self.latency = Histogram(
            "rollout_trio_serve_request_seconds", "serve: seconds per request, by route", ["route"],
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.loop_lag = Gauge("rollout_trio_loop_lag_seconds", "How late the Trio loop woke a periodic task", registry=self.registry)

    def timed(self, path: str, route: Callable[[Any], Awaitable[R]]) -> Callable[[Any], Awaitable[R]]:
        """``route`` recording its duration under ``path``."""
        histogram = self.latency.labels(path)

        async def timed_route(body: Any) -> R:
            start = time.perf_counter()
            try:
                return await route(body)
            finally:
                histogram.observe(time.perf_counter() - start)

        return timed_route

    def routes(self) -> dict[tuple[str, str], Callable[[Any], Awaitable[Any]]]:
        """``GET /metrics``, ``/live`` and ``/live.json`` as routes of the SGLang app."""
        from ..server._sglang_app import Reply
        from ._app import live_json_response, live_page_response, metrics_response

        async def metrics(_body: Any) -> Reply:
            return Reply(200, metrics_response(self.registry))

        async def live(_body: Any) -> Reply:
            return Reply(200, live_page_response())

        async def live_json(_body: Any) -> Reply:
            return Reply(200, live_json_response(self.registry, "rollout-trio serve"))

        return {("GET", "/metrics"): metrics, ("GET", "/live"): live, ("GET", "/live.json"): live_json}
