"""StatsRecorder aggregates in O(keys) memory (issue 11 item 5)."""

from __future__ import annotations

import math
import statistics
import threading

import pytest

from rollout_trio import GroupStatistics
from rollout_trio.workflow_context import StatsRecorder


def test_memory_does_not_grow_with_the_number_of_groups() -> None:
    rec = StatsRecorder()
    rec.record("rollout", GroupStatistics(4, 3, 3).as_dict())
    keys_after_one = len(rec.summaries())
    for i in range(20_000):
        rec.record("rollout", GroupStatistics(4, i % 5, i % 3).as_dict())
    # Everything the recorder keeps: one aggregate per key, nothing per record.
    assert keys_after_one == 7
    assert len(rec._aggregates) == 7 and len(vars(rec)) == 2
    assert rec.summaries()["rollout/target_slot_count"].count == 20_001


def test_summaries_match_an_independent_oracle() -> None:
    values = [0.5, -2.0, 3.25, 1e6, -7.0, 0.0]
    rec = StatsRecorder()
    for v in values:
        rec.record("eval-rollout", {"reward": v})
    rec.record("rollout", {"reward": 9.0})
    s = rec.summaries()["eval-rollout/reward"]
    assert (s.count, s.total, s.min, s.max) == (6, math.fsum(values), min(values), max(values))
    assert s.sum_of_squares == pytest.approx(math.fsum(v * v for v in values))
    assert s.mean == pytest.approx(statistics.fmean(values))
    assert s.std == pytest.approx(statistics.pstdev(values), rel=1e-9)
    assert rec.export() == {"eval-rollout/reward": pytest.approx(statistics.fmean(values)), "rollout/reward": 9.0}
    assert rec.summaries() == {}  # export resets by default


def test_sums_are_exact_where_the_values_are_exactly_representable() -> None:
    """Small dyadic values add without rounding, so the aggregates compare exactly: an
    approximate comparison would hide an off-by-one in a sum (mutation testing, issue 32)."""
    rec = StatsRecorder()
    for v in (0.5, -2.0, 3.25):
        rec.record("rollout", {"reward": v})
    s = rec.summaries()["rollout/reward"]
    assert (s.count, s.total, s.sum_of_squares, s.min, s.max) == (3, 1.75, 0.25 + 4.0 + 10.5625, -2.0, 3.25)
    # One value: the variance is exactly 0.
    rec.record("eval-rollout", {"reward": 4.0})
    assert rec.summaries()["eval-rollout/reward"].std == 0.0


def test_concurrent_records_are_all_counted() -> None:
    rec = StatsRecorder()

    def work() -> None:
        for _ in range(2000):
            rec.record("rollout", {"x": 1.0})

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.summaries()["rollout/x"].count == 8000
