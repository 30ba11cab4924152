"""One view of a run's metrics, whatever it came from: ``top`` and the live page both show it.

A snapshot is a plain JSON-able dict (the live page fetches it as ``/live.json``)::

    {"source": str, "time": float,
     "counts": [[label, value], ...],            # what exists, in display order
     "rates": [[label, per_second], ...],
     "version": int | None,                      # the engine's weight version
     "lag": {"buckets": [[label, count], ...], "count": n, "mean": x | None},
     "rewards": [[version, count, mean], ...],   # by weight version, ascending
     "servers": [{"server", "in_flight", "calls", "mean_latency", "aborts", "errors"}, ...],
     "loop_lag": seconds | None}

:func:`snapshot_from_text` builds one from Prometheus text (an executor's or ``serve``'s
``/metrics``), parsed by prometheus-client's own parser.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["COUNTS", "RATES", "Snapshot", "snapshot_from_text"]

Snapshot = dict[str, Any]

#: (label shown, sample name, label filter): executor metrics first, then ``serve``'s.
COUNTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("submitted", "rollout_trio_tasks_submitted_total", {}),
    ("queued", "rollout_trio_tasks_queued", {}),
    ("running", "rollout_trio_tasks_running", {}),
    ("accepted", "rollout_trio_tasks_finished_total", {"status": "accepted"}),
    ("rejected", "rollout_trio_tasks_finished_total", {"status": "rejected"}),
    ("failed", "rollout_trio_tasks_finished_total", {"status": "failed"}),
    ("cancelled", "rollout_trio_tasks_finished_total", {"status": "cancelled"}),
    ("buffered", "rollout_trio_tasks_buffered", {}),
    ("stalled calls", "rollout_trio_calls_stalled", {}),
    ("consumed", "rollout_trio_tasks_consumed_total", {}),
    ("episodes", "rollout_trio_episodes_total", {}),
    ("tokens", "rollout_trio_tokens_total", {}),
    ("generating", "rollout_trio_serve_generate_in_flight", {}),
    ("generate requests", "rollout_trio_serve_generate_received_total", {}),
    ("generate finished", "rollout_trio_serve_generate_finished_total", {}),
    ("generate aborted", "rollout_trio_serve_generate_aborted_total", {}),
    ("generate cancelled", "rollout_trio_serve_generate_cancelled_total", {}),
    ("abort requests", "rollout_trio_serve_abort_requests_total", {}),
    ("output tokens", "rollout_trio_serve_output_tokens_total", {}),
    ("weight updates", "rollout_trio_serve_weight_updates_total", {}),
)
RATES: tuple[tuple[str, str], ...] = (
    ("episodes/s", "rollout_trio_episodes_per_second"),
    ("tokens/s", "rollout_trio_tokens_per_second"),
    ("tokens/s", "rollout_trio_serve_tokens_per_second"),
)


def _number(value: float) -> float | int:
    return int(value) if value.is_integer() else value


def snapshot_from_text(text: str, source: str) -> Snapshot:
    """The snapshot of Prometheus exposition ``text`` (``source`` names where it came from).

    Raises:
        ValueError: ``text`` is not Prometheus text.
    """
    values: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name].append((dict(sample.labels), float(sample.value)))

    def one(name: str, match: dict[str, str] | None = None) -> float | None:
        for labels, value in values.get(name, ()):
            if match is None or all(labels.get(k) == v for k, v in match.items()):
                return value
        return None

    counts = [[label, _number(v)] for label, name, match in COUNTS if (v := one(name, match)) is not None]
    rates = [[label, v] for label, name in RATES if (v := one(name)) is not None]
    version = one("rollout_trio_engine_version")
    return {
        "source": source,
        "time": time.time(),
        "counts": counts,
        "rates": rates,
        "version": None if version is None else int(version),
        "lag": _histogram(values, "rollout_trio_consumed_version_lag"),
        "rewards": _by_version(values),
        "servers": _servers(values),
        "loop_lag": one("rollout_trio_loop_lag_seconds"),
    }


def _histogram(values: dict[str, list[tuple[dict[str, str], float]]], name: str) -> dict[str, Any]:
    """Per-bucket counts (not cumulative), labelled ``"<= le"``; empty buckets beyond the last used one dropped."""
    cumulative = sorted(
        ((float(labels["le"]), value) for labels, value in values.get(name + "_bucket", ())), key=lambda p: p[0]
    )
    buckets: list[list[Any]] = []
    below = 0.0
    lo: float | None = None
    for le, count in cumulative:
        label = f"> {_fmt(lo)}" if math.isinf(le) else (f"{_fmt(le)}" if lo is None or le - lo == 1 else f"{_fmt(lo + 1)}-{_fmt(le)}")
        buckets.append([label, _number(count - below)])
        below, lo = count, le
    while buckets and buckets[-1][1] == 0:
        buckets.pop()
    total = sum((v for _, v in values.get(name + "_count", ())), 0.0)
    mean = sum(v for _, v in values.get(name + "_sum", ())) / total if total else None
    return {"buckets": buckets, "count": _number(total), "mean": mean}


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:g}"


def _by_version(values: dict[str, list[tuple[dict[str, str], float]]]) -> list[list[Any]]:
    sums = {labels["version"]: v for labels, v in values.get("rollout_trio_reward_sum", ())}
    rows = []
    for labels, count in values.get("rollout_trio_reward_count", ()):
        version = labels["version"]
        if count:
            rows.append([int(version), _number(count), sums.get(version, 0.0) / count])
    return sorted(rows)


def _servers(values: dict[str, list[tuple[dict[str, str], float]]]) -> list[dict[str, Any]]:
    table: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"in_flight": 0, "calls": 0, "mean_latency": None, "aborts": 0, "errors": 0}
    )
    for labels, v in values.get("rollout_trio_server_in_flight", ()):
        table[labels["server"]]["in_flight"] = _number(v)
    latency_sum = {labels["server"]: v for labels, v in values.get("rollout_trio_server_request_seconds_sum", ())}
    for labels, v in values.get("rollout_trio_server_request_seconds_count", ()):
        row = table[labels["server"]]
        row["calls"] = _number(v)
        row["mean_latency"] = latency_sum.get(labels["server"], 0.0) / v if v else None
    for key, name in (("aborts", "rollout_trio_server_aborts_total"), ("errors", "rollout_trio_server_errors_total")):
        for labels, v in values.get(name, ()):
            table[labels["server"]][key] = _number(v)
    return [{"server": server, **row} for server, row in sorted(table.items())]
