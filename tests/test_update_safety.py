"""update_weights on LocalEngine and RemoteEngine: serialized and cancellation-safe."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from rollout_trio import EngineServerError, FleetError, GenerationConfig, ModelRequest, ServerUnavailableError
from rollout_trio.engines import LocalEngine, RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.models import tiny_model


async def test_local_update_cancelled_while_waiting_for_the_step_boundary_resumes() -> None:
    """It used to await pause() outside its try/finally: cancelled there, the engine stayed
    paused forever and every later agenerate hung."""
    model, tok = tiny_model()
    weights = tiny_model(seed=1)[0].state_dict()
    g = GenerationConfig(max_new_tokens=200, ignore_eos=True)
    with trio.fail_after(60):
        async with LocalEngine(model, tok) as engine:
            done: list[Any] = []

            async def long() -> None:
                done.append(await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long)
                while engine.statistics().generated_tokens < 2:  # the worker is stepping
                    await trio.sleep(0.001)
                with trio.CancelScope() as scope:
                    nursery.start_soon(_cancel_when_pause_requested, engine, scope)
                    await engine.update_weights(weights, 1)
                assert scope.cancelled_caught
                assert engine.statistics().paused is False
            assert done[0].output_len == 200  # the generation went on
            assert engine.get_version() == 0  # cancelled before loading
            short = await engine.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=2, ignore_eos=True)))
            assert short.output_len == 2


async def _cancel_when_pause_requested(engine: LocalEngine, scope: trio.CancelScope) -> None:
    while not engine.statistics().paused:  # update_weights asked for the step boundary
        await trio.lowlevel.checkpoint()
    scope.cancel()


class FakeServers:
    """SGLang-shaped MockTransport handler: per-server pause state and the order of calls."""

    def __init__(self, *, stall: str | None = None, fail: str | None = None, delay: int = 1) -> None:
        self.paused: dict[str, bool] = {}
        self.calls: list[tuple[str, str]] = []
        self.stall = stall
        self.fail = fail
        self.delay = delay

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.netloc.decode(), request.url.path
        for _ in range(self.delay):  # as a network would: the caller may be cancelled here
            await trio.lowlevel.checkpoint()
        self.calls.append((host, path))
        if path == self.stall:
            await trio.sleep_forever()
        if path == self.fail:
            return httpx.Response(500, json={"error": {"message": "broken"}})
        if path == "/pause_generation":
            self.paused[host] = True
        elif path == "/continue_generation":
            self.paused[host] = False
        elif path == "/get_model_info":
            return httpx.Response(200, json={"weight_version": "default"})
        return httpx.Response(200, json={"success": True})


def remote(fake: FakeServers, n: int = 2, **kw: Any) -> RemoteEngine:
    kw.setdefault("retry", RetryPolicy(attempts=1))
    addresses = [f"10.0.0.{i}:30000" for i in range(1, n + 1)]
    return RemoteEngine(addresses, transport=httpx.MockTransport(fake), seed=0, control_timeout=5, **kw)


async def test_remote_update_cancelled_mid_fan_out_resumes_every_server(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeServers(stall="/update_weights_from_disk")
    async with remote(fake) as eng:
        with trio.move_on_after(1) as scope:
            await eng.update_weights("/ckpt/1", 1)
        assert scope.cancelled_caught
        assert not eng.paused and eng.get_version() == 0
        assert fake.paused == {"10.0.0.1:30000": False, "10.0.0.2:30000": False}


async def test_remote_updates_are_serialized(autojump_clock: trio.abc.Clock) -> None:
    fake = FakeServers(delay=3)
    async with remote(fake, n=1) as eng:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(eng.update_weights, "/ckpt/1", 1)
            nursery.start_soon(eng.update_weights, "/ckpt/2", 2)
        control = [p for _, p in fake.calls if p not in ("/health", "/get_model_info")]
        one = ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
        assert control == one + one  # never pause, pause, update, update, ...
        assert not eng.paused and eng.get_version() in (1, 2)


async def test_remote_update_takes_a_server_it_could_not_resume_out_and_resumes_it_on_return(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that cannot be resumed used to fail the update (and wedge nothing else);
    now the update goes through, the server is out of service with a logged
    ServerUnavailableError naming it, and it is resumed before it serves again."""
    fake = FakeServers(fail="/continue_generation")
    async with remote(fake, n=2) as eng:
        await eng.update_weights("/ckpt/1", 1)
        assert eng.get_version() == 1 and not eng.paused  # the update itself went through
        assert [s.up for s in eng.servers] == [False, False]
        assert all(isinstance(s.error, ServerUnavailableError) for s in eng.servers)
        assert "http://10.0.0.1:30000: resume failed, taken out of service" in caplog.text
        fake.fail = None  # the servers answer again
        await eng.check_fleet()
        assert [s.up for s in eng.servers] == [True, True]
        assert fake.paused == {"10.0.0.1:30000": False, "10.0.0.2:30000": False}


async def test_stock_vllm_reload_404_names_the_setting(autojump_clock: trio.abc.Clock) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/inference/v1/generate":
            return httpx.Response(200, json={"choices": []})
        if path in ("/health", "/pause", "/resume", "/update_weight_version"):
            return httpx.Response(200, json={})
        return httpx.Response(404, json={"detail": "Not Found"})

    retry = RetryPolicy(attempts=1)
    async with RemoteEngine("10.0.0.1:8000", "vllm", transport=httpx.MockTransport(handler), retry=retry) as eng:
        with pytest.raises(FleetError, match=r"no server took version 1.*vllm_reload_path=None") as info:
            await eng.update_weights("/ckpt/1", 1)
        assert isinstance(info.value.errors["http://10.0.0.1:8000"], EngineServerError)
        assert not eng.paused and eng.get_version() == 0 and eng.servers[0].up
