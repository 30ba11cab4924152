"""Prometheus metrics of a run: an executor observer, a transport wrapper, the loop lag.

Every object owns its :class:`prometheus_client.CollectorRegistry` (never the global one,
so two executors in one process do not collide) and registers its metrics there;
:func:`~rollout_trio.observe.metrics_app` serves a registry at ``/metrics``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..executor._observer import Status, oldest_version

__all__ = ["ExecutorMetrics", "ObservedTransport", "WindowRate", "result_size", "watch_loop_lag"]

#: version lag of consumed data: exact for the usual small lags, coarse beyond.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
#: seconds of one HTTP call to an inference server.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class WindowRate:
    """Events per second over the last ``window`` seconds (of ``clock``), in O(events in window)."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not window > 0:
            raise ValueError(f"WindowRate.window: must be > 0, got {window!r}")
        self.window = window
        self._clock = clock
        self._born = clock()
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._sum = 0.0

    def add(self, amount: float) -> None:
        """Count ``amount`` events now."""
        self._events.append((self._clock(), amount))
        self._sum += amount

    def per_second(self) -> float:
        """The rate over the window (over the time since creation while that is shorter)."""
        now = self._clock()
        while self._events and self._events[0][0] <= now - self.window:
            self._sum -= self._events.popleft()[1]
        if not self._events:
            self._sum = 0.0  # no float drift once empty
        span = min(self.window, now - self._born)
        return self._sum / span if span > 0 else 0.0


