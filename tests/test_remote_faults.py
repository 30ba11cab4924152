"""RemoteEngine against purpose-built misbehaving servers on loopback."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from rollout_trio import (
    EngineConnectError,
    EngineProtocolError,
    EngineServerError,
    EngineTimeoutError,
    GenerationConfig,
    ModelRequest,
    UnsupportedRequestError,
)
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy

from .conftest_remote import FakeServer, Raw, Reply, default_reply, sglang_body

G = GenerationConfig(max_new_tokens=4)


def engine(*servers: FakeServer, **kw: Any) -> RemoteEngine:
    kw.setdefault("setup_timeout", 5)
    kw.setdefault("seed", 0)
    kw.setdefault("retry", RetryPolicy(attempts=3, backoff_base=0.01, backoff_max=0.05))
    return RemoteEngine([s.address for s in servers], "sglang", **kw)


class MockServer:
    """A scripted server in memory (httpx.MockTransport): no sockets, so the tests that
    reason about time run on autojump_clock and see the same interleaving every time."""

    address = "10.0.0.9:30000"

    def __init__(self, script: Any) -> None:
        self.script = script
        self.log: list[tuple[str, Any]] = []

    def paths(self, path: str) -> list[Any]:
        return [b for p, b in self.log if p == path]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.log.append((request.url.path, body))
        status, obj = await self.script(request.method, request.url.path, body)
        return httpx.Response(status, content=obj if isinstance(obj, bytes) else json.dumps(obj).encode())

    def engine(self, **kw: Any) -> RemoteEngine:
        kw.setdefault("transport", httpx.MockTransport(self))
        return engine(self, **kw)  # type: ignore[arg-type]


async def start(nursery: trio.Nursery, script: Any) -> FakeServer:
    server = FakeServer(script)
    await nursery.start(server.run)
    return server


def flaky(*replies: Reply) -> Any:
    """A /generate script answering ``replies`` in order, then a good answer."""
    queue = list(replies)

    async def script(method: str, path: str, body: Any) -> Reply:
        if path != "/generate":
            return await default_reply(method, path, body)
        if queue:
            return queue.pop(0)
        return 200, sglang_body([7, 8, 9, 10])

    return script


@pytest.mark.parametrize(
    "bad",
    [
        (500, {"error": {"message": "boom"}}),
        (503, b"<html>down</html>"),
        (429, {"error": {"message": "slow down"}}),
        Raw(b'HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n{"meta_'),  # cut short
        Raw(b""),  # closed without answering
    ],
)
async def test_retriable_failure_then_success(bad: Reply) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky(bad, bad))
            async with engine(server) as eng:
                resp = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=G))
            nursery.cancel_scope.cancel()
    assert resp.output_tokens == (7, 8, 9, 10) and resp.stop_reason == "length"
    gens = server.paths("/generate")
    assert len(gens) == 3
    assert len({g["rid"] for g in gens}) == 3  # a fresh server-side id per attempt


async def test_persistent_500_raises_server_error_after_attempts() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky(*[(500, {"error": {"message": "boom"}})] * 10))
            async with engine(server) as eng:
                with pytest.raises(EngineServerError, match="HTTP 500: boom") as info:
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
            nursery.cancel_scope.cancel()
    assert info.value.status_code == 500
    assert "gave up after 3 attempts" in info.value.__notes__
    assert len(server.paths("/generate")) == 3


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_other_4xx_not_retried(status: int) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky((status, {"error": {"message": "nope"}})))
            async with engine(server) as eng:
                with pytest.raises(EngineServerError) as info:
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
            nursery.cancel_scope.cancel()
    assert info.value.status_code == status
    assert len(server.paths("/generate")) == 1


@pytest.mark.parametrize(
    "bad, rule",
    [
        ((200, b"<html>oops</html>"), "not JSON"),
        ((200, [1, 2]), r"response\['meta_info'\]: missing"),
        ((200, {"meta_info": {"finish_reason": None}}), "finish_reason'\\]: must be dict"),
        ((200, {"meta_info": {"finish_reason": {"type": "length"}}}), "output_token_logprobs: missing"),
        (
            (200, {"meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1]]}}),
            r"output_token_logprobs\[0\]: must be \[logprob, token_id, text\]",
        ),
        (
            (200, {"meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[0.5, 3, None]]}}),
            "logprob <= 0",
        ),
        ((200, {"meta_info": {"finish_reason": {"type": "weird"}, "output_token_logprobs": []}}), "unknown value"),
        ((200, sglang_body([1, 2, 3, 4, 5, 6])), "6 tokens for a budget of 4"),
    ],
)
async def test_malformed_answers_raise_protocol_error(bad: Reply, rule: str) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky(bad))
            async with engine(server) as eng:
                with pytest.raises(EngineProtocolError, match=rule):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
            nursery.cancel_scope.cancel()
    assert len(server.paths("/generate")) == 1


async def test_slow_server_times_out_and_every_attempt_is_aborted(autojump_clock: trio.abc.Clock) -> None:
    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/generate":
            await trio.sleep(30)
        return await default_reply(method, path, body)

    server = MockServer(script)
    async with server.engine(request_timeout=0.2) as eng:
        t0 = trio.current_time()
        with pytest.raises(EngineTimeoutError):
            await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid="slow"))
        assert trio.current_time() - t0 < 3  # virtual seconds: 3 attempts of 0.2 s plus backoff
    sent = [g["rid"] for g in server.paths("/generate")]
    aborted = [a["rid"] for a in server.paths("/abort_request")]
    assert len(sent) == 3 and sorted(sent) == sorted(aborted)


async def test_an_abort_the_server_never_answers_is_given_up_after_abort_grace_and_logged(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled request's abort waits at most ``abort_grace`` for the server; giving up is
    logged (the server may still be generating it), and the cancellation goes on."""
    started = trio.Event()

    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/generate":
            started.set()
            await trio.sleep(1000)
        if path == "/abort_request":
            await trio.sleep_forever()
        return await default_reply(method, path, body)

    server = MockServer(script)
    async with server.engine(abort_grace=2) as eng:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(eng.agenerate, ModelRequest(input_ids=[1], gconfig=G, rid="stuck"))
            await started.wait()
            t0 = trio.current_time()
            nursery.cancel_scope.cancel()
        assert 2 <= trio.current_time() - t0 < 3  # the grace, then given up (virtual seconds)
    assert [a["rid"] for a in server.paths("/abort_request")] == [g["rid"] for g in server.paths("/generate")]
    (record,) = [r for r in caplog.records if "no answer within abort_grace" in r.getMessage()]
    assert "abort_grace=2" in record.getMessage() and server.address in record.getMessage()


