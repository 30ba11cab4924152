"""vLLM parsers and request builders against responses recorded from a real vLLM 0.32 server."""

from __future__ import annotations

import json
import re
import math
import pathlib

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio import EngineProtocolError, EngineServerError, GenerationConfig, ModelRequest, VersionMismatchError
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.engines._sglang import SGLangBackend
from rollout_trio.engines._vllm import (
    VLLMBackend,
    parse_completions,
    parse_tito,
    parse_weight_versions,
    server_request_id,
)

from .conftest_remote import sglang_body

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "vllm"
if not FIXTURES.is_dir():  # a checkout elsewhere: shared/ beside the repository
    FIXTURES = pathlib.Path("/work/shared/fixtures/vllm")


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def body(name: str) -> dict:
    return load(f"{name}.response.json")["body"]


@pytest.mark.parametrize("name", ["length", "greedy", "topp_topk", "min_tokens"])
def test_completions_fixtures_parse(name: str) -> None:
    seg = parse_completions(body(name))
    lp = body(name)["choices"][0]["logprobs"]
    assert seg.tokens == [int(s.split(":")[1]) for s in lp["tokens"]]
    assert seg.logprobs == lp["token_logprobs"]
    assert seg.stop_reason == "length"
    assert seg.versions is None
    req = load(f"{name}.request.json")
    assert len(seg.tokens) == req["max_tokens"]


def test_completions_stop_token_is_last_output_token() -> None:
    seg = parse_completions(body("stop_token"))
    assert seg.stop_reason == "stop"
    assert seg.tokens[-1] == body("stop_token")["choices"][0]["stop_reason"] == 106
    assert seg.tokens[-1] in load("stop_token.request.json")["stop_token_ids"]


def test_tito_generate_matches_completions_for_same_seed() -> None:
    seg = parse_tito(body("tito_generate"))
    assert seg.tokens == [207, 129, 160, 187, 84, 239]
    assert seg.versions == [0] * 6  # "default" is version 0
    assert seg.stop_reason == "length"
    # Same prompt and seed through /v1/completions: same tokens and logprobs.
    assert seg.tokens == parse_completions(body("length")).tokens
    assert seg.logprobs == pytest.approx(parse_completions(body("length")).logprobs)


def test_tito_stop() -> None:
    seg = parse_tito(body("tito_generate_stop"))
    assert seg.stop_reason == "stop"
    assert seg.tokens[-1] == 106
    assert len(seg.tokens) == len(seg.logprobs) == len(seg.versions or []) == 22


def test_tito_server_request_id_is_prefixed() -> None:
    assert body("tito_generate")["request_id"] == server_request_id(load("tito_generate.request.json")["request_id"])
    abort = VLLMBackend("tito").abort("seqA")
    assert abort is not None and abort.json == {"request_ids": ["generate-tokens-seqA"]}
    assert abort.path == load("tito_abort.response.json")["endpoint"]
    assert VLLMBackend("completions").abort("x") is None


def test_weight_versions_ranges_from_pause_sequences() -> None:
    keep = load("pause_keep_sequence.json")["generate_response"]
    versions = parse_weight_versions(keep["weight_versions"], keep["n_tokens"], "t")
    assert versions[:147] == [1] * 147 and versions[147:] == [2] * 333
    aborted = load("pause_abort_sequence.json")["generate_response_after_pause"]
    assert aborted["finish_reason"] == "abort"
    assert parse_weight_versions(aborted["weight_versions"], aborted["n_tokens"], "t") == [0] * 140


