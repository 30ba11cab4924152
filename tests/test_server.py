"""`rollout-trio serve` as a real subprocess, driven by RemoteEngine (backend "sglang")."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
import trio

from rollout_trio import (
    EngineConnectError,
    EngineServerError,
    EngineTimeoutError,
    GenerationConfig,
    ModelRequest,
    ServerUnavailableError,
    VersionMismatchError,
)
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy

from .conftest_remote import ServeProcess, serve

# Slow enough (4 tokens per chunk, 10 ms between chunks) that long requests are in flight
# when a test pauses or cancels them.
SERVE_ARGS = ("--segment-tokens", "4", "--step-delay", "0.01", "--seed", "0")
LONG = GenerationConfig(max_new_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serve(*SERVE_ARGS) as p:
        yield p


def engine(*addresses: str, **kw) -> RemoteEngine:  # type: ignore[no-untyped-def]
    kw.setdefault("setup_timeout", 20)
    kw.setdefault("seed", 0)
    kw.setdefault("retry", RetryPolicy(attempts=3, backoff_base=0.05, backoff_max=0.2))
    return RemoteEngine(list(addresses), "sglang", **kw)


def prompt() -> list[int]:
    from rollout_trio.models import byte_tokenizer

    tok = byte_tokenizer()
    return tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_serve_protocol_shapes(server: ServeProcess) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] is True and info["weight_version"] == "default"
    r = httpx.post(
        server.url + "/generate",
        json={"input_ids": [1, 2, 3], "rid": "shape-1", "return_logprob": True,
              "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
    )  # fmt: skip
    meta = r.json()["meta_info"]
    assert r.status_code == 200 and meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == r.json()["output_ids"]
    bad = httpx.post(server.url + "/generate", json={"input_ids": [], "sampling_params": {}})
    assert bad.status_code == 400 and "input_ids" in bad.json()["error"]["message"]
    bad = httpx.post(server.url + "/generate", json={"input_ids": [1], "sampling_params": {"min_p": 0.3}})
    assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]
    assert httpx.post(server.url + "/abort_request", json={"rid": "nobody"}).content == b""


async def test_generate_matches_local_engine(server: ServeProcess) -> None:
    from rollout_trio.engines._local import LocalEngine
    from rollout_trio.models import tiny_model

    ids = prompt()
    g = GenerationConfig(max_new_tokens=12, greedy=True)
    with trio.fail_after(30):
        async with engine(server.address) as eng:
            remote = await eng.agenerate(ModelRequest(input_ids=ids, gconfig=g))
        async with LocalEngine(*tiny_model()) as local:
            ref = await local.agenerate(ModelRequest(input_ids=ids, gconfig=g))
    assert remote.output_tokens == ref.output_tokens
    assert remote.stop_reason == ref.stop_reason == "stop"
    assert remote.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)
    assert remote.output_versions == (0,) * remote.output_len
    assert remote.input_tokens == tuple(ids)


async def in_flight(server: ServeProcess, prefix: str) -> int:
    return len([r for r in (await server.astats())["in_flight_rids"] if r.startswith(prefix)])


async def output_tokens(server: ServeProcess) -> int:
    return int((await server.astats()).get("output_tokens", 0))


async def test_cancelled_group_aborts_every_request_on_the_server(server: ServeProcess) -> None:
    rids = [f"group-{i}" for i in range(8)]
    with trio.fail_after(30):
        async with engine(server.address) as eng:
            async with trio.open_nursery() as nursery:
                for rid in rids:
                    nursery.start_soon(eng.agenerate, ModelRequest(input_ids=[1, 2, 3], gconfig=LONG, rid=rid))
                while await in_flight(server, "group-") < 8:  # all running on the server
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            assert all(s.in_flight == 0 for s in eng.servers)
    stats = await server.astats()
    for rid in rids:
        assert any(a.startswith(rid + "-") for a in stats["aborted_rids"]), rid  # the server got its abort
        assert not any(f.startswith(rid + "-") for f in stats["finished_rids"]), rid  # and finished nothing
    assert not any(r.startswith("group-") for r in stats["in_flight_rids"])


async def test_enclosing_deadline_cancels_and_aborts(server: ServeProcess) -> None:
    with trio.fail_after(20):
        async with engine(server.address) as eng:
            with trio.move_on_after(0.3):
                await eng.agenerate(ModelRequest(input_ids=[4, 5], gconfig=LONG, rid="deadline-1"))
    assert any(a.startswith("deadline-1-") for a in (await server.astats())["aborted_rids"])


async def test_attempt_timeout_is_typed_and_each_attempt_aborted(server: ServeProcess) -> None:
    with trio.fail_after(20):
        async with engine(server.address, request_timeout=0.2) as eng:
            with pytest.raises(EngineTimeoutError, match="within 0.2 s") as info:
                await eng.agenerate(ModelRequest(input_ids=[4, 5], gconfig=LONG, rid="slow-1"))
    assert any("gave up after 3 attempts" in n for n in info.value.__notes__)
    aborted = [a for a in (await server.astats())["aborted_rids"] if a.startswith("slow-1-")]
    assert len(aborted) == 3  # one abort per timed-out attempt, each with its own id


async def test_pause_update_continue_versions_per_token(server: ServeProcess, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    from rollout_trio.models import tiny_model

    ckpt = tmp_path_factory.mktemp("ckpt-v1")
    model, tok = tiny_model(seed=1)
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    g = GenerationConfig(max_new_tokens=200, ignore_eos=True)
    with trio.fail_after(40):
        async with engine(server.address) as eng:
            async with trio.open_nursery() as nursery:
                results = []

                async def gen(rid: str) -> None:
                    results.append(await eng.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=g, rid=rid)))

                nursery.start_soon(gen, "upd-a")
                nursery.start_soon(gen, "upd-b")
                while await in_flight(server, "upd-") < 2:
                    await trio.sleep(0.01)
                start = await output_tokens(server)
                while await output_tokens(server) < start + 16:  # a few chunks in
                    await trio.sleep(0.01)
                await eng.update_weights(str(ckpt), 1)
            assert eng.get_version() == 1
            after = await eng.agenerate(
                ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=4, ignore_eos=True))
            )
        async with engine(server.address, version=0, health_interval=3600) as eng1, httpx.AsyncClient() as other:
            assert eng1.get_version() == 1  # adopted from the server at start, not told to it
            # A local user relabels the lone server: it is taken out, the version stays (issue 34 item 3).
            await other.post(server.url + "/update_weight_version", json={"new_version": "5"})
            two = GenerationConfig(max_new_tokens=2, ignore_eos=True)
            with pytest.raises(ServerUnavailableError, match="every server is out of service"):
                await eng1.agenerate(ModelRequest(input_ids=[1], gconfig=two))
            assert eng1.get_version() == 1 and "holds weight version 5, the fleet 1" in str(eng1.servers[0].error)
            await other.post(server.url + "/update_weight_version", json={"new_version": "1"})  # set back
            await eng1.check_fleet()  # back in service: it holds the fleet's version again
            back = await eng1.agenerate(ModelRequest(input_ids=[1], gconfig=two))
            assert back.output_versions == (1, 1) and eng1.servers[0].up
            await other.post(server.url + "/update_weight_version", json={"new_version": "0"})  # stale weights
            with pytest.raises(ServerUnavailableError):
                await eng1.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=2)))
            assert "version 0 for tokens of a segment sent when the fleet was at version 1" in str(eng1.servers[0].error)
    for resp in results:
        assert resp.output_len == 200 and resp.stop_reason == "length"
        v = list(resp.output_versions)
        k = v.index(1)
        assert 0 < k < 200 and v == [0] * k + [1] * (200 - k), v
    assert after.output_versions == (1,) * 4
    assert (await server.astats())["paused"] is None
    async with httpx.AsyncClient() as client:
        assert (await client.get(server.url + "/get_weight_version")).json()["weight_version"] == "0"


async def test_a_second_client_adopts_the_servers_version_and_both_keep_generating(
    server: ServeProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Several trainer processes share servers: B starting after A's update must not
    relabel the server (it told it "0", and A's next request failed with a mismatch)."""
    from rollout_trio.models import tiny_model

    ckpt = tmp_path_factory.mktemp("ckpt-shared")
    model, tok = tiny_model(seed=2)
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    g = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with trio.fail_after(40):
        async with engine(server.address) as a:
            v = a.get_version() + 3
            await a.update_weights(str(ckpt), v)
            async with engine(server.address) as b:  # version=0 by default
                assert b.get_version() == v
                rb = await b.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g))
                ra = await a.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g))
            ra2 = await a.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g))
    assert ra.output_versions == rb.output_versions == ra2.output_versions == (v,) * 4
    async with httpx.AsyncClient() as client:
        assert (await client.get(server.url + "/get_weight_version")).json()["weight_version"] == str(v)