async def test_caller_deadline_bounds_retries(autojump_clock: trio.abc.Clock) -> None:
    """No retry starts when the caller's deadline would pass before it could finish."""
    server = MockServer(flaky(*[(503, b"")] * 100))
    retry = RetryPolicy(attempts=50, backoff_base=0.2, backoff_max=0.2)
    async with server.engine(retry=retry, seed=1) as eng:
        t0 = trio.current_time()
        with trio.move_on_after(0.5):
            with pytest.raises(EngineServerError) as info:
                await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
        assert trio.current_time() - t0 < 0.5  # gave up before the deadline (virtual time)
    assert "deadline" in " ".join(info.value.__notes__)
    assert len(server.paths("/generate")) < 10


async def test_abort_then_resume_appends_partial_tokens_and_shrinks_budget() -> None:
    replies = [
        (200, sglang_body([11, 12], "abort", version="3", message="Abort in running queue due to engine pause")),
        (200, sglang_body([], "abort", message="Abort before prefill")),
        (200, sglang_body([13, 14, 15], "stop", version="3")),
    ]

    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/generate":
            return replies.pop(0)
        return await default_reply(method, path, body)

    g = GenerationConfig(max_new_tokens=10, min_new_tokens=4, temperature=0.7, top_k=5, seed=3, stop_token_ids=[15])
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, script)
            async with engine(server, version=3) as eng:
                resp = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g))
            nursery.cancel_scope.cancel()
    assert resp.output_tokens == (11, 12, 13, 14, 15) and resp.stop_reason == "stop"
    assert resp.output_versions == (3,) * 5
    first, _, third = server.paths("/generate")
    assert first["input_ids"] == [1, 2] and third["input_ids"] == [1, 2, 11, 12]
    sp = first["sampling_params"]
    assert sp["max_new_tokens"] == 10 and third["sampling_params"]["max_new_tokens"] == 8
    assert sp["min_new_tokens"] == 4 and third["sampling_params"]["min_new_tokens"] == 2
    assert (sp["temperature"], sp["top_k"], sp["sampling_seed"], sp["stop_token_ids"]) == (0.7, 5, 3, [15])
    for key in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos"):
        assert key in sp
    assert first["return_logprob"] is True and first["rid"] != third["rid"]
    assert server.paths("/update_weight_version") == []  # only update_weights relabels a server


