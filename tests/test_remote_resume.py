"""Issue 27, item 3: pause and resume cannot wedge the executor, and a broken read is not a dead server.

Real HTTP servers on loopback (``FakeServer``), the real ``RemoteEngine`` and executor.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest, Trajectory
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.executor import open_executor

from .conftest_remote import FakeServer, Raw, Reply, default_reply, sglang_body

G = GenerationConfig(max_new_tokens=2)


def engine(*servers: FakeServer) -> RemoteEngine:
    return RemoteEngine(
        [s.address for s in servers], "sglang", setup_timeout=5, seed=0, health_interval=3600,
        retry=RetryPolicy(attempts=3, backoff_base=0.01, backoff_max=0.05),
    )  # fmt: skip


async def start(nursery: trio.Nursery, script: Any) -> FakeServer:
    server = FakeServer(script)
    await nursery.start(server.run)
    return server


async def good(method: str, path: str, body: Any) -> Reply:
    if path == "/generate":
        return 200, sglang_body([7, 8])
    return await default_reply(method, path, body)


async def refuses_resume(method: str, path: str, body: Any) -> Reply:
    if path == "/continue_generation":
        return 400, {"error": {"message": "not now"}}
    return await good(method, path, body)


async def workflow(engine: Any, data: Any) -> Trajectory:
    return Trajectory.from_response(await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G)), 1.0)


async def test_a_server_refusing_resume_is_taken_out_and_the_executor_resumes(caplog: pytest.LogCaptureFixture) -> None:
    """The executor stayed paused for good when one server refused resume (FleetError)."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start(nursery, good)
            b = await start(nursery, refuses_resume)
            async with engine(a, b) as eng, open_executor(eng, max_head_offpolicyness=100) as ex:
                await ex.pause()
                await ex.resume()
                assert not ex.paused and not eng.paused
                up = {s.base_url: s.up for s in eng.servers}
                assert up == {f"http://{a.address}": True, f"http://{b.address}": False}, up
                assert f"http://{b.address}: resume failed, taken out of service" in caplog.text
                results = await ex.rollout_batch(range(4), workflow)
                assert len(results) == 4  # the fleet goes on without it
            nursery.cancel_scope.cancel()
    assert len(b.paths("/generate")) == 0


async def test_a_read_that_breaks_mid_answer_does_not_mark_a_healthy_server_down() -> None:
    """One cut-short answer took a healthy server out of service until the next health round."""
    cut = [Raw(b'HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n{"meta_')]

    async def flaky(method: str, path: str, body: Any) -> Reply:
        if path == "/generate" and cut:
            return cut.pop()
        return await good(method, path, body)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start(nursery, flaky)
            async with engine(a) as eng:
                resp = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
                assert resp.output_tokens == (7, 8)
                assert [s.up for s in eng.servers] == [True]
            nursery.cancel_scope.cancel()
    assert len(a.paths("/generate")) == 2 and len(a.paths("/health")) >= 2  # probed before judging it


async def test_a_server_that_stops_answering_mid_read_and_fails_its_health_check_is_marked_down() -> None:
    calls = {"n": 0}

    async def dying(method: str, path: str, body: Any) -> Reply:
        if path == "/generate" or (path == "/health" and calls["n"]):
            calls["n"] += 1
            return Raw(b"")
        return await good(method, path, body)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start(nursery, dying)
            b = await start(nursery, good)
            async with engine(a, b) as eng:
                for _ in range(4):
                    resp = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
                    assert resp.output_tokens == (7, 8)
                assert {s.base_url: s.up for s in eng.servers}[f"http://{a.address}"] is False
            nursery.cancel_scope.cancel()


async def test_the_stall_warning_names_the_servers_out_of_service(caplog: pytest.LogCaptureFixture) -> None:
    stalled = trio.Event()
    said: list[str] = []

    class Watcher:
        def call_stalled(self, call: str, waiting_on: str, waited: float) -> None:
            said.append(waiting_on)
            stalled.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start(nursery, good)
            b = await start(nursery, refuses_resume)
            async with engine(a, b) as eng, open_executor(eng, stall_warning_s=0.05, observers=[Watcher()]) as ex:
                await ex.pause()
                await ex.resume()  # b is out of service now
                await ex.pause()
                async with trio.open_nursery() as calls:
                    calls.start_soon(partial(ex.rollout_batch, range(2), workflow, is_eval=True))
                    await stalled.wait()
                    calls.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    assert "paused" in said[0] and "1 of 2 servers out of service" in said[0], said


async def test_a_stall_warning_on_an_unpaused_fleet_counts_its_down_servers() -> None:
    stalled = trio.Event()
    said: list[str] = []

    class Watcher:
        def call_stalled(self, call: str, waiting_on: str, waited: float) -> None:
            said.append(waiting_on)
            stalled.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start(nursery, good)
            b = await start(nursery, refuses_resume)
            async with engine(a, b) as eng, open_executor(eng, stall_warning_s=0.05, observers=[Watcher()]) as ex:
                await ex.pause()
                await ex.resume()  # b is out of service now
                async with trio.open_nursery() as calls:
                    calls.start_soon(ex.wait, 1)  # nothing submitted: it waits on a submit
                    await stalled.wait()
                    calls.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    assert "1 of 2 servers out of service" in said[0], said
