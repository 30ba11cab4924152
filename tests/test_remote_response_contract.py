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