async def test_bad_request_is_not_retried(server: ServeProcess) -> None:
    before = (await server.astats()).get("generate_received", 0)
    with trio.fail_after(20):
        async with engine(server.address) as eng:
            with pytest.raises(EngineServerError, match="frequency_penalty") as info:
                await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(frequency_penalty=0.5)))
    assert info.value.status_code == 400
    assert (await server.astats())["generate_received"] == before + 1


async def test_killed_server_fails_over_and_dead_one_raises_typed_error(server: ServeProcess) -> None:
    victim = ServeProcess(*SERVE_ARGS)
    try:
        label = httpx.get(server.url + "/get_weight_version").json()["weight_version"]
        httpx.post(victim.url + "/update_weight_version", json={"new_version": label})  # servers must agree
        g = GenerationConfig(max_new_tokens=400, ignore_eos=True)
        with trio.fail_after(40):
            async with engine(victim.address, server.address, health_interval=0.2) as eng:
                results = []

                async def gen(i: int) -> None:
                    results.append(await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g, rid=f"kill-{i}")))

                async with trio.open_nursery() as nursery:
                    for i in range(6):
                        nursery.start_soon(gen, i)
                    while (await victim.astats())["in_flight"] < 2:  # some are running on it
                        await trio.sleep(0.01)
                    victim.kill()
                assert len(results) == 6 and all(r.output_len == 400 for r in results)
                down = {s.base_url: s.up for s in eng.servers}
                assert down[victim.url] is False and down[server.url] is True
        with trio.fail_after(20):
            async with engine(server.address) as eng:
                eng.servers[0].base_url = victim.url  # point at the dead port
                with pytest.raises(EngineConnectError):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=g))
    finally:
        victim.stop()


