"""The SGLang-protocol app and HTTP server in-process, over a scripted InferenceEngine."""

from __future__ import annotations

import json
from typing import Any, Self

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio import EngineError, ModelRequest, ModelResponse
from rollout_trio.engines import InferenceEngine, WeightsSource
from rollout_trio.server import HttpServer, SGLangApp


class StepEngine:
    """Emits token (last + 1) % 50 every ``delay`` seconds; logprob -0.1."""

    def __init__(self, delay: float = 0.005) -> None:
        self.delay = delay
        self.version = 0
        self.updates: list[tuple[str, int]] = []
        self.running = 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        g = req.gconfig
        if req.input_ids[0] == 99:
            raise EngineError("StepEngine: worker crashed")
        out: list[int] = []
        self.running += 1
        try:
            last = req.input_ids[-1]
            while len(out) < g.max_new_tokens:
                await trio.sleep(self.delay)
                last = (last + 1) % 50
                out.append(last)
                if last in g.stop_token_ids:
                    break
        finally:
            self.running -= 1
        stop = "stop" if out and out[-1] in g.stop_token_ids else "length"
        return ModelResponse(
            input_tokens=req.input_ids, output_tokens=out, output_logprobs=[-0.1] * len(out),
            output_versions=[self.version] * len(out), stop_reason=stop,
        )  # fmt: skip

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        await trio.sleep(0.05)
        self.updates.append((str(source), version))
        self.version = version

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def test_step_engine_is_an_inference_engine() -> None:
    assert isinstance(StepEngine(), InferenceEngine)


class Running:
    def __init__(self, app: SGLangApp, url: str, client: httpx.AsyncClient, nursery: trio.Nursery) -> None:
        self.app, self.url, self.client, self.nursery = app, url, client, nursery

    async def post(self, path: str, body: Any = None) -> httpx.Response:
        return await self.client.post(self.url + path, json=body)

    async def generate(self, rid: str, n: int = 200, **sp: Any) -> dict:
        r = await self.post("/generate", {"rid": rid, "input_ids": [1, 2], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": n, **sp}})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()


async def run_app(fn, **kw: Any) -> Any:  # type: ignore[no-untyped-def]
    engine = StepEngine()
    app = SGLangApp(engine, segment_tokens=4, **kw)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(HttpServer(app).serve, "127.0.0.1", 0)
            port = listeners[0].socket.getsockname()[1]
            async with httpx.AsyncClient(timeout=10) as client:
                result = await fn(Running(app, f"http://127.0.0.1:{port}", client, nursery))
            nursery.cancel_scope.cancel()
    return result


async def test_pause_abort_mode_returns_partial_output_and_refuses_new_work() -> None:
    async def scenario(s: Running) -> None:
        got: dict[str, dict] = {}

        async def gen(rid: str) -> None:
            got[rid] = await s.generate(rid)

        async with trio.open_nursery() as n:
            n.start_soon(gen, "a")
            await trio.sleep(0.1)
            assert (await s.post("/pause_generation", {"mode": "abort"})).json()["status"] == "ok"
        meta = got["a"]["meta_info"]
        k = len(got["a"]["output_ids"])
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort in running queue due to engine pause"}
        assert 0 < k < 200 and len(meta["output_token_logprobs"]) == k
        early = (await s.generate("b"))["meta_info"]
        assert early["finish_reason"]["message"] == "Abort before prefill due to engine pause"
        assert early["completion_tokens"] == 0
        await s.post("/continue_generation", {})
        done = (await s.generate("c", n=10))["meta_info"]
        assert done["finish_reason"] == {"type": "length", "length": 10}
        st = (await s.client.get(s.url + "/stats")).json()
        assert st["generate_interrupted"] == 2 and st["generate_finished"] == 1 and st["finished_rids"] == ["c"]

    await run_app(scenario)


async def test_retract_mode_holds_then_completes() -> None:
    async def scenario(s: Running) -> None:
        got: dict[str, dict] = {}

        async def gen() -> None:
            got["a"] = await s.generate("a", n=40)

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            await trio.sleep(0.05)
            await s.post("/pause_generation", {"mode": "retract"})
            await trio.sleep(0.2)
            assert "a" not in got and s.app.engine.running == 0  # type: ignore[attr-defined]
            await s.post("/continue_generation", {})
        assert got["a"]["meta_info"]["finish_reason"]["type"] == "length"
        assert got["a"]["output_ids"] == [(3 + i) % 50 for i in range(40)]

    await run_app(scenario)


async def test_abort_by_rid_before_and_during_generation_and_abort_all() -> None:
    async def scenario(s: Running) -> None:
        r = await s.post("/abort_request", {"rid": "early"})
        assert r.status_code == 200 and r.content == b""
        assert (await s.generate("early"))["meta_info"]["finish_reason"]["type"] == "abort"
        got: dict[str, dict] = {}

        async def gen(rid: str) -> None:
            got[rid] = await s.generate(rid)

        async with trio.open_nursery() as n:
            for rid in ("x", "y", "z"):
                n.start_soon(gen, rid)
            await trio.sleep(0.05)
            await s.post("/abort_request", {"rid": "x"})
            await trio.sleep(0.05)
            await s.post("/abort_request", {"abort_all": True})
        assert {rid: g["meta_info"]["finish_reason"]["message"] for rid, g in got.items()} == {
            rid: "Abort by /abort_request" for rid in "xyz"
        }
        st = (await s.client.get(s.url + "/stats")).json()
        assert st["generate_aborted"] == 4 and st["in_flight"] == 0 and s.app.engine.running == 0  # type: ignore[attr-defined]
        assert (await s.post("/abort_request", {})).status_code == 400

    await run_app(scenario)


async def test_update_weights_from_disk_labels_version_and_aborts() -> None:
    async def scenario(s: Running) -> None:
        got: dict[str, dict] = {}

        async def gen() -> None:
            got["a"] = await s.generate("a")

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            await trio.sleep(0.05)
            r = await s.post("/update_weights_from_disk",
                             {"model_path": "/ckpt/7", "abort_all_requests": True, "weight_version": "7"})  # fmt: skip
            assert r.json()["success"] is True
        assert got["a"]["meta_info"]["finish_reason"]["message"] == "Abort due to a weight update"
        assert s.app.engine.updates == [("/ckpt/7", 7)]  # type: ignore[attr-defined]
        assert (await s.generate("b", n=2))["meta_info"]["weight_version"] == "7"
        assert (await s.client.get(s.url + "/get_weight_version")).json() == {"weight_version": "7"}
        r = await s.post("/update_weight_version", {"new_version": "8"})
        assert r.json() == {"success": True, "new_version": "8"} and s.app.engine.version == 8  # type: ignore[attr-defined]
        assert (await s.post("/update_weights_from_disk", {})).status_code == 400

    await run_app(scenario)


async def test_client_disconnect_cancels_generation() -> None:
    async def scenario(s: Running) -> None:
        port = int(s.url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        body = b'{"rid":"gone","input_ids":[1],"sampling_params":{"max_new_tokens":400}}'
        await stream.send_all(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await trio.sleep(0.1)
        assert s.app.engine.running == 1  # type: ignore[attr-defined]
        await stream.aclose()
        with trio.fail_after(2):
            while s.app.engine.running:  # type: ignore[attr-defined]
                await trio.sleep(0.01)
        st = (await s.client.get(s.url + "/stats")).json()
        assert st["generate_cancelled"] == 1 and st["in_flight"] == 0 and "gone" not in st["finished_rids"]

    await run_app(scenario)


@pytest.mark.parametrize(
    "method, path, body, status, message",
    [
        ("GET", "/nope", None, 404, "no endpoint /nope"),
        ("GET", "/generate", None, 405, "not allowed"),
        ("POST", "/generate", b"{not json", 400, "not JSON"),
        ("POST", "/generate", b"[1]", 400, "JSON object"),
        ("POST", "/generate", b'{"input_ids": [1], "stream": true}', 400, "stream"),
        ("POST", "/generate", b'{"input_ids": [[1]]}', 400, "input_ids"),
        ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"bogus": 1}}', 400, "bogus"),
        ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"top_p": 2}}', 400, "top_p"),
        ("POST", "/pause_generation", b'{"mode": "sideways"}', 400, "mode"),
        ("POST", "/generate", b'{"input_ids": [99]}', 500, "worker crashed"),
    ],
)
async def test_bad_requests(method: str, path: str, body: bytes | None, status: int, message: str) -> None:
    async def scenario(s: Running) -> None:
        r = await s.client.request(method, s.url + path, content=body)
        assert r.status_code == status and message in r.json()["error"]["message"]

    await run_app(scenario)