@pytest.mark.parametrize(
    "ranges, n, rule",
    [
        ([{"version": "1", "start": 0, "end": 3}], 4, "cover 3 tokens"),
        ([{"version": "1", "start": 1, "end": 4}], 4, "tile"),
        ([{"version": "1", "start": 0, "end": 10**12}], 4, "tile"),
        ([{"version": "x", "start": 0, "end": 4}], 4, "canonical decimal integer"),
        ([{"version": "1", "start": 0}], 1, "'end'"),
        ({"version": "1"}, 1, "must be a list"),
    ],
)
def test_weight_versions_rejects_bad_ranges(ranges: object, n: int, rule: str) -> None:
    with pytest.raises(EngineProtocolError, match=rule):
        parse_weight_versions(ranges, n, "t")


def _mutate(name: str, fn) -> dict:  # type: ignore[no-untyped-def]
    b = body(name)
    fn(b)
    return b


@pytest.mark.parametrize(
    "mutation, rule",
    [
        (lambda b: b["choices"].clear(), r"\['choices'\]\[0\]: missing"),
        (lambda b: b["choices"][0].update(finish_reason="weird"), "unknown value 'weird'"),
        (lambda b: b["choices"][0]["logprobs"]["content"].pop(), "5 entries for 6 token_ids"),
        (lambda b: b["choices"][0]["logprobs"]["content"][2].update(logprob=None), r"content\[2\].logprob"),
        (lambda b: b["choices"][0]["logprobs"]["content"][2].update(logprob=-9999.0), "-9999"),
        (lambda b: b["choices"][0]["logprobs"]["content"][1].update(token_id=5), "disagrees"),
        (lambda b: b["choices"][0].update(token_ids=[1, "2"]), r"token_ids\[1\]"),
        (lambda b: b["choices"][0].pop("weight_versions"), "weight_versions: missing"),
    ],
)
def test_tito_malformed_raises_protocol_error(mutation, rule: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineProtocolError, match=rule):
        parse_tito(_mutate("tito_generate", mutation))


@pytest.mark.parametrize(
    "mutation, rule",
    [
        (lambda b: b["choices"][0]["logprobs"]["token_logprobs"].pop(), "6 tokens but 5 token_logprobs"),
        (lambda b: b["choices"][0]["logprobs"]["tokens"].__setitem__(0, "abc"), "token_id:N"),
        (lambda b: b["choices"][0]["logprobs"]["tokens"].__setitem__(0, "token_id:x"), "token_id:N"),
        (lambda b: b["choices"][0]["logprobs"]["token_logprobs"].__setitem__(1, float("nan")), "finite"),
        (lambda b: b["choices"][0]["logprobs"]["token_logprobs"].__setitem__(1, None), "finite"),
        (lambda b: b["choices"][0].update(logprobs=None), "logprobs: missing"),
        (lambda b: b["choices"][0].update(token_ids=[1, 2]), "disagrees"),
        (lambda b: b.pop("choices"), "missing"),
    ],
)
def test_completions_malformed_raises_protocol_error(mutation, rule: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EngineProtocolError, match=rule):
        parse_completions(_mutate("length", mutation))


def test_not_a_dict_body() -> None:
    for bad in (None, [], "text", 3):
        with pytest.raises(EngineProtocolError):
            parse_tito(bad)
        with pytest.raises(EngineProtocolError):
            parse_completions(bad)


def test_request_bodies_send_every_sampling_field() -> None:
    g = GenerationConfig(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=20, seed=7, stop_token_ids=[5])
    tito = VLLMBackend("tito").generate([1, 2], g, max_new=6, min_new=0, rid="r1")
    assert tito.path == "/inference/v1/generate"
    assert tito.json["request_id"] == "r1" and tito.json["token_ids"] == [1, 2]
    sp = tito.json["sampling_params"]
    for key in (
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "seed",
    ):
        assert key in sp, key
    assert (sp["top_k"], sp["seed"], sp["logprobs"], sp["temperature"]) == (20, 7, 0, 0.7)
    off = VLLMBackend("tito").generate([1], GenerationConfig(), max_new=3, min_new=0, rid="r")
    assert off.json["sampling_params"]["top_k"] == 0  # vLLM's "off"
    comp = VLLMBackend("completions").generate([1, 2], g.new(greedy=True), max_new=4, min_new=0, rid="r2")
    assert comp.path == "/v1/completions"
    assert comp.json["prompt"] == [1, 2] and comp.json["return_tokens_as_token_ids"] is True
    assert comp.json["logprobs"] == 0 and comp.json["max_tokens"] == 4 and comp.json["temperature"] == 0.0


