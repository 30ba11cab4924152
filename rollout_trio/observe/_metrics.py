"""Prometheus metrics of a run: an executor observer, a transport wrapper, the loop lag.

Every object owns its :class:`prometheus_client.CollectorRegistry` (never the global one,
so two executors in one process do not collide) and registers its metrics there;
:func:`~rollout_trio.observe.metrics_app` serves a registry at ``/metrics``.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import httpx
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .._trajectory import Trajectory
from ..executor._observer import Status, oldest_version

__all__ = ["ExecutorMetrics", "ObservedTransport", "WindowRate", "result_size", "watch_loop_lag"]

#: version lag of consumed data: exact for the usual small lags, coarse beyond.
LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
_wall_time = time.time
#: seconds of one HTTP call to an inference server.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class WindowRate:
    """Amounts per second over the last ``window`` seconds (of ``clock``), for ``series``
    counts added together (episodes and tokens, say); memory bounded by the events in the
    window, whether or not anyone reads the rate."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic, *, series: int = 1) -> None:
        if not window > 0:
            raise ValueError(f"WindowRate.window: must be > 0, got {window!r}")
        self.window = window
        self._clock = clock
        self._born = clock()
        self._events: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque()
        self._sums: list[float] = [0] * series

    def add(self, *amounts: float) -> None:
        """Count ``amounts`` (one per series) now."""
        now = self._clock()
        events = self._events
        events.append((now, amounts))
        sums = self._sums
        for i, amount in enumerate(amounts):
            sums[i] += amount
        if events[0][0] <= now - self.window:
            self._expire(now)

    def _expire(self, now: float) -> None:
        events, sums, horizon = self._events, self._sums, now - self.window
        while events and events[0][0] <= horizon:
            for i, amount in enumerate(events.popleft()[1]):
                sums[i] -= amount
        if not events:
            self._sums = [0] * len(sums)  # no float drift once empty

    def per_second(self, series: int = 0) -> float:
        """The rate of ``series`` over the window (over the time since creation while that is shorter)."""
        now = self._clock()
        self._expire(now)
        span = min(self.window, now - self._born)
        return float(self._sums[series]) / span if span > 0 else 0.0


