"""RemoteEngine against a real vLLM server: the one ROLLOUT_TRIO_VLLM_URL names, else one
started here from bench/.vllm-venv (``python -m bench.vllm_env`` builds it; .ci/run does) on a
tiny model saved from a config; skipped when neither is there.

The server should run with ``--enable-scale-out`` (token-in/token-out endpoint and aborts),
``--logprobs-mode processed_logprobs`` and ``VLLM_SERVER_DEV_MODE=1`` (pause / resume /
weight versions / ``/collective_rpc``); see docs/remote.md. Token ids 1..3 must be in its
vocabulary, and its ``--max-model-len`` at least 16,004 (the abort tests' requests). The tests that reload checkpoints,
and kill and restart the server, need the server started here.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio.engines import ConnectionLimits, RemoteEngine, TrioTransport

from .vllm_server import SKIP_REASON, VLLMServer
from .vllm_server import available as vllm_available

URL = ""  # set by the fixture below, from the session's server

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason=SKIP_REASON)]


@pytest.fixture(scope="module", autouse=True)
def _url(vllm_url: str) -> None:
    global URL
    URL = vllm_url


@pytest.fixture
def server(vllm_server: VLLMServer | None) -> VLLMServer | None:
    return vllm_server


@pytest.fixture
def checkpoints(vllm_checkpoints: tuple[Path, Path]) -> tuple[Path, Path]:
    return vllm_checkpoints


PROMPT = [1, 2, 3]
# Long enough that a request is still running when the test acts on it (about 2 s on an
# AMD EPYC core, under 1 s on a Xeon with AMX).
LONG = 2000
# For the abort tests: long enough (seconds unaborted) that an abort lands first even on a
# loaded machine, and that vLLM's request gauges (refreshed every VLLM_LOG_STATS_INTERVAL,
# 0.5 s on the server started here) show the server holding the requests before the test
# cancels them.
LONGEST = 16000  # within the test server's --max-model-len (tests/vllm_server.py, MAX_MODEL_LEN)


def engine(**kw) -> RemoteEngine:  # type: ignore[no-untyped-def]
    kw.setdefault("setup_timeout", 60)
    kw.setdefault("vllm_reload_path", None)  # stock vLLM has no reload-from-disk endpoint
    return RemoteEngine(URL, "vllm", seed=0, **kw)


def keeping_engine(**kw) -> RemoteEngine:  # type: ignore[no-untyped-def]
    """An engine whose idle connections stay in its pool for 50 s (the test server keeps them 60 s)."""
    return engine(transport=TrioTransport(limits=ConnectionLimits(keepalive_expiry=50)), **kw)


async def open_spare_connections(eng: RemoteEngine, n: int) -> None:
    """Leave ``n`` idle connections to the server in ``eng``'s pool: ``n`` one-token requests at
    once. A starved vLLM CPU server often accepts a *new* connection only once the batch it
    decodes ends, and answers on one it accepted before within milliseconds (measured; see
    ROUNDS): the engine's aborts and updates then go over these."""
    g = GenerationConfig(max_new_tokens=1, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(eng.agenerate, ModelRequest(input_ids=PROMPT, gconfig=g))


async def counted(polls: httpx.AsyncClient, first: dict[str, float], n: int) -> dict[str, float]:
    """The finished counters once they count ``n`` more ended requests than ``first`` (the server
    may answer a request before it counts it; the caller's deadline bounds the wait)."""
    while _ended(first, now := await finished_counts(polls)) < n:
        await trio.sleep(0.05)
    return now


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


async def metric_samples(client: httpx.AsyncClient) -> list[Sample]:
    """Every sample of the server's /metrics, read with prometheus-client's parser. A kept-alive
    connection the server closed as it was reused (uvicorn drops idle ones after 5 s) is
    retried once on a new one."""
    try:
        text = (await client.get(URL.rstrip("/") + "/metrics")).text
    except httpx.RemoteProtocolError:
        text = (await client.get(URL.rstrip("/") + "/metrics")).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """Sample ``name`` summed over its labels (engines, models)."""
    return sum(s.value for s in await metric_samples(client) if s.name == name)


async def finished_counts(client: httpx.AsyncClient) -> dict[str, float]:
    """vLLM's counters of finished requests, by reason."""
    out: dict[str, float] = {}
    for s in await metric_samples(client):
        if s.name == "vllm:request_success_total":
            reason = s.labels["finished_reason"]
            out[reason] = out.get(reason, 0.0) + s.value
    return out


async def until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll the server's state until ``check()`` holds (the caller's deadline bounds it)."""
    while not await check():
        await trio.sleep(0.05)


async def until_idle(polls: httpx.AsyncClient) -> None:
    """Poll until the server holds no request, running or waiting (the caller's deadline bounds it)."""

    async def idle() -> bool:
        running = await metric(polls, "vllm:num_requests_running")
        return running == 0 and await metric(polls, "vllm:num_requests_waiting") == 0

    await until(idle)


# Measured on vLLM 0.32's CPU build on 2 cores: while a batch decodes, a new connection to the
# server (a /metrics poll, curl, or the engine's abort) often waits until the batch ends, while a
# connection opened before usually answers in 5 ms (not always, under a CPU hog). So the polls keep
# one connection, and a round is judged only when every abort was answered in time (else no abort
# reached the server, and the round says nothing about ours). Up to ROUNDS run.
ROUNDS = 5


def _ended(before: dict[str, float], now: dict[str, float]) -> float:
    """How many requests ran to their end (a stop or their length) between two readings."""
    return sum(now.get(k, 0.0) - before.get(k, 0.0) for k in ("stop", "length"))


async def _cancel_round(
    eng: RemoteEngine, polls: httpx.AsyncClient, attempt: int, before: dict[str, float]
) -> tuple[bool, float]:
    """Start 4 long requests and cancel them once the server holds all four; wait until it is
    idle. Returns whether the server was seen holding them, and how many requests had run to
    their end since ``before`` when the last abort was answered (read on ``polls`` right after
    it: the server counts a request's end as it answers it, in the process that answers the
    aborts)."""
    g = GenerationConfig(max_new_tokens=LONGEST, ignore_eos=True)
    seen = False
    async with trio.open_nursery() as nursery:

        async def four() -> None:
            async with trio.open_nursery() as inner:
                for i in range(4):
                    req = ModelRequest(input_ids=PROMPT, gconfig=g, rid=f"live-cancel-{attempt}-{i}")
                    inner.start_soon(eng.agenerate, req)
            nursery.cancel_scope.cancel()  # they ended unobserved

        nursery.start_soon(four)
        # Cancel once the server holds all four (its state, not a guess at timing).
        while True:
            running = await metric(polls, "vllm:num_requests_running")
            if running + await metric(polls, "vllm:num_requests_waiting") >= 4:
                seen = True
                nursery.cancel_scope.cancel()
                break
            await trio.sleep(0.05)
    # The nursery ends once every abort was answered (or given up on after abort_grace).
    ended_before_aborts = _ended(before, await finished_counts(polls))
    await until_idle(polls)  # aborted, or (without the aborts) run to their LONGEST tokens
    return seen, ended_before_aborts


async def test_cancelled_requests_are_aborted_on_the_server(caplog: pytest.LogCaptureFixture) -> None:
    """A round is judged when the server was seen holding the 4 requests, every abort was
    answered within ``abort_grace`` (the engine logs one it gave up on), and none of the
    requests had ended by then (a starved server may take a new connection only once its batch
    is done): then none of them may run to its end afterwards."""
    with trio.fail_after(60 * ROUNDS):
        async with keeping_engine(abort_grace=5) as eng, httpx.AsyncClient(
            timeout=60, limits=httpx.Limits(keepalive_expiry=3)  # dropped before uvicorn's 5 s
        ) as polls:
            for attempt in range(ROUNDS):
                caplog.clear()
                first = await finished_counts(polls)
                await open_spare_connections(eng, 8)  # 4 for the requests, 4 for their aborts
                before = await counted(polls, first, 8)  # the 8 ran to their length
                seen, ended_first = await _cancel_round(eng, polls, attempt, before)
                after = await finished_counts(polls)
                unanswered = [r.getMessage() for r in caplog.records if r.getMessage().startswith("abort of ")]
                if seen and not unanswered and ended_first == 0:
                    break
            else:
                pytest.skip(
                    f"in {ROUNDS} rounds the server never answered every abort within abort_grace, before any"
                    " of the 4 requests it held had ended (a vLLM CPU server starved on a small machine)"
                )
            resp = await eng.agenerate(
                ModelRequest(input_ids=PROMPT, gconfig=GenerationConfig(max_new_tokens=2, ignore_eos=True))
            )
    assert resp.output_len == 2
    # vLLM counts aborted requests under no reason: none of the cancelled requests ran to its end.
    assert _ended(before, after) == 0, (attempt, before, after)


async def test_pause_relabel_resume_versions_come_from_the_server() -> None:
    """A request still running when the update (pause, relabel "1", resume) returns was on
    the server when the pause came, or reached it after the resume: either way its later
    tokens carry "1". One that finished first says nothing about the labels (a starved
    server may answer the pause only after the request ended): a skip."""
    async with httpx.AsyncClient() as probe:
        dev = (await probe.get(URL.rstrip("/") + "/is_paused")).status_code == 200
    if not dev:
        pytest.skip("the vLLM server is not in dev mode (VLLM_SERVER_DEV_MODE=1): no /pause, /resume")
    g = GenerationConfig(max_new_tokens=LONG, ignore_eos=True)
    with trio.fail_after(240):
        async with keeping_engine() as eng:
            await open_spare_connections(eng, 2)  # one for the request, one for the update's calls
            result = []

            async def gen() -> None:
                result.append(await eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g, rid="live-pause")))

            async def sent() -> bool:
                # On the server, or already done: on a starved machine the first poll can
                # come after the whole request (measured: 0.7 s late, under stress-ng),
                # and waiting for an in-flight count that never comes would hang the test.
                await trio.lowlevel.checkpoint()
                return bool(result) or eng.servers[0].in_flight >= 1

            async with trio.open_nursery() as nursery:
                nursery.start_soon(gen)
                await until(sent)  # on the server (the update then cuts it, or holds it paused)
                await eng.update_weights("/unused", 1)  # pause (abort mode), relabel "1", resume
                judged = not result  # still running when the update returned
            await eng.update_weights("/unused", 0)  # leave the server as found
    (resp,) = result
    v = list(resp.output_versions)
    assert resp.output_len == LONG
    assert v == sorted(v) and set(v) <= {0, 1}
    if not judged:
        pytest.skip("the request finished before the update returned (a starved server): its labels say nothing")
    assert 1 in v  # tokens after the update carry the server's new label


