"""Routing: strategies, rid affinity, down marks, health probes, and fan-out of control calls."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import trio
import trio.testing

from rollout_trio import FleetError, GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.engines._routing import Router, Server, normalize_address

from .conftest_remote import FakeServer, Reply, default_reply, sglang_body


def servers(n: int) -> list[Server]:
    return [Server(f"http://s{i}", None) for i in range(n)]


def test_round_robin_cycles_from_a_random_start() -> None:
    ss = servers(3)
    r = Router(ss, rng=random.Random(1), affinity_size=0)
    picks = [r.choose(f"r{i}") for i in range(6)]
    assert picks[:3] == picks[3:] and set(picks) == set(ss)


def test_least_in_flight_prefers_idle_servers() -> None:
    ss = servers(3)
    r = Router(ss, strategy="least_in_flight", affinity_size=0, rng=random.Random(0))
    ss[0].in_flight, ss[1].in_flight, ss[2].in_flight = 3, 1, 2
    assert r.choose("a") is ss[1]
    with r.track(ss[1]), r.track(ss[1]):
        assert ss[1].in_flight == 3
        assert r.choose("b") is ss[2]
    assert ss[1].in_flight == 1


def test_affinity_is_sticky_bounded_and_skips_down_servers() -> None:
    ss = servers(3)
    r = Router(ss, affinity_size=2, rng=random.Random(0))
    first = r.choose("x")
    assert all(r.choose("x") is first for _ in range(5))
    r.choose("y")
    r.choose("z")  # evicts "x" (FIFO of 2)
    assert r.affine("x") is None and r.affine("z") is not None
    r.mark_down(r.affine("z"))  # type: ignore[arg-type]
    moved = r.choose("z")
    assert moved.up and r.affine("z") is moved


def test_down_servers_are_skipped_until_all_are_down() -> None:
    ss = servers(3)
    r = Router(ss, affinity_size=0, rng=random.Random(0))
    r.mark_down(ss[0])
    r.mark_down(ss[1])
    assert {r.choose(str(i)) for i in range(4)} == {ss[2]}
    r.mark_down(ss[2])
    assert {r.choose(str(i)) for i in range(6)} == set(ss)  # nothing up: try them all
    assert r.choose("e", exclude={ss[0], ss[1]}) is ss[2]
    r.mark_up(ss[0])
    assert ss[0].up and ss[0].failures == 0


def test_router_and_engine_validate_arguments() -> None:
    with pytest.raises(ValueError, match="strategy"):
        Router(servers(1), strategy="random")
    with pytest.raises(ValueError, match="at least one"):
        Router([])
    with pytest.raises(ValueError, match="backend"):
        RemoteEngine("a:1", "tgi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_timeout"):
        RemoteEngine("a:1", request_timeout=0)
    assert normalize_address("h:1/") == "http://h:1" and normalize_address("https://h") == "https://h"
    eng = RemoteEngine("a:1, b:2")
    assert [s.base_url for s in eng.servers] == ["http://a:1", "http://b:2"]


def counting_script(name: str, hits: dict[str, int]) -> Any:
    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/generate":
            hits[name] = hits.get(name, 0) + 1
            return 200, sglang_body([1, 2])
        return await default_reply(method, path, body)

    return script


async def run_server(
    server: FakeServer, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            task_status.started(scope)


async def test_failed_server_is_marked_down_traffic_moves_and_it_comes_back() -> None:
    hits: dict[str, int] = {}
    a, b = FakeServer(counting_script("a", hits)), FakeServer(counting_script("b", hits))
    g = GenerationConfig(max_new_tokens=2)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            scope_a = await nursery.start(run_server, a)
            await nursery.start(run_server, b)
            retry = RetryPolicy(attempts=3, backoff_base=0.01, backoff_max=0.02)
            async with RemoteEngine(
                [a.address, b.address], health_interval=0.1, retry=retry, seed=0, setup_timeout=5
            ) as eng:
                for i in range(4):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=g, rid=f"r{i}"))
                assert hits == {"a": 2, "b": 2}
                scope_a.cancel()  # server a goes away
                await trio.testing.wait_all_tasks_blocked()  # its tasks have run their cancellation
                for i in range(4, 10):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=g, rid=f"r{i}"))
                assert hits["b"] == 8 and hits["a"] == 2
                assert not eng.servers[0].up
                await nursery.start(run_server, a)  # back on the same port
                with trio.fail_after(3):
                    while not eng.servers[0].up:
                        await trio.sleep(0.05)
                for i in range(10, 14):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=g, rid=f"r{i}"))
                assert hits["a"] == 4
            nursery.cancel_scope.cancel()


async def test_rid_affinity_keeps_a_conversation_on_one_server() -> None:
    hits: dict[str, int] = {}
    a, b = FakeServer(counting_script("a", hits)), FakeServer(counting_script("b", hits))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            async with RemoteEngine([a.address, b.address], seed=0, setup_timeout=5) as eng:
                for _ in range(5):
                    await eng.agenerate(
                        ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=2), rid="conv")
                    )
            nursery.cancel_scope.cancel()
    assert sorted(hits.values()) == [5]


async def test_least_in_flight_spreads_concurrent_requests() -> None:
    hits: dict[str, int] = {}
    all_arrived = trio.Event()  # every answer waits until all 8 requests are in flight

    def slow(name: str) -> Any:
        async def script(method: str, path: str, body: Any) -> Reply:
            if path == "/generate":
                hits[name] = hits.get(name, 0) + 1
                if sum(hits.values()) == 8:
                    all_arrived.set()
                await all_arrived.wait()
                return 200, sglang_body([1])
            return await default_reply(method, path, body)

        return script

    a, b = FakeServer(slow("a")), FakeServer(slow("b"))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            eng = RemoteEngine([a.address, b.address], routing="least_in_flight", seed=0, setup_timeout=5)
            async with eng, trio.open_nursery() as inner:
                for i in range(8):
                    req = ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=1), rid=f"q{i}")
                    inner.start_soon(eng.agenerate, req)
            nursery.cancel_scope.cancel()
    assert hits == {"a": 4, "b": 4}


async def test_control_calls_reach_every_server_and_a_refusal_is_a_typed_error_naming_it() -> None:
    async def broken(method: str, path: str, body: Any) -> Reply:
        if path == "/pause_generation":
            return 400, {"error": {"message": "cannot pause"}}
        return await default_reply(method, path, body)

    a, b = FakeServer(default_reply), FakeServer(broken)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            async with RemoteEngine([a.address, b.address], seed=0, setup_timeout=5) as eng:
                await eng.resume()
                with pytest.raises(FleetError, match=r"pause: refused by http://.*HTTP 400: cannot pause") as info:
                    await eng.pause()
                assert list(info.value.errors) == [f"http://{b.address}"]
                assert eng.paused and all(s.up for s in eng.servers)  # a refusal is not an outage
            nursery.cancel_scope.cancel()
    assert a.paths("/continue_generation") == b.paths("/continue_generation") == [{}]
    assert a.paths("/pause_generation") == [{"mode": "abort"}]


async def test_servers_without_a_majority_version_are_an_error_naming_them() -> None:
    """Servers disagreeing at start: the version a strict majority holds is the fleet's
    and the others are taken out (one server cannot block or move the fleet); with no
    majority, an error naming them all (issue 34 item 3)."""
    from rollout_trio import VersionMismatchError

    def reporting(label: str) -> Any:
        async def script(method: str, path: str, body: Any) -> Reply:
            if path == "/get_model_info":
                return 200, {"weight_version": label}
            return await default_reply(method, path, body)

        return script

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            servers = [FakeServer(reporting(label)) for label in ("4", "5", "4")]
            for s in servers:
                await nursery.start(s.run)
            with pytest.raises(VersionMismatchError, match="no version is held by a majority") as info:
                async with RemoteEngine([s.address for s in servers[:2]], setup_timeout=5, seed=0):
                    pass
            for s, label in zip(servers[:2], ("4", "5"), strict=True):
                assert f"http://{s.address} at {label}" in str(info.value)
            async with RemoteEngine([s.address for s in servers], setup_timeout=5, seed=0) as eng:
                assert eng.get_version() == 4  # what the majority holds
                assert [s.up for s in eng.servers] == [True, False, True]
                assert "holds weight version 5" in str(eng.servers[1].error)
            assert all(not s.paths("/update_weight_version") for s in servers)
            nursery.cancel_scope.cancel()


@settings(max_examples=300, deadline=None)
@given(
    ups=st.lists(st.booleans(), min_size=1, max_size=12),
    excluded=st.sets(st.integers(0, 11)),
    strategy=st.sampled_from(["round_robin", "least_in_flight"]),
    loads=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    start=st.integers(0, 100),
)
def test_router_picks_the_best_class_of_server_and_rotates_within_it(
    ups: list[bool], excluded: set[int], strategy: str, loads: list[int], start: int
) -> None:
    """Invariant: a pick comes from the first non-empty class of (up and not excluded),
    (not excluded), (any); under least_in_flight it has the class's lowest load; and
    round robin visits every server of the class within one cycle of picks."""
    ss = servers(len(ups))
    for s, up, load in zip(ss, ups, loads):
        s.up, s.in_flight = up, load
    r = Router(ss, strategy=strategy, affinity_size=0, rng=random.Random(start))
    exclude = {ss[i] for i in excluded if i < len(ss)}
    cls = [s for s in ss if s.up and s not in exclude] or [s for s in ss if s not in exclude] or ss
    if strategy == "least_in_flight":
        low = min(s.in_flight for s in cls)
        cls = [s for s in cls if s.in_flight == low]
    picks = [r.choose(f"r{i}", exclude) for i in range(len(cls))]
    assert set(picks) == set(cls)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 6),
    steps=st.lists(st.tuples(st.sets(st.integers(0, 5)), st.sets(st.integers(0, 5))), min_size=1, max_size=12),
    start=st.integers(0, 100),
)
def test_round_robin_takes_the_first_usable_server_from_its_cursor(
    n: int, steps: list[tuple[set[int], set[int]]], start: int
) -> None:
    """Invariant: with up/down marks and exclusions changing between picks, round robin
    picks exactly what a walk from its cursor picks: the first server that is up and not
    excluded, else the first not excluded, else the next one; the cursor moves past it."""
    ss = servers(n)
    r = Router(ss, affinity_size=0, rng=random.Random(start))
    cursor = random.Random(start).randrange(n)
    for down, excluded in steps:
        for i, s in enumerate(ss):
            s.up = i not in down
        exclude = {ss[i] for i in excluded if i < n}
        for rule in (lambda s: s.up and s not in exclude, lambda s: s not in exclude, lambda s: True):
            order = [(cursor + k) % n for k in range(n)]
            hit = next((i for i in order if rule(ss[i])), None)
            if hit is not None:
                break
        assert hit is not None
        assert r.choose("rid", exclude) is ss[hit]
        cursor = (hit + 1) % n
