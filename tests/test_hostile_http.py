"""Hostile clients against `rollout-trio serve` and the agent endpoint (issue 18).

Every case is a client the servers must survive while serving others: after each one a
healthy request is answered. Traffic stays on loopback; every loop is bounded in count and
every wait by a deadline. One `serve` subprocess serves the module; the cases that end a
server (SIGTERM, the open-file limit) start their own.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio.agents import AgentRolloutWorkflow, OpenAIEndpoint, ServerLimits, serve_app
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.testing import ScriptedEngine

from .agent_helpers import IM_END, TOKENIZER, text_tokens, texts_engine
from .conftest_remote import ROOT, ServeProcess

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    p = ServeProcess("--segment-tokens", "4", "--seed", "0")
    try:
        yield p
    finally:
        p.stop()


def port_of(server: ServeProcess) -> int:
    return int(server.address.rsplit(":", 1)[1])


def exchange(port: int, data: bytes, *, half_close: bool = True, timeout: float = 20.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it.

    Raises:
        AssertionError: the server kept the connection open for ``timeout`` seconds.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed already: the answer is still there to read
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            except TimeoutError:
                raise AssertionError(f"the server kept the connection open; got {out[:200]!r}") from None
            if not chunk:
                return out
            out += chunk


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def assert_serving(server: ServeProcess) -> None:
    """The server is alive and answers a health check and a short generation."""
    assert server.proc.poll() is None, "serve exited"
    assert httpx.get(server.url + "/health", timeout=20).status_code == 200
    r = httpx.post(
        server.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        timeout=30,
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text


# ---------------------------------------------------------------- 1: framing attacks


def test_cut_chunked_body_then_half_close_20_times_does_not_kill_serve(server: ServeProcess) -> None:
    head = b"GET /health HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc"
    for _ in range(20):
        exchange(port_of(server), head)
    assert_serving(server)


def test_cut_chunked_body_with_an_api_key_does_not_kill_serve() -> None:
    with_key = ServeProcess("--api-key", "sekrit")
    try:
        head = b"GET /health HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc"
        for _ in range(20):
            exchange(int(with_key.address.rsplit(":", 1)[1]), head)
        assert with_key.proc.poll() is None
        assert httpx.get(with_key.url + "/health", timeout=20).status_code == 200
    finally:
        with_key.stop()


def test_content_length_plus_chunked_is_a_400_that_closes_the_connection(server: ServeProcess) -> None:
    request = (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
        b"0\r\n\r\n"
    )
    answer = exchange(port_of(server), request, half_close=False)  # closed by the server, not us
    assert status_of(answer) == 400 and b"framed twice" in answer
    assert_serving(server)


def test_a_head_over_16_kib_arriving_whole_is_a_431(server: ServeProcess) -> None:
    request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 40_000 + b"\r\n\r\n"
    answer = exchange(port_of(server), request, half_close=False)
    assert status_of(answer) == 431
    assert_serving(server)


def test_http2_with_60_kb_of_headers_is_refused(server: ServeProcess) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    headers = [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", "x")]
    headers += [(f"x-pad-{i}", os.urandom(500).hex()) for i in range(60)]  # ~60 KB, not compressible
    conn.send_headers(1, headers, end_stream=True)
    statuses: list[str] = []
    ended = False
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=20) as s:
        s.sendall(conn.data_to_send())
        while not ended:  # until the stream is answered or the connection refused or closed
            data = s.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    statuses.append(dict(event.headers)[":status"])
                ended |= isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated))
    assert ended and statuses in ([], ["431"]), statuses
    assert_serving(server)


def test_http2_data_after_the_answer_closes_that_stream_not_serve(server: ServeProcess) -> None:
    """A DATA frame on a stream the server has already answered (a 404 sent before the body
    was read; sglang-router speaks HTTP/2 to its workers) raised KeyError inside Hypercorn
    (its issue 329 / PR 334) and stopped serve: "rollout-trio serve: error: KeyError: 1"."""
    for _ in range(3):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        headers = [(":method", "POST"), (":path", "/no-such-endpoint"), (":scheme", "http"), (":authority", "x"),
                   ("content-type", "application/json")]  # fmt: skip
        conn.send_headers(1, headers, end_stream=False)
        conn.send_data(1, b'{"a": ')
        answered = False
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=20) as s:
            s.sendall(conn.data_to_send())
            while not answered:  # the 404, sent while the body is still open
                data = s.recv(65536)
                assert data, "serve closed the connection without answering"
                for event in conn.receive_data(data):
                    answered |= isinstance(event, h2.events.StreamEnded)
            s.sendall(conn.data_to_send())
            conn.send_data(1, b"1}", end_stream=True)  # the rest of the body, on the answered stream
            s.sendall(conn.data_to_send())
            s.settimeout(2)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, ConnectionError):
                pass
    assert_serving(server)


def test_a_trailing_slash_is_a_404_and_never_a_redirect_to_the_clients_host(server: ServeProcess) -> None:
    r = httpx.get(server.url + "/health/", headers={"host": "evil.example"}, timeout=20, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers


# ---------------------------------------------------------------- 13: 400, never 500


def test_json_nested_100k_deep_is_a_400(server: ServeProcess) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(server.url + "/generate", content=body, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert_serving(server)


def _tiny_checkpoint(path: Path) -> None:
    model, _ = tiny_model()
    model.save_pretrained(path)


def test_truncated_and_pickle_checkpoints_are_a_400(server: ServeProcess, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated"
    _tiny_checkpoint(truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    pickled = tmp_path / "pickled"
    _tiny_checkpoint(pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(  # a pickle weights_only=True refuses to load
        b"\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06getpid\x94\x93\x94)R\x94."
    )
    for directory in (truncated, pickled):
        r = httpx.post(server.url + "/update_weights_from_disk", json={"model_path": str(directory)}, timeout=60)
        assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert_serving(server)


# ---------------------------------------------------------------- 6: unbounded client strings


def test_megabyte_rids_and_version_labels_are_refused_and_not_kept(server: ServeProcess) -> None:
    big = "r" * (1024 * 1024)  # under the body limit: refused by the field's own rule
    r = httpx.post(server.url + "/generate", json={"input_ids": [1], "rid": big, "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    assert len(r.content) < 2000  # the message does not echo the value
    r = httpx.post(server.url + "/abort_request", json={"rid": big}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(server.url + "/update_weight_version", json={"new_version": big}, timeout=30)
    assert r.status_code == 400 and "new_version" in r.json()["error"]["message"]
    stats = httpx.get(server.url + "/stats", timeout=20)
    assert len(stats.content) < 1_000_000
    info = httpx.get(server.url + "/get_model_info", timeout=20).json()
    assert len(info["weight_version"]) <= 128
    assert_serving(server)


# ---------------------------------------------------------------- 4: big bodies


def test_a_15_mib_body_is_refused_from_its_head_under_the_default_limit(server: ServeProcess) -> None:
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    answer = exchange(port_of(server), head % (15 * 1024 * 1024), half_close=False)  # no body sent at all
    assert status_of(answer) == 413
    assert_serving(server)


def test_expect_100_continue_with_an_oversized_body_ends_in_413_without_the_body(server: ServeProcess) -> None:
    """A client waiting for ``100 Continue`` is told 413 and the connection closes: it need not
    send its body. (Hypercorn may send the ``100`` before the app has read the head; RFC 9110
    allows a final status after it, and the body is never read.)"""
    head = (
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n"
    )
    answer = exchange(port_of(server), head % (15 * 1024 * 1024), half_close=False)  # no body sent at all
    if status_of(answer) == 100:  # the informational answer's head, then the final one
        answer = answer[answer.index(b"\r\n\r\n") + 4 :]
    assert status_of(answer) == 413
    assert b"max_body_bytes" in answer
    assert_serving(server)


# ---------------------------------------------------------------- 2: one request's values


def test_hostile_sampling_values_never_fail_another_request(server: ServeProcess) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            got: dict[str, httpx.Response] = {}

            async def healthy() -> None:
                got["healthy"] = await client.post("/generate", json={
                    "input_ids": [1, 2, 3], "rid": "healthy",
                    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0},
                })  # fmt: skip

            with trio.fail_after(100):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(healthy)
                    while "healthy" not in (await client.get("/stats")).json()["in_flight_rids"]:
                        await trio.sleep(0.01)
                    for i in range(5):  # each shares decode steps with the healthy request
                        for sp in ({"top_p": 1e-300}, {"top_p": 5e-324, "top_k": 3}):
                            r = await client.post("/generate", json={
                                "input_ids": [4, 5], "rid": f"hostile-{i}-{len(sp)}",
                                "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, **sp},
                            })  # fmt: skip
                            assert r.status_code in (200, 400), r.text
            assert got["healthy"].status_code == 200, got["healthy"].text
            assert got["healthy"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 400}

    trio.run(main)


async def test_a_tiny_temperature_or_top_p_never_fails_another_row_of_the_batch() -> None:
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        got: dict[str, Any] = {}

        async def run(rid: str, g: GenerationConfig) -> None:
            got[rid] = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=g, rid=rid))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "healthy", GenerationConfig(max_new_tokens=300, ignore_eos=True))
                while engine.statistics().steps_per_rid.get("healthy", 0) < 2:
                    await trio.sleep(0.005)
                for g in (
                    GenerationConfig(max_new_tokens=5, ignore_eos=True, top_p=1e-300),
                    GenerationConfig(max_new_tokens=5, ignore_eos=True, temperature=1e-300),
                    GenerationConfig(max_new_tokens=5, ignore_eos=True, temperature=1e300),
                ):
                    await run("hostile", g)
                    assert got["hostile"].output_len == 5
        assert got["healthy"].output_len == 300


# ---------------------------------------------------------------- 3: SIGTERM


def test_sigterm_exits_while_a_client_leaves_large_answers_unread() -> None:
    p = ServeProcess("--graceful-timeout", "1")
    port = int(p.address.rsplit(":", 1)[1])
    try:
        # 2,700 aborts of 256-character rids make /stats about 700 KB (900 per connection:
        # Hypercorn closes a connection after 1,000 requests) ...
        for part in range(3):
            aborts = b"".join(
                b"POST /abort_request HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
                for body in (json.dumps({"rid": f"{part}{i:0255d}"}).encode() for i in range(900))
            )
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(aborts)
                answers = b""
                while answers.count(b"HTTP/1.1 200") < 900:  # bounded by the socket's timeout
                    chunk = s.recv(1 << 20)
                    assert chunk, "serve closed the connection before answering every abort"
                    answers += chunk
        assert len(httpx.get(p.url + "/stats", timeout=20).content) > 400_000
        # ... and 60 of them pipelined, never read, leave ~30 MB of answers waiting to be sent.
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect(("127.0.0.1", port))
        reader.sendall(b"GET /stats HTTP/1.1\r\nhost: x\r\n\r\n" * 60)
        p.proc.send_signal(signal.SIGTERM)
        try:
            code = p.proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError("serve did not exit within 30 s of SIGTERM") from None
        finally:
            reader.close()
        assert code == 0
    finally:
        p.stop()


# ---------------------------------------------------------------- the access log


ACCESS = re.compile(r" rollout_trio\.server\.access INFO (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) \d+\.\d ms \(127\.0\.0\.1:\d+\)$")


def test_log_level_info_writes_one_access_line_per_request() -> None:
    """Hypercorn's own access log writes a request twice when its client closes at once
    (hypercorn issue 357: a second line with "- -"); ours writes each request once."""
    p = ServeProcess("--log-level", "INFO")
    port = port_of(p)
    expected: list[tuple[str, str, str]] = []
    try:
        for _ in range(15):  # clients that close as soon as they have sent: the racing case
            answer = exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            expected.append(("GET", "/health", str(status_of(answer))))
        for path in ("/health", "/stats", "/nowhere"):
            with httpx.Client(timeout=20) as client:
                expected.append(("GET", path, str(client.get(p.url + path).status_code)))
        r = httpx.post(p.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        expected.append(("POST", "/generate", str(r.status_code)))
        p.proc.terminate()
        p.proc.wait(30)
        log = p.proc.stderr.read()  # type: ignore[union-attr]
    finally:
        p.stop()
    lines = [line for line in log.splitlines() if "access" in line]
    assert len(lines) == len(expected), "\n".join(lines)
    found = [ACCESS.search(line) for line in lines]
    assert None not in found, "\n".join(lines)
    assert sorted((m["method"], m["path"], m["status"]) for m in found if m) == sorted(expected)


# ---------------------------------------------------------------- 7: the open-file limit


def _low_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_out_of_file_descriptors_new_clients_get_a_503_and_health_recovers() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_trio.cli._serve", "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, env=env, text=True,
        preexec_fn=_low_file_limit,
    )  # fmt: skip
    held: list[socket.socket] = []
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        for _ in range(300):  # more idle connections than the server has descriptors
            s = socket.create_connection(("127.0.0.1", port), timeout=20)
            held.append(s)
        answer = exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", half_close=False)
        assert status_of(answer) == 503 and b"RLIMIT_NOFILE" in answer
        for s in held:
            s.close()
        held.clear()
        while True:  # descriptors free as the server sees the closes
            answer = exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", half_close=False)
            if status_of(answer) != 503:
                break
        assert status_of(answer) == 200
        assert proc.poll() is None
    finally:
        for s in held:
            s.close()
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()  # type: ignore[union-attr]


# ---------------------------------------------------------------- the agent endpoint


def _client(app: Any, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://agent", headers={"authorization": f"Bearer {key}"}
    )


async def test_endpoint_lone_surrogate_and_deep_json_are_a_400() -> None:
    ep = OpenAIEndpoint(texts_engine(["fine"]))
    with ep.session() as s:
        async with _client(ep.app, s.key) as c:
            r = await c.post(CHAT, content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
            r = await c.post(CHAT, content=b"[" * 100_000 + b"]" * 100_000)
            assert r.status_code == 400, r.text
            r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine"


class CountingTokenizer:
    """The byte tokenizer, counting decodes and chat templating."""

    def __init__(self) -> None:
        self.decodes = 0
        self.templated = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(TOKENIZER, name)

    def decode(self, *args: Any, **kw: Any) -> Any:
        self.decodes += 1
        return TOKENIZER.decode(*args, **kw)

    def apply_chat_template(self, *args: Any, **kw: Any) -> Any:
        self.templated += 1
        return TOKENIZER.apply_chat_template(*args, **kw)


async def test_endpoint_stop_strings_reach_the_engine_and_are_found_in_few_decodes() -> None:
    text = "x" * 4000 + "STOP" + "y" * 50
    seen: list[Any] = []

    def script(req: ModelRequest) -> Any:
        from rollout_trio import ModelResponse

        seen.append(req.gconfig.stop)
        out = [*text_tokens(text), IM_END]
        return ModelResponse(
            input_tokens=req.input_ids, output_tokens=out, output_logprobs=[-0.5] * len(out),
            output_versions=[0] * len(out), stop_reason="stop",
        )  # fmt: skip

    tok = CountingTokenizer()
    ep = OpenAIEndpoint(ScriptedEngine(script), tok)
    with ep.session() as s:
        async with _client(ep.app, s.key) as c:
            with trio.fail_after(60):
                r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "go"}], "stop": ["STOP"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "x" * 4000
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert seen and all(tuple(stop or ()) == ("STOP",) for stop in seen)
    assert tok.decodes <= 20  # bisection, not one decode per prefix (4,000 of them)
    (inter,) = s.interactions.values()
    assert inter.model_response.output_len == 4004  # up to the token completing "STOP" (4 byte tokens)


async def test_endpoint_refuses_a_7_mib_message_before_tokenizing_it() -> None:
    tok = CountingTokenizer()
    ep = OpenAIEndpoint(texts_engine(["never"]), tok)
    with ep.session() as s:
        async with _client(ep.app, s.key) as c:
            with trio.fail_after(60):
                r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "z" * (7 * 1024 * 1024)}]})
    assert r.status_code == 400 and "max_prompt_chars" in r.json()["error"]["message"], r.text
    assert tok.templated == 0


async def test_the_workflows_endpoint_cache_keeps_no_engine_alive() -> None:
    class Agent:
        async def run(self, data: Any, **kw: Any) -> float:
            return 1.0

    workflow = AgentRolloutWorkflow(Agent(), tokenizer=TOKENIZER)
    engine = texts_engine([])
    workflow.endpoint(engine)
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None


async def test_a_read_timeout_of_half_a_second_closes_a_silent_connection() -> None:
    ep = OpenAIEndpoint(texts_engine([]))
    async with trio.open_nursery() as nursery:
        base = await nursery.start(partial_serve(ep.app, ServerLimits(read_timeout=0.5)))
        port = int(base.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        with ep.session() as s:  # a request whose body stops coming (the endpoint's own deadline is 60 s)
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                b"content-length: 100\r\n\r\n{\"messages\"" % s.key.encode()
            )
        with trio.fail_after(20):
            while await stream.receive_some(4096):
                pass
        await stream.aclose()
        nursery.cancel_scope.cancel()


def partial_serve(app: Any, limits: ServerLimits) -> Any:
    async def run(*, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_app(app, "127.0.0.1", 0, limits=limits, task_status=task_status)

    return run


async def test_the_served_endpoint_survives_cut_chunked_bodies() -> None:
    ep = OpenAIEndpoint(texts_engine(["still here"]))
    async with trio.open_nursery() as nursery:
        base = await nursery.start(partial_serve(ep.app, ServerLimits()))
        port = int(base.rsplit(":", 1)[1])
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc"
        for _ in range(20):
            await trio.to_thread.run_sync(exchange, port, head)
        with ep.session() as s:
            async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {s.key}"}) as c:
                r = await c.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "still here"
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- layering


def test_import_rollout_trio_loads_neither_starlette_nor_hypercorn() -> None:
    code = "import sys, rollout_trio; print(sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'hypercorn')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_workflow_module_does_not_import_agents() -> None:
    source = (Path(ROOT) / "rollout_trio" / "_workflow.py").read_text()
    imported = [
        node.module or "" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
    ] + [alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for alias in node.names]
    assert not [m for m in imported if "agents" in m]


def test_hypercorn_is_pinned_below_its_next_minor_version() -> None:
    pyproject = (Path(ROOT) / "pyproject.toml").read_text()
    (line,) = [x for x in pyproject.splitlines() if x.strip().startswith('"hypercorn')]
    assert "<" in line