def test_cli_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_trio.cli import main

    assert main([]) == 2 and "a command is required" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0 and "--port-file" in capsys.readouterr().out


def test_serve_reports_a_taken_port(server: ServeProcess) -> None:
    from rollout_trio.cli._serve import serve_main

    port = server.address.rsplit(":", 1)[1]
    assert serve_main(["--port", port, "--segment-tokens", "2"]) == 1


def _serve_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollout_trio.cli._serve", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("port", ["99999", "-1", "65536", "eighty"])
def test_serve_port_outside_the_range_is_a_one_line_usage_error(port: str) -> None:
    done = _serve_cli("--port", port)  # was: 99999 silently listened on 99999 % 65536
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--port" in done.stderr and "0-65535" in done.stderr


def test_serve_refuses_a_non_loopback_bind_without_an_api_key() -> None:
    done = _serve_cli("--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "refusing to bind 0.0.0.0 without an api key" in done.stderr and "--allow-unauthenticated" in done.stderr


async def test_api_key_from_the_environment_and_sigterm_aborts_in_flight_generations() -> None:
    p = ServeProcess(*SERVE_ARGS, env={"ROLLOUT_TRIO_API_KEY": "k3y"})
    try:
        with trio.fail_after(40):
            async with httpx.AsyncClient() as client:
                assert (await client.get(p.url + "/health")).status_code == 200
                assert (await client.get(p.url + "/get_model_info")).status_code == 401
            with pytest.raises(EngineServerError, match="HTTP 401") as info:  # one typed error, never a group
                async with engine(p.address):
                    pass
            assert info.value.status_code == 401
            os.environ["ROLLOUT_TRIO_API_KEY"] = "k3y"  # what RemoteEngine reads without api_key=
            try:
                async with engine(p.address) as eng:
                    assert (await eng.agenerate(ModelRequest(input_ids=[1], gconfig=GenerationConfig(max_new_tokens=1)))).output_len == 1
            finally:
                del os.environ["ROLLOUT_TRIO_API_KEY"]
            async with engine(p.address, api_key="k3y") as eng:
                short = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=3)))
                assert short.output_len > 0
                got: list[httpx.Response] = []

                async def long_request() -> None:
                    async with httpx.AsyncClient(timeout=30, headers={"authorization": "Bearer k3y"}) as c:
                        body = {"rid": "sigterm-1", "input_ids": [1, 2],
                                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
                        got.append(await c.post(p.url + "/generate", json=body))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(long_request)
                    while True:
                        async with httpx.AsyncClient(headers={"authorization": "Bearer k3y"}) as c:
                            stats = (await c.get(p.url + "/stats")).json()
                        if "sigterm-1" in stats["in_flight_rids"] and stats.get("output_tokens", 0) > 0:
                            break
                        await trio.sleep(0.01)
                    p.proc.terminate()
            meta = got[0].json()["meta_info"]
            assert got[0].status_code == 200
            assert meta["finish_reason"] == {"type": "abort", "message": "Abort due to server shutdown"}
            assert 0 < meta["completion_tokens"] < 400
        assert await trio.to_thread.run_sync(p.proc.wait, 20) == 0
    finally:
        p.stop()