#: How long the abort is repeated on the paused server before it is resumed. With the right id
#: the request answers as soon as it is queued (measured: at the first abort); only a wrong id
#: waits this out, and then fails.
ABORT_WINDOW_S = 20


async def test_backend_abort_uses_the_server_side_id() -> None:
    """The abort our backend builds stops the request it names (its connection stays open).

    Judged on a paused server (``/pause?mode=keep``): a request sent meanwhile waits in the
    scheduler, and the server, decoding nothing, answers at once. While a tiny model decodes,
    vLLM's API server may answer no other request (not even on a connection opened before)
    until the batch ends, so an abort aimed at a running request could not be timed. The
    abort is repeated until the request answers, which with the right id it does, aborted,
    as soon as it is queued (an abort that comes first is a no-op); then the server resumes.
    With a wrong id the request never answers while paused, runs to its LONGEST tokens after
    the resume, and the test fails."""
    from rollout_trio.engines._remote_wire import HttpCall
    from rollout_trio.engines._vllm import VLLMBackend

    base = URL.rstrip("/")
    async with httpx.AsyncClient() as probe:
        if (await probe.get(base + "/is_paused")).status_code != 200:
            pytest.skip("the vLLM server is not in dev mode (VLLM_SERVER_DEV_MODE=1): no /pause, /resume")
    backend = VLLMBackend("tito")
    gen = backend.generate(PROMPT, GenerationConfig(max_new_tokens=LONGEST, ignore_eos=True), max_new=LONGEST, min_new=0, rid="live-abort-id")
    abort = backend.abort("live-abort-id")
    assert abort is not None
    result: dict[str, httpx.Response] = {}
    aborts = 0
    with trio.fail_after(ABORT_WINDOW_S + 120):
        async with httpx.AsyncClient(timeout=120) as client, httpx.AsyncClient(timeout=60) as control:
            await until_idle(control)  # nothing else is queued or running

            async def run(call: HttpCall) -> None:
                result["r"] = await client.post(base + call.path, json=call.json)

            assert (await control.post(base + "/pause", params={"mode": "keep"})).status_code == 200
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, gen)
                try:
                    with trio.move_on_after(ABORT_WINDOW_S):
                        while "r" not in result:  # polls the request's state, not the clock
                            assert (await control.post(base + abort.path, json=abort.json)).status_code == 200
                            aborts += 1
                            await trio.sleep(0.1)
                    answered_paused = "r" in result
                finally:  # resumed before the request is awaited, and left as found whatever happened
                    with trio.CancelScope(shield=True):
                        assert (await control.post(base + "/resume")).status_code == 200
    seg = backend.parse(result["r"].json())
    assert (answered_paused, seg.stop_reason, len(seg.tokens)) == (True, "abort", 0), aborts


