"""The staleness budget: spec/executor.md §3 and every staleness case of §15 (26-54)."""

from __future__ import annotations

import threading

import pytest

from rollout_trio.executor import RolloutConfig, RolloutStat, StalenessManager


class Version:
    def __init__(self, v: int = 0) -> None:
        self.v = v

    def get_version(self) -> int:
        return self.v


def sm(m: int, b: int, s: int, v: int = 0) -> StalenessManager:
    return StalenessManager(Version(v), m, b, s)


def start(manager: StalenessManager, n: int = 1) -> None:
    for _ in range(n):
        manager.on_rollout_enqueued()
        manager.on_rollout_submitted()


def test_worked_example_3_4() -> None:
    version = Version(0)
    m = StalenessManager(version, 8, 4, 1)
    assert m.get_capacity() == 8
    start(m, 8)
    for _ in range(4):
        m.on_rollout_accepted()
    assert m.get_capacity() == 0  # min(8 - 4, 8 - 8)
    version.v = 1  # the trainer consumed 4 and bumped: consumption alone changes nothing
    assert m.get_capacity() == 4


def test_26_fresh_manager() -> None:
    m = sm(10, 4, 2)
    assert m.get_stats() == RolloutStat(0, 0, 0, 0)
    assert m.get_capacity() == 10


def test_27_concurrency_bound() -> None:
    assert sm(100, 32, 10).get_capacity() == 100


def test_28_running_reduces_concurrency() -> None:
    m = sm(5, 2, 10)
    start(m, 3)
    assert m.get_capacity() == 2


def test_29_version_opens_budget() -> None:
    assert sm(100, 4, 2, v=0).get_capacity() == 12
    assert sm(100, 4, 2, v=5).get_capacity() == 32


def test_30_running() -> None:
    m = sm(10, 4, 2)
    start(m, 3)
    assert m.get_capacity() == 7


def test_31_accepted_consume_budget() -> None:
    m = sm(20, 4, 2)
    start(m, 5)
    for _ in range(5):
        m.on_rollout_accepted()
    assert m.get_capacity() == 7


def test_32_full() -> None:
    m = sm(5, 2, 5)
    start(m, 5)
    assert m.get_capacity() == 0


def test_33_negative() -> None:
    m = sm(3, 2, 1)
    start(m, 10)
    assert m.get_capacity() == -7


def test_34_zeros_do_not_crash() -> None:
    assert sm(0, 0, 0).get_capacity() == 1


def test_35_transitions() -> None:
    m = sm(10, 4, 2)
    start(m)
    assert m.get_stats() == RolloutStat(0, 1, 0, 0)
    m.on_rollout_accepted()
    assert m.get_stats() == RolloutStat(0, 0, 1, 0)
    r = sm(10, 4, 2)
    start(r)
    r.on_rollout_rejected()
    assert (r.get_stats().rejected, r.get_stats().accepted) == (1, 0)


def test_36_mixed() -> None:
    m = sm(10, 4, 2)
    start(m, 5)
    for _ in range(3):
        m.on_rollout_accepted()
    for _ in range(2):
        m.on_rollout_rejected()
    assert m.get_stats() == RolloutStat(0, 0, 3, 2)


def test_37_misuse_goes_negative() -> None:
    m = sm(10, 4, 2)
    m.on_rollout_accepted()
    assert (m.get_stats().running, m.get_stats().accepted) == (-1, 1)


