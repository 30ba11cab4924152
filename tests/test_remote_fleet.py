"""RemoteEngine as a fleet: dead servers never block the others, returning and joining
servers are brought to the fleet's version first, and router mode sends the control plane
to the workers. In memory (httpx.MockTransport, autojump clock): SGLang-shaped workers
with per-server state, and a router that lists them and forwards /generate."""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

import httpx
import pytest
import trio

from rollout_trio import FleetError, GenerationConfig, ModelRequest, ServerUnavailableError, workflow_context
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy

ROUTER = "10.0.0.100:30000"
G = GenerationConfig(max_new_tokens=2)


class Worker:
    def __init__(self, host: str) -> None:
        self.host = host
        self.alive = True
        self.paused = False
        self.label = "default"
        self.calls: list[tuple[str, Any]] = []

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls if p not in ("/health", "/get_model_info")]

    def answer(self, path: str, body: Any) -> httpx.Response:
        self.calls.append((path, body))
        if path == "/get_model_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/pause_generation":
            self.paused = True
        elif path == "/continue_generation":
            self.paused = False
        elif path == "/update_weights_from_disk":
            self.label = body["weight_version"]
        elif path == "/generate":
            tokens = [] if self.paused else [7] * body["sampling_params"]["max_new_tokens"]
            finish = {"type": "abort", "message": "paused"} if self.paused else {"type": "length"}
            meta = {"finish_reason": finish, "weight_version": self.label,
                    "output_token_logprobs": [[-0.1, t, None] for t in tokens]}  # fmt: skip
            return httpx.Response(200, json={"output_ids": tokens, "meta_info": meta})
        return httpx.Response(200, json={"success": True})


class Fleet:
    """Workers at 10.0.0.{1..n}:30000 and, in front, a router that lists them."""

    def __init__(self, n: int) -> None:
        self.workers = {f"10.0.0.{i}:30000": Worker(f"10.0.0.{i}:30000") for i in range(1, n + 1)}
        self.listed = dict.fromkeys(self.workers)  # the router's worker list (ordered)
        self.router_calls: list[tuple[str, str, Any]] = []
        self._rr = itertools.count()

    def add(self, host: str) -> Worker:
        self.workers[host] = Worker(host)
        return self.workers[host]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        await trio.lowlevel.checkpoint()  # as a network would
        host, path = request.url.netloc.decode(), request.url.path
        body = json.loads(request.content) if request.content else None
        if host == ROUTER:
            return self.route(request.method, path, body)
        worker = self.workers[host]
        if not worker.alive:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return worker.answer(path, body)

    def route(self, method: str, path: str, body: Any) -> httpx.Response:
        self.router_calls.append((method, path, body))
        if path == "/health":
            return httpx.Response(200)
        if path == "/workers" and method == "GET":
            listing = [{"id": f"id-{h}", "url": f"http://{h}", "is_healthy": True} for h in self.listed]
            return httpx.Response(200, json={"workers": listing, "total": len(listing)})
        if path == "/workers" and method == "POST":
            self.listed[body["url"].removeprefix("http://")] = None
            return httpx.Response(202, json={"status": "accepted"})
        if path.startswith("/workers/") and method == "DELETE":
            self.listed.pop(path.removeprefix("/workers/id-"), None)
            return httpx.Response(202, json={"status": "accepted"})
        if path == "/generate":
            live = [self.workers[h] for h in self.listed if self.workers[h].alive]
            return live[next(self._rr) % len(live)].answer(path, body)
        return httpx.Response(404)  # the router forwards no control call


def direct(fleet: Fleet, **kw: Any) -> RemoteEngine:
    kw.setdefault("retry", RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.02))
    return RemoteEngine(list(fleet.workers), transport=httpx.MockTransport(fleet), seed=0, control_timeout=5, **kw)


def routed(fleet: Fleet, **kw: Any) -> RemoteEngine:
    kw.setdefault("retry", RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.02))
    return RemoteEngine(router=ROUTER, transport=httpx.MockTransport(fleet), seed=0, control_timeout=5, **kw)