# ------------------------------------------------------------- weights, and a server that dies


GREEDY = GenerationConfig(max_new_tokens=6, greedy=True, ignore_eos=True)


async def answer(eng: RemoteEngine) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    resp = await eng.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GREEDY))
    return resp.output_tokens, resp.output_logprobs, resp.output_versions


async def test_update_weights_loads_the_checkpoint_into_the_running_server(server, checkpoints) -> None:
    """The default reload (/collective_rpc reload_weights) loads the weights in place: the
    greedy answer is the new weights' one, labelled with the new version, and loading the
    base checkpoint again gives the first answer back exactly."""
    if server is None:
        pytest.skip("the server named by ROLLOUT_TRIO_VLLM_URL may not serve this test's checkpoints")
    base, other = checkpoints
    with trio.fail_after(300):
        async with RemoteEngine(URL, "vllm", seed=0, setup_timeout=60) as eng:
            v = eng.get_version()
            tokens, logprobs, _ = await answer(eng)
            await eng.update_weights(str(other), v + 1)
            moved = await answer(eng)
            await eng.update_weights(str(base), v + 2)
            back = await answer(eng)
            await eng.update_weights(str(base), 0)  # leave the server as found
    assert moved[0] != tokens  # other weights answer otherwise
    assert moved[2] == (v + 1,) * len(moved[0])
    assert back[0] == tokens and back[1] == pytest.approx(logprobs, abs=1e-5)
    assert back[2] == (v + 2,) * len(tokens)


async def test_a_killed_and_restarted_server_gets_the_fleets_weights_before_it_serves(server, checkpoints) -> None:
    """The issue's finding on vLLM 0.32: a server killed and restarted mid-run came back on
    its base weights and was only relabelled. Here it is reloaded with the fleet's last
    checkpoint before it serves: its answers are that checkpoint's, under its version."""
    if server is None:
        pytest.skip("this test kills and restarts the server: it needs the one started here")
    base, other = checkpoints
    with trio.fail_after(900):
        async with RemoteEngine(URL, "vllm", seed=0, setup_timeout=60, health_interval=3600) as eng:
            v = eng.get_version()
            await eng.update_weights(str(other), v + 1)
            before = await answer(eng)
            server.kill()
            await eng.check_fleet()
            assert not eng.servers[0].up  # dead: out of service
            await trio.to_thread.run_sync(server.start)  # on its base weights, labelled "default"
            while not eng.servers[0].up:
                await eng.check_fleet()
                await trio.sleep(0.5)
            after = await answer(eng)
            await eng.update_weights(str(base), 0)  # leave the server as found
    assert after[0] == before[0] and after[1] == pytest.approx(before[1], abs=1e-5)
    assert after[2] == (v + 1,) * len(after[0])
