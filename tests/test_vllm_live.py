"""RemoteEngine against a real vLLM server named by ROLLOUT_TRIO_VLLM_URL (skipped otherwise).

The server should run with ``--enable-scale-out`` (token-in/token-out endpoint and aborts),
``--logprobs-mode processed_logprobs`` and ``VLLM_SERVER_DEV_MODE=1`` (pause / resume /
weight versions); see docs/remote.md. Token ids 1..3 must be in its vocabulary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine

URL = os.environ.get("ROLLOUT_TRIO_VLLM_URL", "")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not URL, reason="ROLLOUT_TRIO_VLLM_URL is not set: no real vLLM server to test against"),
]

PROMPT = [1, 2, 3]


def engine(**kw) -> RemoteEngine:  # type: ignore[no-untyped-def]
    kw.setdefault("setup_timeout", 60)
    kw.setdefault("vllm_reload_path", None)  # stock vLLM has no reload-from-disk endpoint
    return RemoteEngine(URL, "vllm", seed=0, **kw)


async def test_generate_tito_and_completions_agree_greedy() -> None:
    g = GenerationConfig(max_new_tokens=8, greedy=True, ignore_eos=True)
    with trio.fail_after(120):
        async with engine() as tito:
            assert tito.servers[0].backend.api == "tito"
            a = await tito.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
        async with engine(vllm_api="completions") as comp:
            b = await comp.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
    assert a.output_len == b.output_len == 8 and a.stop_reason == b.stop_reason == "length"
    assert a.output_tokens == b.output_tokens
    assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-3)
    assert all(math.isfinite(x) and x <= 0 for x in a.output_logprobs)
    assert a.output_versions == (0,) * 8


async def test_stop_token_is_reported() -> None:
    with trio.fail_after(120):
        async with engine() as eng:
            first = await eng.agenerate(
                ModelRequest(input_ids=PROMPT, gconfig=GenerationConfig(max_new_tokens=4, greedy=True, ignore_eos=True))
            )
            stop_id = first.output_tokens[1]
            g = GenerationConfig(max_new_tokens=4, greedy=True, ignore_eos=True, stop_token_ids=[stop_id])
            resp = await eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
    assert resp.stop_reason == "stop" and resp.output_tokens[-1] == stop_id


async def metric_samples() -> list[Sample]:
    """Every sample of the server's /metrics, read with prometheus-client's parser."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(URL.rstrip("/") + "/metrics")).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


async def metric(name: str) -> float:
    """Sample ``name`` summed over its labels (engines, models)."""
    return sum(s.value for s in await metric_samples() if s.name == name)


async def finished_counts() -> dict[str, float]:
    """vLLM's counters of finished requests, by reason."""
    out: dict[str, float] = {}
    for s in await metric_samples():
        if s.name == "vllm:request_success_total":
            reason = s.labels["finished_reason"]
            out[reason] = out.get(reason, 0.0) + s.value
    return out


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll the server's state until ``check()`` holds (the caller's deadline bounds it)."""
    while not await check():
        await trio.sleep(0.05)


async def generating_since(tokens_before: float) -> bool:
    """A request runs on the server and has produced a token since ``tokens_before``."""
    return await metric("vllm:num_requests_running") >= 1 and await metric("vllm:generation_tokens_total") > tokens_before


async def test_cancelled_requests_are_aborted_on_the_server() -> None:
    g = GenerationConfig(max_new_tokens=480, ignore_eos=True)
    before = await finished_counts()
    with trio.fail_after(120):
        async with engine(abort_grace=5) as eng:
            with trio.move_on_after(0.15) as scope:
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(
                            eng.agenerate, ModelRequest(input_ids=PROMPT, gconfig=g, rid=f"live-cancel-{i}")
                        )
            assert scope.cancelled_caught

            async def idle() -> bool:
                return await metric("vllm:num_requests_running") == 0 and await metric("vllm:num_requests_waiting") == 0

            await until(idle)  # aborted, or (without the aborts) run to their 480 tokens
            after = await finished_counts()
            resp = await eng.agenerate(
                ModelRequest(input_ids=PROMPT, gconfig=GenerationConfig(max_new_tokens=2, ignore_eos=True))
            )
    assert resp.output_len == 2
    # vLLM counts aborted requests under no reason; at most one new finished request is the
    # start-up probe (a 1-token generation): none of the cancelled requests ran to its end.
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("stop", "length")}
    assert grew["length"] + grew["stop"] <= 1, grew


async def test_pause_relabel_resume_versions_come_from_the_server() -> None:
    async with httpx.AsyncClient() as probe:
        dev = (await probe.get(URL.rstrip("/") + "/is_paused")).status_code == 200
    if not dev:
        pytest.skip("the vLLM server is not in dev mode (VLLM_SERVER_DEV_MODE=1): no /pause, /resume")
    g = GenerationConfig(max_new_tokens=480, ignore_eos=True)
    with trio.fail_after(240):
        async with engine() as eng:
            result = []

            async def gen() -> None:
                result.append(await eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g, rid="live-pause")))

            tokens = await metric("vllm:generation_tokens_total")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen)
                await until(lambda: generating_since(tokens))  # mid-generation on the server
                await eng.update_weights("/unused", 1)  # pause (abort mode), relabel "1", resume
            await eng.update_weights("/unused", 0)  # leave the server as found
    (resp,) = result
    v = list(resp.output_versions)
    assert resp.output_len == 480
    assert v == sorted(v) and set(v) <= {0, 1}
    assert 1 in v  # tokens after the update carry the server's new label


async def test_backend_abort_uses_the_server_side_id() -> None:
    """The abort our backend builds stops a live request (its connection stays open)."""
    from rollout_trio.engines._vllm import VLLMBackend

    backend = VLLMBackend("tito")
    g = GenerationConfig(max_new_tokens=480, ignore_eos=True)
    gen = backend.generate(PROMPT, g, max_new=480, min_new=0, rid="live-abort-id")
    abort = backend.abort("live-abort-id")
    assert abort is not None
    base = URL.rstrip("/")
    result = {}
    with trio.fail_after(60):
        async with httpx.AsyncClient(timeout=60) as client:

            async def run() -> None:
                result["r"] = await client.post(base + gen.path, json=gen.json)

            tokens = await metric("vllm:generation_tokens_total")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                await until(lambda: generating_since(tokens))  # it has produced a token
                r = await client.post(base + abort.path, json=abort.json)
                assert r.status_code == 200
    seg = backend.parse(result["r"].json())
    assert seg.stop_reason == "abort" and 0 < len(seg.tokens) < 480
