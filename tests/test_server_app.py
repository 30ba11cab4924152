"""The SGLang-protocol app on Hypercorn (and in process), over a scripted InferenceEngine.

Tests wait on state (polling the app's counters) or run on ``autojump_clock``; none
sleeps and then asserts that something is mid-flight.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from typing import Any, Self

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio import EngineError, ModelRequest, ModelResponse
from rollout_trio.engines import InferenceEngine, WeightsSource
from rollout_trio.server import ServerLimits, SGLangApp, serve_app, sglang_asgi


class StepEngine:
    """Emits token (last + 1) % 50 every ``delay`` seconds; logprob -0.1."""

    def __init__(self, delay: float = 0.005) -> None:
        self.delay = delay
        self.version = 0
        self.updates: list[tuple[str, int]] = []
        self.running = 0
        self.emitted = 0

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
                self.emitted += 1
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
        self.engine: StepEngine = app.engine  # type: ignore[assignment]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def post(self, path: str, body: Any = None) -> httpx.Response:
        return await self.client.post(self.url + path, json=body)

    async def generate(self, rid: str, n: int = 200, **sp: Any) -> dict:
        r = await self.post("/generate", {"rid": rid, "input_ids": [1, 2], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": n, **sp}})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()


async def until(predicate: Any) -> None:
    """Poll ``predicate()`` (state, not time) until it holds; the caller's deadline bounds it."""
    while not predicate():
        await trio.sleep(0.002)


async def run_app(fn, *, limits: ServerLimits | None = None, api_key: str | None = None, **kw: Any) -> Any:  # type: ignore[no-untyped-def]
    engine = StepEngine()
    app = SGLangApp(engine, segment_tokens=4, **kw)
    limits = limits or ServerLimits()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_app, sglang_asgi(app, api_key=api_key, limits=limits), "127.0.0.1", 0, limits)
            port = bound[0][1]
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
            await until(lambda: s.engine.emitted >= 4)  # a chunk in
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
            await until(lambda: s.engine.emitted >= 1)
            await s.post("/pause_generation", {"mode": "retract"})
            await until(lambda: s.engine.running == 0)  # the chunk in flight was interrupted
            held = s.engine.emitted
            assert "a" not in got and s.app._live["a"].reason == "hold"
            await s.post("/continue_generation", {})
        assert held < 40
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
            await until(lambda: s.engine.running == 3)
            await s.post("/abort_request", {"rid": "x"})
            await until(lambda: "x" in got)
            await s.post("/abort_request", {"abort_all": True})
        assert {rid: g["meta_info"]["finish_reason"]["message"] for rid, g in got.items()} == {
            rid: "Abort by /abort_request" for rid in "xyz"
        }
        st = (await s.client.get(s.url + "/stats")).json()
        assert st["generate_aborted"] == 4 and st["in_flight"] == 0 and s.engine.running == 0
        assert (await s.post("/abort_request", {})).status_code == 400

    await run_app(scenario)


async def test_update_weights_from_disk_labels_version_and_aborts() -> None:
    async def scenario(s: Running) -> None:
        got: dict[str, dict] = {}

        async def gen() -> None:
            got["a"] = await s.generate("a")

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            await until(lambda: s.engine.running == 1)
            r = await s.post("/update_weights_from_disk",
                             {"model_path": "/ckpt/7", "abort_all_requests": True, "weight_version": "7"})  # fmt: skip
            assert r.json()["success"] is True
        assert got["a"]["meta_info"]["finish_reason"]["message"] == "Abort due to a weight update"
        assert s.engine.updates == [("/ckpt/7", 7)]
        assert (await s.generate("b", n=2))["meta_info"]["weight_version"] == "7"
        assert (await s.client.get(s.url + "/get_weight_version")).json() == {"weight_version": "7"}
        r = await s.post("/update_weight_version", {"new_version": "8"})
        assert r.json() == {"success": True, "new_version": "8"} and s.engine.version == 8
        assert (await s.post("/update_weights_from_disk", {})).status_code == 400

    await run_app(scenario)