def test_pause_modes_and_update_calls() -> None:
    b = VLLMBackend("tito")
    (pause,) = b.pause()
    assert (pause.path, pause.params) == ("/pause", {"mode": "abort"})
    calls = b.update_from_disk("/ckpt", 3, "/areal_update_weights")
    assert [c.path for c in calls] == ["/areal_update_weights", "/update_weight_version"]
    assert calls[0].json == {"model_path": "/ckpt"}
    calls = b.update_from_disk("/ckpt", 3, "/collective_rpc")  # the default: vLLM's own in-place reload
    assert [c.path for c in calls] == ["/collective_rpc", "/update_weight_version"]
    assert calls[0].json == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt"}}
    assert calls[1].json == {"new_version": "3"}
    assert [c.path for c in b.update_from_disk("/ckpt", 3, None)] == ["/update_weight_version"]


# --------------------------------------------------------------------- through RemoteEngine


class FakeVLLM:
    """A MockTransport handler replaying the recorded answers (and an abort, a pause)."""

    def __init__(self, *, scale_out: bool = True) -> None:
        self.scale_out = scale_out
        self.seen: list[tuple[str, object]] = []
        self.script: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        payload = json.loads(request.content) if request.content else None
        self.seen.append((path, payload))
        if path == "/health":
            return httpx.Response(200)
        if path == "/update_weight_version":
            return httpx.Response(200, json={"success": True, "new_version": payload["new_version"]})
        if path.startswith("/inference/v1/"):
            if not self.scale_out:
                return httpx.Response(403, json={"error": {"message": "needs --enable-scale-out"}})
            if path.endswith("abort_requests"):
                return httpx.Response(200, content=b"\n")
            if payload["request_id"].startswith("rollout-trio-probe"):
                return httpx.Response(200, json=body("tito_generate"))
            return httpx.Response(200, json=self.script.pop(0))
        if path == "/v1/completions":
            return httpx.Response(200, json=self.script.pop(0))
        return httpx.Response(404)


def _tito(tokens: list[int], finish: str, ranges: list[tuple[str, int, int]]) -> dict:
    return {
        "request_id": "generate-tokens-x",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "token_ids": tokens,
                "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in ranges],
                "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in tokens]},
            }
        ],
    }


def _engine(handler: FakeVLLM, **kw) -> RemoteEngine:  # type: ignore[no-untyped-def]
    return RemoteEngine(
        "127.0.0.1:9", "vllm", transport=httpx.MockTransport(handler), setup_timeout=5, seed=0,
        retry=RetryPolicy(attempts=2, backoff_base=0.01), **kw,
    )  # fmt: skip


async def test_remote_vllm_tito_resumes_after_abort_with_server_versions() -> None:
    fake = FakeVLLM()
    fake.script = [_tito([5, 6], "abort", [("default", 0, 2)]), _tito([7], "stop", [("default", 0, 1)])]
    with trio.fail_after(10):
        async with _engine(fake) as eng:
            resp = await eng.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=8)))
    assert resp.output_tokens == (5, 6, 7) and resp.output_versions == (0, 0, 0) and resp.stop_reason == "stop"
    gens = [
        p for path, p in fake.seen if path == "/inference/v1/generate" and not p["request_id"].startswith("rollout")
    ]
    assert gens[1]["token_ids"] == [1, 2, 3, 5, 6]  # partial tokens appended
    assert gens[1]["sampling_params"]["max_tokens"] == 6  # budget shrunk
    assert not [p for p, _ in fake.seen if p == "/update_weight_version"]  # only update_weights relabels


