"""Router mode's membership work grows linearly with the fleet: a refresh that sees many
workers leave, and a health round that brings many joined workers in, never scan the
worker list once per worker (an O(N^2) at 10,000 servers). Stated without timing: every
linear scan of a list for a ``Server`` calls ``Server.__eq__`` on the entries it passes,
so the number of those calls is the work such scans do; lookups by URL call none."""

from __future__ import annotations

import pytest
import trio

from rollout_trio.engines._routing import Server

from .test_remote_fleet import Fleet, routed

N = 200


@pytest.fixture
def comparisons(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``Server == other`` calls (identity semantics kept, hashing unchanged)."""
    count = [0]

    def eq(self: Server, other: object) -> bool:
        count[0] += 1
        return self is other

    monkeypatch.setattr(Server, "__eq__", eq)
    monkeypatch.setattr(Server, "__hash__", object.__hash__)
    return count


async def test_a_refresh_in_which_half_the_workers_leave_does_linear_work(
    autojump_clock: trio.abc.Clock, comparisons: list[int]
) -> None:
    fleet = Fleet(N)
    async with routed(fleet, health_interval=3600) as eng:
        leaving = list(fleet.listed)[N // 2 :]  # the second half: behind the ones that stay
        for host in leaving:
            del fleet.listed[host]
        comparisons[0] = 0
        await eng._members.refresh_workers()
        assert len(eng.servers) == N // 2
        assert comparisons[0] <= N, f"{comparisons[0]} Server comparisons for one refresh of {N} workers"


async def test_a_health_round_bringing_in_many_joined_workers_does_linear_work(
    autojump_clock: trio.abc.Clock, comparisons: list[int]
) -> None:
    fleet = Fleet(N)
    async with routed(fleet, health_interval=3600) as eng:
        for i in range(N):  # as many workers again join the router
            worker = fleet.add(f"10.0.1.{i}:30000")
            fleet.listed[worker.host] = None
        comparisons[0] = 0
        await eng.check_fleet()
        assert len(eng.servers) == 2 * N and all(s.up for s in eng.servers)
        assert comparisons[0] <= 2 * N, f"{comparisons[0]} Server comparisons bringing in {N} of {2 * N} workers"
