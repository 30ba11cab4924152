"""RemoteEngine builds its ModelResponse without checking it again: the property below
holds it to the contract the checking constructor enforces, on whatever a server answers."""

from __future__ import annotations

from typing import Any

import attrs
import trio
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollout_trio import EngineProtocolError, GenerationConfig, ModelRequest, ModelResponse
from rollout_trio.engines import RemoteEngine

from .conftest_remote import FakeServer, default_reply

entries = st.lists(st.tuples(st.floats(-30.0, 0.0), st.integers(0, 300)), max_size=12)
# What a broken server might send instead of one entry's logprob or token id.
CORRUPTIONS = {
    "nan": (float("nan"), None), "positive": (0.5, None), "-inf": (float("-inf"), None),
    "vllm -9999": (-9999.0, None), "negative id": (None, -1),
}  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    segments=st.lists(st.tuples(entries, st.sampled_from(["length", "stop", "abort"])), min_size=1, max_size=3),
    version=st.sampled_from(["default", "0", "3"]),
    prompt=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    corruption=st.one_of(st.none(), st.sampled_from(sorted(CORRUPTIONS))),
)
def test_a_remote_response_is_what_the_checking_constructor_accepts_or_a_protocol_error(
    segments: list[tuple[list[tuple[float, int]], str]], version: str, prompt: list[int], corruption: str | None
) -> None:
    """Invariant: agenerate returns a response equal to one rebuilt by the checking
    ModelResponse constructor from its own fields; an answer with one broken entry (a
    logprob that is not finite, above 0 or vLLM's -9999.0, a negative token id) raises
    EngineProtocolError instead."""
    assume(not any(finish == "abort" and not pairs for pairs, finish in segments))  # empty aborts: another test
    bad = False
    if corruption is not None and segments[0][0]:
        lp, tid = segments[0][0][0]
        bad_lp, bad_tid = CORRUPTIONS[corruption]
        segments[0][0][0] = (lp if bad_lp is None else bad_lp, tid if bad_tid is None else bad_tid)
        bad = True
    answers = iter(segments)

    async def script(method: str, path: str, body: Any) -> Any:
        if path == "/get_model_info":
            return 200, {"weight_version": version}
        if path == "/generate":
            pairs, finish = next(answers, ([], "stop"))
            pairs = pairs[: body["sampling_params"]["max_new_tokens"]]
            fr: dict[str, Any] = {"type": finish, **({"message": "paused"} if finish == "abort" else {})}
            meta = {"id": "x", "finish_reason": fr, "weight_version": version,
                    "output_token_logprobs": [[lp, t, None] for lp, t in pairs]}  # fmt: skip
            return 200, {"text": "", "output_ids": [t for _, t in pairs], "meta_info": meta}
        return await default_reply(method, path, body)

    async def main() -> ModelResponse | Exception:
        server = FakeServer(script)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            try:
                async with RemoteEngine(server.address, setup_timeout=5, max_empty_aborts=1) as engine:
                    req = ModelRequest(input_ids=prompt, gconfig=GenerationConfig(max_new_tokens=30))
                    with trio.fail_after(20):
                        return await engine.agenerate(req)
            except EngineProtocolError as exc:
                return exc
            finally:
                nursery.cancel_scope.cancel()

    got = trio.run(main)
    if bad:
        assert isinstance(got, EngineProtocolError), got
        return
    assert not isinstance(got, Exception), got
    rebuilt = ModelResponse(**attrs.asdict(got, recurse=False))  # the checking constructor
    assert rebuilt == got
    assert len(got.output_tokens) == len(got.output_logprobs) == len(got.output_versions)


class _Dict(dict):  # type: ignore[type-arg]
    """A dict the SGLang parser's fast path does not take: it goes through field()."""


class _List(list):  # type: ignore[type-arg]
    """A list the parser's per-entry fast path does not take: the checking loop reads it."""


class _Str(str):
    """A str the parser's finish-reason fast path does not take."""


def _checking_path(value: Any) -> Any:
    """``value`` with every dict, list and str in it subclassed (same contents)."""
    if isinstance(value, dict):
        return _Dict({k: _checking_path(v) for k, v in value.items()})
    if isinstance(value, list):
        return _List(_checking_path(v) for v in value)
    if isinstance(value, str):
        return _Str(value)
    return value


def _outcome(body: Any) -> Any:
    from rollout_trio.engines._sglang import SGLangBackend

    try:
        seg = SGLangBackend().parse(body)
    except EngineProtocolError as exc:  # a message names the type it got: the subclasses' names are not the point
        return ("error", str(exc).replace("_Dict", "dict").replace("_List", "list").replace("_Str", "str"))
    return (list(seg.tokens), [repr(x) for x in seg.logprobs], seg.stop_reason, seg.server_version, str(seg.message))


_MISSING: Any = object()
_odd = st.sampled_from([None, 3, "x", [], {}, True, -1, 1.5])
_logprobs = st.one_of(st.floats(-30.0, 0.0), st.sampled_from([float("nan"), float("-inf"), 0.5, -9999.0, 0, -2, True]), _odd)
_token_ids = st.one_of(st.integers(0, 300), st.sampled_from([-1, True, 2.0, "5"]), _odd)
_entries = st.one_of(st.tuples(_logprobs, _token_ids, st.none()).map(list), st.tuples(_logprobs).map(list), _odd)


@st.composite
def sglang_bodies(draw: st.DrawFn) -> Any:
    """SGLang /generate answers, well-formed or broken at any level."""
    fr: Any = {
        "type": draw(st.one_of(st.sampled_from(["stop", "length", "abort", "tool_calls", "eos"]), _odd)),
        "message": draw(st.one_of(st.none(), st.just("paused"), _odd)),
    }
    meta: Any = {
        "finish_reason": draw(st.one_of(st.just(fr), _odd, st.just(_MISSING))),
        "output_token_logprobs": draw(st.one_of(st.lists(_entries, max_size=6), _odd, st.just(_MISSING))),
        "weight_version": draw(st.one_of(st.sampled_from(["0", "7", "default", "v2", 4]), _odd, st.just(_MISSING))),
    }
    meta = {k: v for k, v in meta.items() if v is not _MISSING}
    body: Any = {"text": "", "meta_info": draw(st.one_of(st.just(meta), st.just(meta), _odd, st.just(_MISSING)))}
    return {k: v for k, v in body.items() if v is not _MISSING}


@settings(max_examples=400, deadline=None)
@given(sglang_bodies())
def test_the_sglang_parsers_fast_path_answers_as_its_checking_path(body: Any) -> None:
    """Invariant: SGLangBackend.parse gives the same segment (or the same
    EngineProtocolError message, naming the field) whether it reads a body through its
    fast path (plain dicts, lists and strs, as JSON decodes them) or, for the same
    contents in subclassed containers, through field() and the checking loop."""
    assert _outcome(body) == _outcome(_checking_path(body))