class _RateCollector(Collector):
    """Gauges whose value is computed at scrape time."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterable[Metric]:
        for name, (doc, value) in self._gauges.items():
            yield GaugeMetricFamily(name, doc, value=value())


_last_size: tuple[Any, tuple[int, int, list[float]]] | None = None


def result_size(result: Any) -> tuple[int, int, list[float]]:
    """``(episodes, generated tokens, rewards)`` of a task's result (a Trajectory or interactions).

    The last answer is remembered: the metrics and the trace ask about the same result in turn.
    """
    global _last_size
    if _last_size is not None and _last_size[0] is result:
        return _last_size[1]
    size = _result_size(result)
    _last_size = (result, size)
    return size


def _result_size(result: Any) -> tuple[int, int, list[float]]:
    from .._trajectory import Trajectory

    if isinstance(result, Trajectory):
        rows = int(result.input_ids.shape[0]) if result.input_ids.dim() > 1 else 1
        tokens = int(result.loss_mask.sum()) if result.loss_mask is not None else 0
        rewards = result.rewards.reshape(-1).tolist() if result.rewards is not None else []
        return rows, tokens, rewards
    if isinstance(result, dict):
        tokens = 0
        rewards = []
        for item in result.values():
            response = getattr(item, "model_response", None)
            tokens += len(getattr(response, "output_tokens", ()) or ())
            reward = getattr(item, "reward", None)
            if isinstance(reward, int | float):
                rewards.append(float(reward))
        return len(result), tokens, rewards
    return 0, 0, []


class ExecutorMetrics:
    """An :class:`~rollout_trio.executor.ExecutorObserver` that keeps Prometheus metrics.

    Pass it to ``open_executor(..., observers=[metrics])`` and serve ``metrics.registry``
    (:func:`~rollout_trio.observe.open_metrics_server`). Metric names start with
    ``rollout_trio_``; ``rollout_trio_reward`` is labelled by the weight version the task
    started at (one label value per version the run saw).

    Args:
        registry: where to register (default: a new registry of its own).
        rate_window: seconds over which ``*_per_second`` gauges average.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, rate_window: float = 10.0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.submitted = Counter("rollout_trio_tasks_submitted", "Tasks submitted", registry=r)
        self.finished = Counter(
            "rollout_trio_tasks_finished", "Tasks that ended, by status", ["status"], registry=r
        )
        for status in ("accepted", "rejected", "failed", "cancelled"):
            self.finished.labels(status)  # present at 0 from the start
        self.queued = Gauge("rollout_trio_tasks_queued", "Tasks waiting for capacity", registry=r)
        self.running = Gauge("rollout_trio_tasks_running", "Tasks whose workflow runs", registry=r)
        self.buffered = Gauge("rollout_trio_tasks_buffered", "Accepted tasks no trainer call took yet", registry=r)
        self.consumed = Counter("rollout_trio_tasks_consumed", "Accepted tasks a trainer call took", registry=r)
        self.episodes = Counter("rollout_trio_episodes", "Episodes (trajectory rows) accepted", registry=r)
        self.tokens = Counter("rollout_trio_tokens", "Generated tokens in accepted episodes", registry=r)
        self.version = Gauge("rollout_trio_engine_version", "Engine weight version at the latest task start or consumption", registry=r)
        self.lag = Histogram(
            "rollout_trio_consumed_version_lag",
            "Versions the oldest token of consumed data is behind the engine",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.reward = Summary("rollout_trio_reward", "Episode rewards, by the version the task started at", ["version"], registry=r)
        self.loop_lag = Gauge("rollout_trio_loop_lag_seconds", "How late the Trio loop woke a periodic task", registry=r)
        self._episode_rate = WindowRate(rate_window)
        self._token_rate = WindowRate(rate_window)
        r.register(
            _RateCollector(
                {
                    "rollout_trio_episodes_per_second": ("Accepted episodes per second", self._episode_rate.per_second),
                    "rollout_trio_tokens_per_second": ("Generated tokens per second", self._token_rate.per_second),
                }
            )
        )
        self._started: dict[int, int] = {}
        self._rewards: dict[int, Any] = {}  # version -> its labelled summary (labels() costs a lock and a dict)
        self._queued: set[int] = set()

    # -- ExecutorObserver ------------------------------------------------------------------

    def task_queued(self, task_id: int, *, is_eval: bool, time: float) -> None:
        self.submitted.inc()
        self._queued.add(task_id)
        self.queued.inc()

    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        self._leave_queue(task_id)
        self._started[task_id] = version
        self.running.inc()
        self.version.set(version)

    def task_finished(self, task_id: int, *, status: Status, reason: str | None, result: Any, time: float) -> None:
        self._leave_queue(task_id)
        version = self._started.pop(task_id, None)
        if version is not None:
            self.running.dec()
        self.finished.labels(status).inc()
        if status != "accepted":
            return
        self.buffered.inc()
        episodes, tokens, rewards = result_size(result)
        self.episodes.inc(episodes)
        self.tokens.inc(tokens)
        self._episode_rate.add(episodes)
        self._token_rate.add(tokens)
        if rewards:
            if version is None:  # started before this observer was attached
                version = oldest_version(result) or 0
            summary = self._rewards.get(version)
            if summary is None:
                summary = self._rewards[version] = self.reward.labels(str(version))
            for value in rewards:
                summary.observe(value)

    def task_consumed(self, task_id: int, *, version: int, lag: int, time: float) -> None:
        self.buffered.dec()
        self.consumed.inc()
        self.lag.observe(lag)
        self.version.set(version)

    def _leave_queue(self, task_id: int) -> None:
        if task_id in self._queued:
            self._queued.discard(task_id)
            self.queued.dec()


async def watch_loop_lag(gauge: Gauge, interval: float = 0.25) -> None:
    """Forever: sleep ``interval`` and set ``gauge`` to how much later than asked Trio woke us.

    A lag that grows means something blocks the event loop (a synchronous reward function,
    tokenization of a long prompt on the Trio thread).
    """
    while True:
        before = trio.current_time()
        await trio.sleep(interval)
        gauge.set(max(0.0, trio.current_time() - before - interval))


def _server_of(url: httpx.URL) -> str:
    return f"{url.scheme}://{url.host}:{url.port}" if url.port else f"{url.scheme}://{url.host}"


_ABORT_PATHS = ("/abort_request", "/abort")


class ObservedTransport(httpx.AsyncBaseTransport):
    """Wraps the transport of a :class:`~rollout_trio.engines.RemoteEngine` to measure each server.

    ``RemoteEngine(addresses, transport=ObservedTransport(TrioTransport(), registry))``
    keeps, per server, the calls in flight, their latency (until the answer's head), the
    calls by path kind and the aborts sent.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport, registry: CollectorRegistry) -> None:
        self.inner = inner
        self.in_flight = Gauge("rollout_trio_server_in_flight", "HTTP calls in flight, per server", ["server"], registry=registry)
        self.latency = Histogram(
            "rollout_trio_server_request_seconds",
            "Seconds per HTTP call to an inference server (generation segments), per server",
            ["server"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.aborts = Counter("rollout_trio_server_aborts", "Aborts sent, per server", ["server"], registry=registry)
        self.errors = Counter(
            "rollout_trio_server_errors", "HTTP calls that failed before an answer, per server", ["server"], registry=registry
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        server = _server_of(request.url)
        path = request.url.path
        if path.endswith(_ABORT_PATHS):
            self.aborts.labels(server).inc()
        in_flight = self.in_flight.labels(server)
        in_flight.inc()
        start = time.perf_counter()
        try:
            response = await self.inner.handle_async_request(request)
        except Exception:  # not Cancelled: a cancelled call is the caller's choice, not a failure
            self.errors.labels(server).inc()
            raise
        finally:
            in_flight.dec()
        if "generate" in path or "completions" in path:
            self.latency.labels(server).observe(time.perf_counter() - start)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