def test_38_thread_safe_submits() -> None:
    m = sm(10, 4, 2)
    threads = [threading.Thread(target=start, args=(m, 100)) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (m.get_stats().running, m.get_stats().enqueued) == (1000, 0)


def test_39_concurrent_accept_reject() -> None:
    m = sm(1000, 4, 2)
    start(m, 100)
    threads = [threading.Thread(target=m.on_rollout_accepted) for _ in range(50)]
    threads += [threading.Thread(target=m.on_rollout_rejected) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.get_stats() == RolloutStat(0, 0, 50, 50)


def test_40_concurrent_reads_agree() -> None:
    m = sm(10, 4, 2)
    seen: list[int] = []
    lock = threading.Lock()

    def read() -> None:
        for _ in range(100):
            c = m.get_capacity()
            with lock:
                seen.append(c)

    threads = [threading.Thread(target=read) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 500 and set(seen) == {10}


def test_41_no_staleness() -> None:
    assert sm(100, 8, 0, v=0).get_capacity() == 8
    assert sm(100, 8, 0, v=5).get_capacity() == 48


def test_42_huge_version_bounded_by_concurrency() -> None:
    assert sm(10000, 64, 10, v=1_000_000).get_capacity() == 10000


def test_43_batch_of_one() -> None:
    assert sm(10, 1, 2).get_capacity() == 3


def test_44_rejections_free_budget() -> None:
    m = sm(10, 4, 2)
    for _ in range(10):
        start(m)
        m.on_rollout_rejected()
    assert m.get_capacity() == 10


def test_45() -> None:
    m = sm(20, 8, 3)
    start(m, 20)
    for _ in range(15):
        m.on_rollout_accepted()
    for _ in range(5):
        m.on_rollout_rejected()
    assert m.get_capacity() == 17


def test_46() -> None:
    version = Version(0)
    m = StalenessManager(version, 32, 16, 2)
    start(m, 16)
    for _ in range(14):
        m.on_rollout_accepted()
    for _ in range(2):
        m.on_rollout_rejected()
    version.v = 1
    assert m.get_capacity() == 32
    start(m, 16)
    assert m.get_stats() == RolloutStat(0, 16, 14, 2)


def test_47_negative_then_positive() -> None:
    m = sm(50, 32, 5)
    start(m, 100)
    assert m.get_capacity() < 0
    for _ in range(80):
        m.on_rollout_accepted()
    for _ in range(20):
        m.on_rollout_rejected()
    assert m.get_capacity() > 0


def test_48() -> None:
    m = sm(100, 8, 3)
    start(m, 30)
    for _ in range(30):
        m.on_rollout_accepted()
    assert m.get_capacity() == 2


@pytest.mark.parametrize("m,b,s", [(10, 4, 2), (100, 32, 5), (1, 1, 0), (1000, 128, 10), (50, 16, 3)])
def test_49_stored_verbatim(m: int, b: int, s: int) -> None:
    manager = sm(m, b, s)
    assert (manager.max_concurrent_rollouts, manager.consumer_batch_size, manager.max_staleness) == (m, b, s)
    assert type(manager.get_capacity()) is int


@pytest.mark.parametrize("v", [0, 1, 10, 100, 1000])
def test_50_version_sweep(v: int) -> None:
    assert sm(1000, 32, 5, v=v).get_capacity() == min(1000, (6 + v) * 32)


@pytest.mark.parametrize("r", [0, 5, 10, 50])
def test_51_version_recovered(r: int) -> None:
    m = sm(1000, 16, 2, v=r)
    m.on_version_recovered(r)
    assert m.get_capacity() == 48


@pytest.mark.parametrize("k", [1, 5, 16])
def test_52_version_recovered_keeps_running(k: int) -> None:
    m = sm(1000, 16, 2, v=10)
    start(m, k)
    m.on_version_recovered(10)
    assert m.get_capacity() == 48 - k


def test_53_pending_limit() -> None:
    assert sm(100, 4, 2).get_pending_limit() == 12


def test_54_data_parallel_scaling() -> None:
    cfg = RolloutConfig(consumer_batch_size=256)
    m = StalenessManager.for_data_parallel(
        Version(), max_concurrent_rollouts=cfg.max_concurrent_rollouts, consumer_batch_size=256, max_staleness=0, dp_size=8
    )
    assert (m.max_concurrent_rollouts, m.consumer_batch_size) == (32, 32)
    assert cfg.queue_capacity == 4096  # not scaled
    m3 = StalenessManager.for_data_parallel(
        Version(), max_concurrent_rollouts=3, consumer_batch_size=256, max_staleness=0, dp_size=8
    )
    assert m3.max_concurrent_rollouts == 1


def test_dp_size_validated() -> None:
    with pytest.raises(ValueError, match="dp_size"):
        StalenessManager.for_data_parallel(Version(), max_concurrent_rollouts=1, consumer_batch_size=1, max_staleness=0, dp_size=0)


def test_data_parallel_default_is_one_rank_and_keeps_the_provider() -> None:
    """dp_size defaults to 1 (nothing divided), 1 is valid, the provider is the one given,
    and an odd division rounds down to integers (mutants of for_data_parallel survived)."""
    version = Version(3)
    one = StalenessManager.for_data_parallel(version, max_concurrent_rollouts=5, consumer_batch_size=3, max_staleness=2)
    assert (one.max_concurrent_rollouts, one.consumer_batch_size, one.max_staleness) == (5, 3, 2)
    assert one.version_provider is version and one.get_capacity() == 5
    same = StalenessManager.for_data_parallel(version, max_concurrent_rollouts=5, consumer_batch_size=3, max_staleness=2, dp_size=1)
    assert (same.max_concurrent_rollouts, same.consumer_batch_size) == (5, 3)
    odd = StalenessManager.for_data_parallel(version, max_concurrent_rollouts=7, consumer_batch_size=5, max_staleness=0, dp_size=2)
    assert (odd.max_concurrent_rollouts, odd.consumer_batch_size) == (3, 2)
    assert type(odd.max_concurrent_rollouts) is int and type(odd.consumer_batch_size) is int
    tiny = StalenessManager.for_data_parallel(version, max_concurrent_rollouts=None, consumer_batch_size=1, max_staleness=0, dp_size=4)
    assert (tiny.max_concurrent_rollouts, tiny.consumer_batch_size) == (1, 1)  # floored at 1, not 2


@pytest.mark.parametrize("bad", [True, 2.0, "2", -1])
def test_dp_size_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match=r"dp_size: must be an integer >= 1, got"):
        StalenessManager.for_data_parallel(Version(), max_concurrent_rollouts=4, consumer_batch_size=4, max_staleness=0, dp_size=bad)  # type: ignore[arg-type]


def test_counters_move_by_one_each_way() -> None:
    """Each transition moves its counters by exactly one (enqueued twice is 2, not 1; a
    dequeue takes one back; a discard returns one accepted's budget and counts a rejection)."""
    m = sm(8, 2, 0)
    for _ in range(3):
        m.on_rollout_enqueued()
    assert m.get_stats() == RolloutStat(enqueued=3)
    m.on_rollout_dequeued()
    assert m.get_stats() == RolloutStat(enqueued=2)
    m.on_rollout_dequeued()
    m.on_rollout_submitted()
    m.on_rollout_rejected()
    assert m.get_stats() == RolloutStat(rejected=1)
    start(m)
    m.on_rollout_accepted()
    assert m.get_stats() == RolloutStat(accepted=1, rejected=1)
    assert m.get_capacity() == 1  # (0 + 0 + 1) * 2 - 1
    m.on_rollout_discarded()
    assert m.get_stats() == RolloutStat(accepted=0, rejected=2)
    assert m.get_capacity() == 2


def test_recovery_and_a_batch_size_of_one() -> None:
    """With consumer_batch_size 1 and max_concurrent_rollouts 1 the floors are 1: recovery at
    version 3 counts 3 accepted, and one slot of concurrency is one."""
    m = sm(1, 1, 0, v=3)
    m.on_version_recovered(3)
    assert m.get_stats().accepted == 3
    assert m.get_capacity() == 1  # min(1 - 0, (0 + 3 + 1) * 1 - 3)
    start(m)
    assert m.get_capacity() == 0
    roomy = sm(1, 1, 5)  # budget 6: concurrency 1 is the bound
    assert roomy.get_capacity() == 1