async def test_leftover_abort_is_reported_as_length() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky((200, sglang_body([1, 2, 3, 4], "abort", message="x"))))
            async with engine(server) as eng:
                resp = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
            nursery.cancel_scope.cancel()
    assert resp.stop_reason == "length" and resp.output_len == 4


async def test_consecutive_empty_aborts_back_off_and_are_capped(autojump_clock: trio.abc.Clock) -> None:
    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/generate":
            return 200, sglang_body([], "abort", message="Abort before prefill due to engine pause")
        return await default_reply(method, path, body)

    server = MockServer(script)
    retry = RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.02)
    async with server.engine(max_empty_aborts=5, retry=retry) as eng:
        t0 = trio.current_time()
        with pytest.raises(EngineServerError, match="6 consecutive segments aborted with no output"):
            await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
        elapsed = trio.current_time() - t0
    assert len(server.paths("/generate")) == 6
    assert elapsed > 0.01  # it slept between them


async def test_unreachable_server_raises_connect_error() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            good = await start(nursery, flaky())
            async with engine(good) as eng:
                with trio.socket.socket() as s:  # a port nobody listens on
                    await s.bind(("127.0.0.1", 0))
                    dead = s.getsockname()[1]
                eng.servers[0].base_url = f"http://127.0.0.1:{dead}"
                with pytest.raises(EngineConnectError, match="ConnectError"):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
                assert not eng.servers[0].up
            nursery.cancel_scope.cancel()


async def test_setup_waits_for_health_within_setup_timeout() -> None:
    with trio.fail_after(10):
        with pytest.raises(EngineConnectError, match=r"setup_timeout=0.3 s from http://127.0.0.1:1 \(last error: .*ConnectError"):
            async with RemoteEngine("127.0.0.1:1", setup_timeout=0.3):
                pass  # pragma: no cover


async def test_request_settings_refused_up_front() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky())
            async with engine(server) as eng:
                with pytest.raises(UnsupportedRequestError, match="n_samples"):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(n_samples=2)))
                with pytest.raises(UnsupportedRequestError, match="leaves no room"):
                    await eng.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_tokens=3)))
                with pytest.raises(UnsupportedRequestError, match="beam"):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(use_beam_search=True)))
                with pytest.raises(UnsupportedRequestError, match="state dict"):
                    await eng.update_weights({"w": 1}, 2)
            nursery.cancel_scope.cancel()
    assert server.paths("/generate") == []


async def test_pause_holds_segments_until_resume(autojump_clock: trio.abc.Clock) -> None:
    server = MockServer(flaky())
    # verify_versions=False: the fake always says "default"
    async with trio.open_nursery() as nursery, server.engine(verify_versions=False) as eng:
        await eng.pause()
        assert server.paths("/pause_generation") == [{"mode": "abort"}]
        done = trio.Event()

        async def gen() -> None:
            await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
            done.set()

        nursery.start_soon(gen)
        await trio.sleep(60)  # virtual: everything that could run has run
        assert not done.is_set() and server.paths("/generate") == []
        eng.set_version(4)
        await eng.resume()
        await done.wait()
        assert server.paths("/continue_generation") == [{}]
        await eng.update_weights("/ckpt/v5", 5)
        assert eng.get_version() == 5 and not eng.paused
        upd = server.paths("/update_weights_from_disk")
        assert upd == [{"model_path": "/ckpt/v5", "abort_all_requests": True, "weight_version": "5"}]
    order = [p for p, _ in server.log if p != "/health"]
    assert order[-3:] == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]