async def test_handler_crash_is_a_500_and_server_keeps_serving() -> None:
    async def boom(request: Any) -> Any:
        if request.path == "/boom":
            raise RuntimeError("kaput")
        from rollout_trio.server import Response

        return Response(200, b"fine", "text/plain")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(HttpServer(boom).serve, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            async with httpx.AsyncClient() as client:
                r = await client.get(url + "/boom")
                assert r.status_code == 500 and "kaput" in r.json()["error"]["message"]
                assert (await client.get(url + "/")).text == "fine"
            nursery.cancel_scope.cancel()


async def test_idle_and_stalled_connections_are_closed_and_server_keeps_serving() -> None:
    from rollout_trio.server import Response

    async def ok(request: Any) -> Any:
        return Response(200, b"fine", "text/plain")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            server = HttpServer(ok, idle_timeout=0.1, read_timeout=0.1)
            listeners = await nursery.start(server.serve, "127.0.0.1", 0)
            port = listeners[0].socket.getsockname()[1]
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            stalled = await trio.open_tcp_stream("127.0.0.1", port)
            await stalled.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
            assert await idle.receive_some(10) == b""  # closed by the server
            assert await stalled.receive_some(10) == b""
            await idle.aclose()
            await stalled.aclose()
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "fine"
            nursery.cancel_scope.cancel()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 60) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_SP_KEYS = st.sampled_from(
    [
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_token_ids",
        "stop",
        "ignore_eos",
        "frequency_penalty",
        "sampling_seed",
        "min_p",
        "n",
    ]
)
_PATHS = [
    "/generate",
    "/abort_request",
    "/pause_generation",
    "/update_weight_version",
    "/update_weights_from_disk",
    "/continue_generation",
]


def _answer(path: str, body: Any) -> int:
    from rollout_trio.server import Request

    async def check() -> int:
        app = SGLangApp(StepEngine(delay=0), segment_tokens=4)
        with trio.fail_after(5):
            response = await app(Request("POST", path, {}, {}, json.dumps(body).encode()))
        return response.status

    return trio.run(check)


@settings(max_examples=100, deadline=None)
@given(path=st.sampled_from(_PATHS), body=_JSON)
def test_app_answers_any_json_without_a_500(path: str, body: Any) -> None:
    assert _answer(path, body) in (200, 400)


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(-2, 60), min_size=1, max_size=4),
    sp=st.dictionaries(_SP_KEYS, _JSON | st.integers(0, 40), max_size=5),
)
def test_generate_answers_any_sampling_params_without_a_500(ids: list[int], sp: dict[str, Any]) -> None:
    assert _answer("/generate", {"input_ids": ids, "sampling_params": sp}) in (200, 400)