async def test_client_disconnect_cancels_generation() -> None:
    async def scenario(s: Running) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", s.port)
        body = b'{"rid":"gone","input_ids":[1],"sampling_params":{"max_new_tokens":400}}'
        await stream.send_all(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await until(lambda: s.engine.running == 1)
        await stream.aclose()
        await until(lambda: s.engine.running == 0 and not s.app._live)
        st = (await s.client.get(s.url + "/stats")).json()
        assert st["generate_cancelled"] == 1 and st["in_flight"] == 0 and "gone" not in st["finished_rids"]
        assert s.engine.emitted < 400

    await run_app(scenario)


async def test_shut_down_ends_generations_with_their_partial_output_and_refuses_new_ones() -> None:
    async def scenario(s: Running) -> None:
        got: dict[str, dict] = {}

        async def gen() -> None:
            got["a"] = await s.generate("a", n=400)

        async with trio.open_nursery() as n:
            n.start_soon(gen)
            await until(lambda: s.engine.emitted >= 4)
            s.app.shut_down()
        meta = got["a"]["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort due to server shutdown"}
        assert 0 < meta["completion_tokens"] < 400
        r = await s.post("/generate", {"input_ids": [1]})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]

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


# Each value here was answered 200 (or with a misleading or leaked message) by the
# hand-written server; the rules are GenerationConfig's, so `run --temperature -1` agrees.
@pytest.mark.parametrize(
    "sampling_params, message",
    [
        (b'{"temperature": -1}', "sampling_params.temperature: must satisfy temperature >= 0, got -1"),
        (b'{"temperature": NaN}', "sampling_params.temperature: must satisfy temperature >= 0, got nan"),
        (b'{"temperature": "NaN"}', "sampling_params.temperature: must be a number, got 'NaN' (str)"),
        (b'{"temperature": Infinity}', "sampling_params.temperature: must satisfy temperature >= 0, got inf"),
        (b'{"temperature": true}', "sampling_params.temperature: must be a number, got True (bool)"),
        (b'{"max_new_tokens": "8"}', "sampling_params.max_new_tokens: must be an integer, got '8' (str)"),
        (b'{"max_new_tokens": 8.5}', "sampling_params.max_new_tokens: must be an integer, got 8.5 (float)"),
        (b'{"max_new_tokens": 0}', "sampling_params.max_new_tokens: must satisfy max_new_tokens > 0, got 0"),
        (b'{"top_p": NaN}', "sampling_params.top_p: must satisfy 0 < top_p <= 1, got nan"),
        (b'{"top_k": -2}', "sampling_params.top_k: must satisfy top_k == -1, 0 or >= 1, got -2"),
        (b'{"frequency_penalty": 3}', "sampling_params.frequency_penalty: must satisfy -2 <= frequency_penalty <= 2"),
        (b'{"stop_token_ids": [1, -2]}', "sampling_params.stop_token_ids[1]: must be a non-negative integer token id"),
        (b'{"min_new_tokens": -1}', "sampling_params.min_new_tokens: must satisfy min_new_tokens >= 0, got -1"),
        (b'{"sampling_seed": "1"}', "sampling_params.sampling_seed: must be an integer, got '1' (str)"),
        (b'{"ignore_eos": "yes"}', "sampling_params.ignore_eos: must be true or false, got 'yes' (str)"),
        (b"[1]", "sampling_params: must be a JSON object"),
    ],
)
async def test_bad_sampling_values_are_a_400_naming_the_field_and_the_rule(sampling_params: bytes, message: str) -> None:
    app = SGLangApp(StepEngine(delay=0), segment_tokens=4)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sglang_asgi(app)), base_url="http://t") as client:
        body = b'{"input_ids": [1, 2], "sampling_params": %s}' % sampling_params
        r = await client.post("/generate", content=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "generate: " + message or message in r.json()["error"]["message"]
    assert message in r.json()["error"]["message"]
    assert app.engine.emitted == 0  # type: ignore[attr-defined]


async def test_request_body_over_the_limit_is_a_413_declared_or_streamed() -> None:
    assert ServerLimits().max_body_bytes == 4 * 1024 * 1024  # the default: decoding it stalls nobody long

    async def scenario(s: Running) -> None:
        r = await s.client.post(s.url + "/generate", content=b"[" + b"1," * 600 + b"1]")
        assert r.status_code == 413 and "max_body_bytes=1000" in r.json()["error"]["message"]

        async def chunks() -> Any:  # no Content-Length: counted as it streams
            for _ in range(20):
                yield b"x" * 100

        r = await s.client.post(s.url + "/generate", content=chunks())
        assert r.status_code == 413
        ok = await s.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200

    await run_app(scenario, limits=ServerLimits(max_body_bytes=1000))


async def test_default_body_limit_refuses_a_declared_16_mib_body_before_reading_it() -> None:
    async def scenario(s: Running) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", s.port)
        await stream.send_all(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (16 * 2**20 + 1))
        answer = await stream.receive_some(4096)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        await stream.aclose()

    await run_app(scenario)


async def test_request_head_far_over_h11_default_is_a_431() -> None:
    async def scenario(s: Running) -> None:
        r = await s.client.get(s.url + "/health", headers={"x-big": "a" * (200 * 1024)})
        assert r.status_code == 431
        assert (await s.client.get(s.url + "/health")).status_code == 200

    await run_app(scenario)


async def test_a_body_trickled_byte_by_byte_is_cut_off_at_the_read_deadline(autojump_clock: trio.abc.Clock) -> None:
    sent = 0

    async def scenario(s: Running) -> None:
        nonlocal sent
        stream = await trio.open_tcp_stream("127.0.0.1", s.port)
        await stream.send_all(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
        start = trio.current_time()
        answer = b""
        async with trio.open_nursery() as n:

            async def trickle() -> None:  # one byte a second: each receive is quick, the whole is not
                nonlocal sent
                for _ in range(100):
                    await stream.send_all(b" ")
                    sent += 1
                    await trio.sleep(1)

            n.start_soon(trickle)
            while not answer.endswith(b"}"):  # the head, then the JSON body
                answer += await stream.receive_some(4096)
            n.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"read_deadline=10" in answer
        assert 10 <= trio.current_time() - start < 100 and sent < 100
        await stream.aclose()

    await run_app(scenario, limits=ServerLimits(read_deadline=10))


async def test_idle_connection_closes_after_keep_alive_timeout(autojump_clock: trio.abc.Clock) -> None:
    async def scenario(s: Running) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", s.port)
        await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await stream.receive_some(4096)).startswith(b"HTTP/1.1 200")
        start = trio.current_time()
        assert await stream.receive_some(4096) == b""  # closed by the server
        assert trio.current_time() - start >= 20
        await stream.aclose()

    await run_app(scenario, limits=ServerLimits(keep_alive_timeout=20))


def test_max_connections_beyond_the_hard_open_file_limit_is_a_value_error() -> None:
    # Connections beyond the open-file limit get a 503: tests/test_hostile_http.py.
    # In a child process whose hard limit is lowered to 1024 (anyone may lower it), so
    # the check runs whatever limit this machine has, unlimited included.
    program = textwrap.dedent("""
        import resource
        from rollout_trio._http._limits import ServerLimits, ensure_capacity
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), 1024))
        try:
            ensure_capacity(ServerLimits(max_connections=1025), open_files=10)
        except ValueError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    assert re.search(r"max_connections: .* hard open-file limit \(RLIMIT_NOFILE\) is 1024", out.stdout), out


async def test_api_key_guards_every_route_but_health() -> None:
    async def scenario(s: Running) -> None:
        assert (await s.client.get(s.url + "/health")).status_code == 200
        body = {"model_path": "/etc", "weight_version": "3"}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
            r = await s.client.post(s.url + "/update_weights_from_disk", json=body, headers=headers)
            assert r.status_code == 401 and "api key" in r.json()["error"]["message"]
            assert r.headers["www-authenticate"] == "Bearer"
            assert (await s.client.get(s.url + "/get_model_info", headers=headers)).status_code == 401
        assert s.engine.updates == []
        good = {"authorization": "Bearer sekrit"}
        r = await s.client.post(s.url + "/update_weights_from_disk", json=body, headers=good)
        assert r.status_code == 200 and s.engine.updates == [("/etc", 3)]

    await run_app(scenario, api_key="sekrit")


async def test_route_crash_is_a_500_and_server_keeps_serving() -> None:
    async def scenario(s: Running) -> None:
        async def boom(_body: Any) -> Any:
            raise RuntimeError("kaput")

        s.app.routes[("GET", "/stats")] = boom  # routes are bound when the ASGI app is built
        r = await s.client.get(s.url + "/get_model_info")
        assert r.status_code == 200

    await run_app(scenario)
    app = SGLangApp(StepEngine(delay=0), segment_tokens=4)

    async def boom(_body: Any) -> Any:
        raise RuntimeError("kaput")

    app.routes[("GET", "/stats")] = boom
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=sglang_asgi(app)), base_url="http://t") as client:
        r = await client.get("/stats")
        assert r.status_code == 500 and "RuntimeError: kaput" in r.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200


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
    async def check() -> int:
        app = SGLangApp(StepEngine(delay=0), segment_tokens=4)
        transport = httpx.ASGITransport(app=sglang_asgi(app))
        with trio.fail_after(5):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                response = await client.post(path, content=json.dumps(body).encode())
        return response.status_code

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


# -- issue 34 item 3: serve reads version labels by the engine's rules, behind the key ------


@pytest.mark.parametrize("label", ["1_000", " 7 ", "\u0663", "-5", "007", "+1", str(2**63), str(10**30), "x", ""])
@pytest.mark.parametrize("path, key", [("/update_weight_version", "new_version"), ("/update_weights_from_disk", "weight_version")])
async def test_a_non_canonical_version_label_is_a_400_naming_the_field(label: str, path: str, key: str) -> None:
    """On main: int() read "1_000", " 7 ", "\u0663" and "-5", and any other label became
    the engine's version + 1."""

    async def scenario(s: Running) -> None:
        body = {key: label, **({"model_path": "/ckpt"} if "disk" in path else {})}
        r = await s.post(path, body)
        assert r.status_code == 400, r.text
        assert key in r.text and "canonical decimal integer" in r.text
        assert s.engine.version == 0 and s.engine.updates == []
        assert (await s.client.get(s.url + "/get_weight_version")).json() == {"weight_version": "default"}

    await run_app(scenario)


@pytest.mark.parametrize("label, version", [("0", 0), ("default", 0), ("12", 12), (str(2**63 - 1), 2**63 - 1)])
async def test_canonical_labels_set_the_engines_version(label: str, version: int) -> None:
    async def scenario(s: Running) -> None:
        r = await s.post("/update_weight_version", {"new_version": label})
        assert r.status_code == 200 and s.engine.version == version

    await run_app(scenario)


async def test_relabelling_needs_the_api_key_when_one_is_set() -> None:
    async def scenario(s: Running) -> None:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = await s.client.post(s.url + "/update_weight_version", json={"new_version": "1000"}, headers=headers)
            assert r.status_code == 401
        assert s.engine.version == 0
        r = await s.client.post(
            s.url + "/update_weight_version", json={"new_version": "3"}, headers={"authorization": "Bearer sekrit"}
        )
        assert r.status_code == 200 and s.engine.version == 3

    await run_app(scenario, api_key="sekrit")