async def test_pause_and_resume_skip_a_down_server_and_generation_goes_on(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """They used to fail on every call with a bare ExceptionGroup, leaving the engine paused
    and all generation blocked, even on the healthy server."""
    fleet = Fleet(2)
    a, b = fleet.workers.values()
    async with direct(fleet, health_interval=3600) as eng:
        b.alive = False
        await eng.pause()
        assert eng.paused and a.paused
        await eng.resume()
        assert not eng.paused and not a.paused
        assert [s.up for s in eng.servers] == [True, False]
        error = eng.servers[1].error
        assert isinstance(error, ServerUnavailableError) and error.server == "http://10.0.0.2:30000"
        assert "http://10.0.0.2:30000: pause failed, taken out of service" in caplog.text
        for i in range(3):
            resp = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}"))
            assert resp.output_tokens == (7, 7)
        await eng.pause()  # the down server is not tried again (a dying one would cost a timeout each time)
        await eng.resume()
    assert [p for p, _ in b.calls].count("/pause_generation") == 0


async def test_a_server_back_from_the_dead_reloads_the_checkpoint_before_it_serves(
    autojump_clock: trio.abc.Clock,
) -> None:
    fleet = Fleet(2)
    a, b = fleet.workers.values()
    async with direct(fleet, health_interval=3600) as eng:
        b.alive = False
        await eng.update_weights("/ckpt/1", 1)  # b is skipped, not an error
        assert eng.get_version() == 1 and a.label == "1" and not eng.servers[1].up
        b.alive, b.label, b.paused = True, "default", True  # restarted with its initial weights
        b.calls.clear()
        await eng.check_fleet()
        assert eng.servers[1].up and eng.servers[1].version == 1 and eng.servers[1].error is None
        assert b.paths() == ["/update_weights_from_disk", "/continue_generation"]
        (reload,) = [body for path, body in b.calls if path == "/update_weights_from_disk"]
        assert reload["model_path"] == "/ckpt/1" and b.label == "1" and not b.paused
        for i in range(4):
            resp = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}"))
            assert resp.output_versions == (1, 1)
        assert b.paths().count("/generate") == 2


async def test_a_server_returning_while_paused_is_paused_before_it_serves(autojump_clock: trio.abc.Clock) -> None:
    fleet = Fleet(2)
    a, b = fleet.workers.values()
    async with direct(fleet, health_interval=3600) as eng:
        b.alive = False
        await eng.pause()
        b.alive = True
        await eng.check_fleet()
        assert eng.servers[1].up and b.paused
        await eng.resume()
        assert not b.paused


async def test_an_update_no_server_took_is_a_fleet_error_and_changes_nothing(autojump_clock: trio.abc.Clock) -> None:
    fleet = Fleet(2)
    async with direct(fleet, health_interval=3600) as eng:
        for w in fleet.workers.values():
            w.alive = False
        with pytest.raises(FleetError, match="no server took version 1 from /ckpt/1") as info:
            await eng.update_weights("/ckpt/1", 1)
        assert sorted(info.value.errors) == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
        assert eng.get_version() == 0 and not eng.paused


async def test_an_episode_whose_server_died_mid_request_finishes_elsewhere(autojump_clock: trio.abc.Clock) -> None:
    fleet = Fleet(2)
    a, b = fleet.workers.values()
    async with direct(fleet, health_interval=3600) as eng:
        b.alive = False
        outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(4)]
    assert all(o.output_tokens == (7, 7) for o in outs)
    assert a.paths().count("/generate") == 4


# --------------------------------------------------------------------- router mode


async def test_router_mode_generates_through_the_router_and_controls_every_worker(
    autojump_clock: trio.abc.Clock,
) -> None:
    fleet = Fleet(2)
    async with routed(fleet, health_interval=3600) as eng:
        assert eng.router_address == f"http://{ROUTER}"
        assert [s.base_url for s in eng.servers] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
        for i in range(2):
            await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}"))
        await eng.update_weights("/ckpt/3", 3)
        resp = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
        assert resp.output_versions == (3, 3)
    for w in fleet.workers.values():
        control = [p for p in w.paths() if p != "/generate"]
        assert control == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert w.label == "3"
    assert {p for _, p, _ in fleet.router_calls} == {"/health", "/workers", "/generate"}