async def test_remote_vllm_keep_mode_mixed_versions_are_the_servers_labels() -> None:
    """A request held across an update carries the server's per-token labels (it used to
    raise VersionMismatchError against the version pinned when it was sent)."""
    fake = FakeVLLM()
    fake.script = [_tito([5, 6, 7], "length", [("1", 0, 1), ("2", 1, 3)])]
    with trio.fail_after(10):
        async with _engine(fake, version=1) as eng:
            resp = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=3)))
            assert resp.output_versions == (1, 2, 2)
            assert eng.get_version() == 1  # a server's labels never move the engine's version


async def test_remote_vllm_falls_back_to_completions_on_403() -> None:
    fake = FakeVLLM(scale_out=False)
    fake.script = [body("stop_token")]
    with trio.fail_after(10):
        async with _engine(fake) as eng:
            assert eng.servers[0].backend.api == "completions"
            resp = await eng.agenerate(
                ModelRequest(input_ids=[1, 87, 85, 260, 201], gconfig=GenerationConfig(max_new_tokens=200))
            )
    assert resp.stop_reason == "stop" and resp.output_tokens[-1] == 106
    assert resp.output_versions == (0,) * len(resp.output_tokens)
    assert all(math.isfinite(x) for x in resp.output_logprobs)


async def test_remote_vllm_400_is_not_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        if request.url.path == "/inference/v1/generate" and b"probe" not in request.content:
            calls += 1
            r = load("tito_bad_empty.response.json")
            return httpx.Response(r["status"], json=r["body"])
        return FakeVLLM()(request)

    with trio.fail_after(10):
        async with RemoteEngine("127.0.0.1:9", "vllm", transport=httpx.MockTransport(handler), seed=0) as eng:
            with pytest.raises(EngineServerError, match="too_short") as info:
                await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=3)))
    assert info.value.status_code == 400 and calls == 1


# --------------------------------------------------------------------- fuzzing the parsers


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 400) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)
PARSERS = [parse_tito, parse_completions, SGLangBackend().parse]


def _replace_at(doc: object, path: list[int], value: object) -> object:
    """``doc`` with the node reached by walking ``path`` (indices mod size) replaced."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[key] = _replace_at(doc[key], path[1:], value)  # type: ignore[index]
    return out


@settings(max_examples=300, deadline=None)
@given(body=JSON)
def test_parsers_never_crash_on_arbitrary_json(body: object) -> None:
    for parse in PARSERS:
        try:
            parse(body)
        except (EngineProtocolError, EngineServerError):
            pass


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(["tito_generate", "tito_generate_stop", "length", "stop_token", "sglang"]),
    path=st.lists(st.integers(0, 50), max_size=6),
    value=JSON,
)
def test_parsers_never_crash_on_corrupted_fixtures(name: str, path: list[int], value: object) -> None:
    if name == "sglang":
        original, parse = sglang_body([3, 4, 5], "stop", version="2"), SGLangBackend().parse
    else:
        original, parse = body(name), (parse_tito if name.startswith("tito") else parse_completions)
    corrupted = _replace_at(original, path, value)
    try:
        seg = parse(corrupted)
    except (EngineProtocolError, EngineServerError):
        return
    assert len(seg.tokens) == len(seg.logprobs)
    assert all(isinstance(t, int) and t >= 0 for t in seg.tokens)
    assert all(math.isfinite(x) and x <= 1e-6 for x in seg.logprobs)
    if seg.versions is not None:
        assert len(seg.versions) == len(seg.tokens)


class StatefulVLLM(FakeVLLM):
    """The recorded protocol with a server-side weight label (dev mode: /weight_info)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "default"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        payload = json.loads(request.content) if request.content else None
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/update_weight_version":
            self.label = payload["new_version"]
        if path in ("/pause", "/resume", "/collective_rpc"):
            self.seen.append((path, payload))
            return httpx.Response(200, json={"status": "ok"})
        if path == "/inference/v1/generate" and not payload["request_id"].startswith("rollout-trio-probe"):
            self.script = [_tito([5, 6], "length", [(self.label, 0, 2)])]
        return super().__call__(request)