async def test_cancel_while_paused_sends_nothing_and_leaves_nothing() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await start(nursery, flaky())
            async with engine(server) as eng:
                await eng.pause()
                with trio.move_on_after(0.1) as scope:
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G))
                assert scope.cancelled_caught
            nursery.cancel_scope.cancel()
    assert server.paths("/generate") == [] and server.paths("/abort_request") == []


async def test_engine_outside_async_with_refuses() -> None:
    eng = RemoteEngine("127.0.0.1:1")
    with pytest.raises(RuntimeError, match="async with"):
        await eng.agenerate(ModelRequest(input_ids=[1]))


async def test_retry_after_a_pause_waits_and_repins_the_version(autojump_clock: trio.abc.Clock) -> None:
    first = trio.Event()
    refused = trio.Event()

    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/generate":
            if not first.is_set():
                first.set()
                await trio.sleep(0.2)
                refused.set()
                return 503, b""
            return 200, sglang_body([5, 6], "length", version="2")
        return await default_reply(method, path, body)

    server = MockServer(script)
    async with server.engine() as eng:
        result = []

        async def gen() -> None:
            result.append(
                await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=2)))
            )

        async with trio.open_nursery() as inner:
            inner.start_soon(gen)
            await first.wait()
            await eng.pause()  # while the first attempt is failing
            await refused.wait()
            await trio.sleep(60)  # virtual: a retry that did not wait would have gone out
            assert len(server.paths("/generate")) == 1  # the retry waits for resume
            eng.set_version(2)
            await eng.resume()
    assert result[0].output_versions == (2, 2)
    order = [p for p, _ in server.log if p in ("/generate", "/continue_generation")]
    assert order == ["/generate", "/continue_generation", "/generate"]


async def test_a_user_transport_carries_generation_with_timeouts_aborts_and_cancels(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``transport=`` (the test seam) takes the direct generate path: each attempt is
    bounded by request_timeout and aborted, and so is a request its caller cancels."""
    seen: list[tuple[str, Any]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.sleep(0)  # as a network would: a cancelled caller stops here unless shielded
        seen.append((request.url.path, json.loads(request.content) if request.content else None))
        if request.url.path == "/generate":
            await trio.sleep_forever()
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"weight_version": "default"})
        return httpx.Response(200)

    retry = RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.01)
    transport = httpx.MockTransport(handler)
    async with RemoteEngine("127.0.0.1:9", transport=transport, request_timeout=10, retry=retry, seed=0) as eng:
        with pytest.raises(EngineTimeoutError, match="no complete answer within 10 s"):
            await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid="slow"))
        with trio.move_on_after(5) as scope:
            await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid="cancelled"))
        assert scope.cancelled_caught
    sent = [body["rid"] for path, body in seen if path == "/generate"]
    aborted = [body["rid"] for path, body in seen if path == "/abort_request"]
    assert len(sent) == 3 and aborted == sent
    assert [rid.rsplit("-", 1)[0] for rid in sent] == ["slow", "slow", "cancelled"]


async def test_an_address_refusing_connections_fails_fast_naming_it(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to wait the whole setup_timeout (300 s) with no error and no log line."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused")

    caplog.set_level("DEBUG", logger="rollout_trio.remote")
    start = trio.current_time()
    with pytest.raises(EngineConnectError, match=r"10\.1\.2\.3:4567.*connect_deadline=10 s.*Connection refused"):
        async with RemoteEngine("10.1.2.3:4567", transport=httpx.MockTransport(refuse), seed=0):
            pass
    assert 10 <= trio.current_time() - start <= 11  # virtual seconds: the default deadline
    probes = [r for r in caplog.records if "not healthy yet" in r.getMessage()]
    assert probes[0].levelname == "WARNING" and "Connection refused" in probes[0].getMessage()
    assert len(probes) > 2 and {r.levelname for r in probes[1:]} == {"DEBUG"}


async def test_a_server_that_answers_but_is_not_healthy_gets_the_setup_timeout(autojump_clock: trio.abc.Clock) -> None:
    def booting(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "loading"}})

    start = trio.current_time()
    with pytest.raises(EngineConnectError, match=r"setup_timeout=30.0 s.*10\.1\.2\.3:4567.*HTTP 503: loading"):
        async with RemoteEngine("10.1.2.3:4567", transport=httpx.MockTransport(booting), setup_timeout=30, seed=0):
            pass
    assert trio.current_time() - start >= 30