async def test_router_mode_aborts_a_cancelled_request_on_the_workers(autojump_clock: trio.abc.Clock) -> None:
    fleet = Fleet(2)
    started = trio.Event()

    async def hang(request: httpx.Request) -> httpx.Response:
        if request.url.netloc.decode() == ROUTER and request.url.path == "/generate":
            started.set()
            await trio.sleep_forever()
        return await fleet(request)

    eng = RemoteEngine(router=ROUTER, transport=httpx.MockTransport(hang), seed=0, health_interval=3600)
    async with eng, trio.open_nursery() as nursery:
        nursery.start_soon(eng.agenerate, ModelRequest(input_ids=[1], gconfig=G, rid="gone"))
        await started.wait()
        nursery.cancel_scope.cancel()
    for w in fleet.workers.values():
        (abort,) = [b for p, b in w.calls if p == "/abort_request"]
        assert abort["rid"].startswith("gone-")


async def test_a_worker_joining_the_router_is_reloaded_out_of_the_router_first(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rollout_trio.remote")
    fleet = Fleet(1)
    async with routed(fleet, health_interval=3600) as eng:
        await eng.update_weights("/ckpt/1", 1)
        c = fleet.add("10.0.0.3:30000")  # an operator starts a worker and adds it to the router
        fleet.listed[c.host] = None
        await eng.check_fleet()
        assert [s.base_url for s in eng.servers][-1] == "http://10.0.0.3:30000"
        assert eng.servers[-1].up and c.label == "1"
        assert c.paths() == ["/update_weights_from_disk", "/continue_generation"]
        assert ("DELETE", "/workers/id-10.0.0.3:30000", None) in fleet.router_calls
        assert ("POST", "/workers", {"url": "http://10.0.0.3:30000"}) in fleet.router_calls
        assert c.host in fleet.listed  # back in the router
        assert "worker http://10.0.0.3:30000 joined router" in caplog.text
        del fleet.listed[c.host]  # the operator removes it
        await eng.check_fleet()
        assert [s.base_url for s in eng.servers] == ["http://10.0.0.1:30000"]


def test_router_and_addresses_are_exclusive() -> None:
    with pytest.raises(ValueError, match="either server addresses or router="):
        RemoteEngine("a:1", router="r:1")
    with pytest.raises(ValueError, match="at least one server address"):
        RemoteEngine()


# --------------------------------------------------------------------- seeds


async def test_seeds_reach_the_server_derived_per_segment(autojump_clock: trio.abc.Clock) -> None:
    """use_seed / gconfig.seed used to reach no server; a resumed segment must not resend
    the first segment's seed."""
    fleet = Fleet(1)
    (w,) = fleet.workers.values()
    replies = iter([[4, 5], [], [6]])

    async def split(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            body = json.loads(request.content)
            w.calls.append(("/generate", body))
            tokens = next(replies)
            finish = {"type": "abort" if len(tokens) < 2 and not tokens or tokens == [4, 5] else "length"}
            meta = {"finish_reason": finish, "weight_version": "default",
                    "output_token_logprobs": [[-0.1, t, None] for t in tokens]}  # fmt: skip
            return httpx.Response(200, json={"output_ids": tokens, "meta_info": meta})
        return await fleet(request)

    eng = RemoteEngine(list(fleet.workers), transport=httpx.MockTransport(split), seed=0, max_empty_aborts=5)
    async with eng:
        resp = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=3, seed=11)))
        assert resp.output_tokens == (4, 5, 6)
        seeds = [b["sampling_params"]["sampling_seed"] for p, b in w.calls if p == "/generate"]
        assert seeds[0] == 11 and seeds[1] == seeds[2] != 11  # resumed after 2 tokens: derived, twice alike
        w.calls.clear()
        replies = iter([[1, 2, 3]] * 4)
        runs = []
        for _ in range(2):
            with workflow_context.use_seed(5), workflow_context.use(workflow_context.WorkflowContext(task_id=3)):
                await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=3)))
                await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=3)))
            runs.append([b["sampling_params"]["sampling_seed"] for p, b in w.calls if p == "/generate"])
            w.calls.clear()
        assert runs[0] == runs[1] and runs[0][0] != runs[0][1]  # per request, reproducible