async def test_vllm_second_client_adopts_the_updated_version_and_both_keep_generating() -> None:
    """Client A updates the server to 3; client B (default version 0) starts after: B adopts
    3 and never relabels the server, so A keeps generating (it used to get a mismatch)."""
    fake = StatefulVLLM()
    g = GenerationConfig(max_new_tokens=2)
    with trio.fail_after(10):
        async with _engine(fake) as a:
            assert a.get_version() == 0
            await a.update_weights("/ckpt/3", 3)
            async with _engine(fake) as b:
                assert b.get_version() == 3
                rb = await b.agenerate(ModelRequest(input_ids=[1], gconfig=g))
                ra = await a.agenerate(ModelRequest(input_ids=[1], gconfig=g))
    assert ra.output_versions == rb.output_versions == (3, 3)
    assert fake.label == "3"


async def test_vllm_without_a_version_endpoint_labels_tokens_as_reported_and_adopts_nothing() -> None:
    fake = FakeVLLM()
    fake.script = [_tito([5, 6], "length", [("7", 0, 2)]), _tito([8], "length", [("7", 0, 1)])]
    with trio.fail_after(10):
        async with _engine(fake) as eng:
            first = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=2)))
            assert eng.get_version() == 0  # one server's labels never move the engine's version
            second = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=1)))
    assert first.output_versions == (7, 7) and second.output_versions == (7,)


class ScriptedLabelledVLLM(StatefulVLLM):
    """StatefulVLLM (reports its label at /weight_info) answering generations from a script."""

    def __init__(self, label: str, replies: list[dict]) -> None:
        super().__init__()
        self.label = label
        self.replies = replies

    def __call__(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content) if request.content else None
        if request.url.path == "/inference/v1/generate" and not payload["request_id"].startswith("rollout-trio-probe"):
            return httpx.Response(200, json=self.replies.pop(0))
        return super().__call__(request)


async def test_remote_vllm_stale_newer_or_backwards_versions_take_the_server_out() -> None:
    """Each answer is dropped and its server taken out of service (it used to fail the
    request, and a newer label was adopted: one server moved the fleet, issue 34 item 3).
    A lone server's out: the request fails typed; check_fleet brings it back at the
    fleet's version (this engine never published, and it reports the fleet's version)."""
    from rollout_trio import ServerUnavailableError

    fake = ScriptedLabelledVLLM(
        "2",
        [
            _tito([5, 6], "length", [("2", 0, 1), ("1", 1, 2)]),
            _tito([5], "length", [("1", 0, 1)]),
            _tito([5], "length", [("3", 0, 1)]),
            _tito([5], "length", [("2", 0, 1)]),
        ],
    )
    g = GenerationConfig(max_new_tokens=2)
    with trio.fail_after(10):
        async with _engine(fake, health_interval=3600) as eng:
            assert eng.get_version() == 2
            for reason, budget in [
                (r"go backwards within a segment \(2 then 1 at token 1\)", 2),
                (r"version 1 for tokens of a segment sent when the fleet was at version 2", 1),
                (r"weight version 3, newer than the fleet's 2", 1),
            ]:
                with pytest.raises(ServerUnavailableError, match="every server is out of service"):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=g.new(max_new_tokens=budget)))
                (server,) = eng.servers
                assert not server.up and server.barred and re.search(reason, str(server.error))
                assert eng.get_version() == 2  # never adopted
                await eng.check_fleet()
                assert server.up
            honest = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=g.new(max_new_tokens=1)))
            assert honest.output_versions == (2,)