class _RateCollector(Collector):
    """Gauges whose value is computed at scrape time."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterable[Metric]:
        for name, (doc, value) in self._gauges.items():
            yield GaugeMetricFamily(name, doc, value=value())


_last_size: tuple[Any, tuple[int, int, list[float]]] | None = None
#: above this many loss-mask elements one torch reduction is cheaper than a Python list.
_LIST_SUM_MAX = 4096


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
    if isinstance(result, Trajectory):
        ids = result.input_ids
        rows = ids.shape[0] if ids.ndim > 1 else 1
        mask = result.loss_mask
        if mask is None:
            tokens = 0
        elif mask.ndim == 2 and mask.numel() <= _LIST_SUM_MAX and not mask.is_floating_point():
            tokens = sum(map(sum, mask.tolist()))  # an integer mask: the same count as mask.sum(), no torch op
        else:
            tokens = int(mask.sum())
        rewards_t = result.rewards
        if rewards_t is None:
            rewards = []
        else:
            rewards = rewards_t.tolist() if rewards_t.ndim == 1 else rewards_t.reshape(-1).tolist()
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


_STATUSES = ("accepted", "rejected", "failed", "cancelled")
_LAG_BOUNDS = tuple(float(b) for b in LAG_BUCKETS) + (math.inf,)


class ExecutorMetrics:
    """An :class:`~rollout_trio.executor.ExecutorObserver` that keeps Prometheus metrics.

    Pass it to ``open_executor(..., observers=[metrics])`` and serve ``metrics.registry``
    (:func:`~rollout_trio.observe.open_metrics_server`). Metric names start with
    ``rollout_trio_``; ``rollout_trio_reward`` is labelled by the weight version the task
    started at (one label value per version the run saw).

    Each task event only updates plain Python counters (no lock, no prometheus-client
    call: at thousands of episodes per second these dominated the cost of watching);
    a collector registered on ``registry`` turns them into the metric families at scrape
    time. This assumes what the executor guarantees: observer calls come from the Trio
    thread only. A scrape from that thread (the package's HTTP server) sees a consistent
    state; a scrape from another thread may see one event half applied, never a crash.
    ``loop_lag`` is a real :class:`prometheus_client.Gauge` (set four times a second).

    Args:
        registry: where to register (default: a new registry of its own).
        rate_window: seconds over which ``*_per_second`` gauges average.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, rate_window: float = 10.0) -> None:
        if not rate_window > 0:
            raise ValueError(f"ExecutorMetrics.rate_window: must be > 0, got {rate_window!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._created = time.time()
        self._submitted = 0
        self._finished: dict[str, int] = dict.fromkeys(_STATUSES, 0)  # all present at 0 from the start
        self._buffered = 0
        self._stalled = 0  # consumer calls past stall_warning_s
        self._consumed = 0
        self._episodes = 0
        self._tokens = 0
        self._version = 0
        self._lags: dict[int, int] = {}  # lag -> how many consumed tasks had it (bucketed at scrape time)
        self._rewards: dict[int, list[Any]] = {}  # version -> [count, sum, created], in first-seen order
        self._started: dict[int, int] = {}  # running task -> the version it started at
        self._queued: set[int] = set()
        self._rates = WindowRate(rate_window, series=2)  # accepted episodes, tokens
        self.registry.register(_ExecutorCollector(self))
        self.loop_lag = Gauge(
            "rollout_trio_loop_lag_seconds", "How late the Trio loop woke a periodic task", registry=self.registry
        )
        self.registry.register(
            _RateCollector(
                {
                    "rollout_trio_episodes_per_second": ("Accepted episodes per second", self._rates.per_second),
                    "rollout_trio_tokens_per_second": ("Generated tokens per second", partial(self._rates.per_second, 1)),
                }
            )
        )

    # -- ExecutorObserver ------------------------------------------------------------------

    def task_queued(self, task_id: int, *, is_eval: bool, time: float) -> None:
        self._submitted += 1
        self._queued.add(task_id)

    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        self._queued.discard(task_id)
        self._started[task_id] = version
        self._version = version

    def task_finished(self, task_id: int, *, status: Status, reason: str | None, result: Any, time: float) -> None:
        self._queued.discard(task_id)
        version = self._started.pop(task_id, None)
        finished = self._finished
        finished[status] = finished.get(status, 0) + 1
        if status != "accepted":
            return
        self._buffered += 1
        episodes, tokens, rewards = result_size(result)
        self._episodes += episodes
        self._tokens += tokens
        self._rates.add(episodes, tokens)
        if rewards:
            if version is None:  # started before this observer was attached
                version = oldest_version(result) or 0
            acc = self._rewards.get(version)
            if acc is None:
                acc = self._rewards[version] = [0, 0.0, _wall_time()]
            total = acc[1]
            for value in rewards:  # in order, as Summary.observe added them: the same float sum
                total += value
            acc[0] += len(rewards)
            acc[1] = total

    def task_consumed(self, task_id: int, *, version: int, lag: int, time: float) -> None:
        self._buffered -= 1
        self._consumed += 1
        lags = self._lags
        lags[lag] = lags.get(lag, 0) + 1
        self._version = version

    def call_stalled(self, call: str, waiting_on: str, waited: float) -> None:
        self._stalled += 1

    def call_unstalled(self, call: str) -> None:
        self._stalled -= 1

    # -- scrape time -----------------------------------------------------------------------

    def _families(self, describe: bool = False) -> Iterator[Metric]:
        """The metric families, in the order (and with the samples) of the former prometheus metrics."""
        created = self._created if _created_series() else None
        counter, gauge = CounterMetricFamily, GaugeMetricFamily

        def one(family: Any, name: str, doc: str, value: float) -> Any:
            f = family(name, doc, labels=[])
            if not describe:
                if family is counter:
                    f.add_metric([], float(value), created)
                else:
                    f.add_metric([], float(value))
            return f

        yield one(counter, "rollout_trio_tasks_submitted", "Tasks submitted", self._submitted)
        finished = counter("rollout_trio_tasks_finished", "Tasks that ended, by status", labels=["status"])
        if not describe:
            for status, count in list(self._finished.items()):
                finished.add_metric([status], float(count), created)
        yield finished
        yield one(gauge, "rollout_trio_tasks_queued", "Tasks waiting for capacity", len(self._queued))
        yield one(gauge, "rollout_trio_tasks_running", "Tasks whose workflow runs", len(self._started))
        yield one(gauge, "rollout_trio_tasks_buffered", "Accepted tasks no trainer call took yet", self._buffered)
        yield one(
            gauge, "rollout_trio_calls_stalled", "Consumer calls waiting past stall_warning_s without progress", self._stalled
        )
        yield one(counter, "rollout_trio_tasks_consumed", "Accepted tasks a trainer call took", self._consumed)
        yield one(counter, "rollout_trio_episodes", "Episodes (trajectory rows) accepted", self._episodes)
        yield one(counter, "rollout_trio_tokens", "Generated tokens in accepted episodes", self._tokens)
        yield one(
            gauge, "rollout_trio_engine_version", "Engine weight version at the latest task start or consumption", self._version
        )
        lag = HistogramMetricFamily(
            "rollout_trio_consumed_version_lag", "Versions the oldest token of consumed data is behind the engine", labels=[]
        )
        if not describe:
            counts = [0] * len(_LAG_BOUNDS)
            lag_sum = 0.0
            for value, n in list(self._lags.items()):
                counts[bisect.bisect_left(_LAG_BOUNDS, value)] += n
                lag_sum += value * n
            cumulative = list(itertools.accumulate(counts))
            buckets = [(floatToGoString(b), float(c)) for b, c in zip(_LAG_BOUNDS, cumulative, strict=True)]
            lag.add_metric([], buckets, float(lag_sum))
            if created is not None:  # the families of custom collectors take no created time
                lag.samples.append(Sample(lag.name + "_created", {}, created, None))
        yield lag
        reward = SummaryMetricFamily(
            "rollout_trio_reward", "Episode rewards, by the version the task started at", labels=["version"]
        )
        if not describe:
            for version, (count, total, born) in list(self._rewards.items()):
                reward.add_metric([str(version)], count, total)
                if created is not None:
                    reward.samples.append(Sample(reward.name + "_created", {"version": str(version)}, born, None))
        yield reward


def _created_series() -> bool:
    """Whether prometheus-client emits ``*_created`` samples (``PROMETHEUS_DISABLE_CREATED_SERIES``)."""
    return bool(getattr(prometheus_metrics, "_use_created", True))


class _ExecutorCollector(Collector):
    """The :class:`ExecutorMetrics` families, built from its counters when scraped."""

    def __init__(self, metrics: ExecutorMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:  # the names, so that the registry refuses duplicates
        return list(self._metrics._families(describe=True))

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics._families())


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
