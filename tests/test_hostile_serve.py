"""One client must not hurt the others (issue 34, item 5): Hypercorn's close/send race,
slow readers, websocket upgrades, and a row that cannot be sampled."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio._http import ServerLimits
from rollout_trio._http._serve import _serialize_sends, hypercorn_config
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model

from .conftest_remote import ServeProcess


class _Protocol:
    """What TCPServer calls back when a send fails (Hypercorn's protocol, reduced to a record)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def handle(self, event: Any) -> None:
        self.events.append(event)


def _tcp_server(stream: trio.SocketStream, limits: ServerLimits) -> Any:
    from hypercorn.trio.tcp_server import TCPServer

    _serialize_sends()
    server = TCPServer(None, hypercorn_config(limits, [], graceful_timeout=1.0), None, None, stream)  # type: ignore[arg-type]
    server.protocol = _Protocol()
    return server


async def _stream_pair() -> tuple[trio.SocketStream, socket.socket]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), b


async def test_a_close_racing_a_send_on_one_connection_is_no_busy_resource_error() -> None:
    """Hypercorn's _close sent EOF outside the send lock: a response starting to send
    while the EOF was under way raised BusyResourceError (the answer was lost). Now the
    close waits for the send, and the send, if it comes after, fails as a closed stream."""
    from hypercorn.events import RawData

    stream, peer = await _stream_pair()
    server = _tcp_server(stream, ServerLimits())
    errors: list[BaseException] = []

    async def guarded(fn: Any, *args: Any) -> None:
        try:
            await fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
            errors.append(exc)
            raise

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(guarded, server._close)  # runs first, to send_eof's checkpoint
            nursery.start_soon(guarded, server.protocol_send, RawData(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))
    assert errors == []
    peer.close()


async def test_a_send_under_way_is_finished_before_the_eof() -> None:
    from hypercorn.events import RawData

    stream, peer = await _stream_pair()
    server = _tcp_server(stream, ServerLimits())
    answer = b"x" * 200_000  # more than the socket buffers: the send waits for the reader
    got = bytearray()

    async def read_all() -> None:
        peer.setblocking(False)
        while True:
            await trio.lowlevel.wait_readable(peer)
            data = peer.recv(65536)
            if not data:
                return
            got.extend(data)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.protocol_send, RawData(answer))
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(server._close)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read_all)
    assert bytes(got) == answer  # every byte, then the EOF
    peer.close()


async def test_a_client_that_never_reads_is_cut_after_the_send_deadline(autojump_clock: trio.abc.Clock) -> None:
    from hypercorn.events import Closed, RawData

    stream, peer = await _stream_pair()
    server = _tcp_server(stream, ServerLimits(send_timeout=5.0))
    start = trio.current_time()
    with trio.fail_after(60):
        await server.protocol_send(RawData(b"x" * 10_000_000))
    assert 5.0 <= trio.current_time() - start < 6.0
    assert any(isinstance(e, Closed) for e in server.protocol.events)
    with pytest.raises(trio.ClosedResourceError):
        await stream.send_all(b"more")
    peer.close()


def test_send_timeout_must_be_positive_or_none() -> None:
    assert ServerLimits(send_timeout=None).send_timeout is None
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises((ValueError, TypeError), match="send_timeout"):
            ServerLimits(send_timeout=bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------- websocket upgrades


def _upgrade(port: int, path: str) -> bytes:
    request = (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(request)
        out = b""
        while b"\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out


@pytest.fixture(scope="module")
def serve() -> Any:
    p = ServeProcess("--seed", "0")
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.parametrize("path", ["/generate", "/metrics", "/nowhere"])
def test_a_websocket_upgrade_to_serve_is_a_4xx_and_serve_goes_on(serve: ServeProcess, path: str) -> None:
    port = int(serve.address.rsplit(":", 1)[1])
    answer = _upgrade(port, path)
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:200]
    assert httpx.get(f"http://{serve.address}/health", timeout=20).status_code == 200


async def test_a_websocket_upgrade_to_the_metrics_server_is_a_4xx() -> None:
    from rollout_trio.observe import ExecutorMetrics, open_metrics_server

    with trio.fail_after(30):
        async with open_metrics_server(ExecutorMetrics()) as url:
            port = int(url.rsplit(":", 1)[1])
            answer = await trio.to_thread.run_sync(_upgrade, port, "/metrics")
            async with httpx.AsyncClient() as client:
                assert (await client.get(url + "/metrics")).status_code == 200
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:200]


# --------------------------------------------------------------------- a row that cannot be sampled


async def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    """Every id a stop id, with min_new_tokens: masked, no token is left to draw. That
    request is refused (ValueError naming the field); the rows batched with it go on."""
    model, tok = tiny_model()
    vocab = int(model.get_output_embeddings().weight.shape[0])
    async with LocalEngine(model, tok, seed=0) as engine:
        got: dict[str, Any] = {}

        async def run(rid: str, g: GenerationConfig) -> None:
            got[rid] = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=g, rid=rid))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "healthy", GenerationConfig(max_new_tokens=50, ignore_eos=True))
                while engine.statistics().steps_per_rid.get("healthy", 0) < 2:
                    await trio.sleep(0.005)
                for temperature in (1.0, 0.0):
                    hostile = GenerationConfig(
                        max_new_tokens=5, min_new_tokens=3, stop_token_ids=list(range(vocab)), temperature=temperature
                    )
                    with pytest.raises(ValueError, match="gconfig.stop_token_ids"):
                        await run("hostile", hostile)
        assert got["healthy"].output_len == 50


def test_serve_answers_an_unsampleable_row_with_a_400_and_the_others_with_200(serve: ServeProcess) -> None:
    model, _ = tiny_model()
    vocab = int(model.get_output_embeddings().weight.shape[0])

    async def main() -> dict[str, list[int]]:
        statuses: dict[str, list[int]] = {"good": [], "bad": []}
        async with httpx.AsyncClient(base_url=f"http://{serve.address}", timeout=60) as client:

            async def one(kind: str, k: int) -> None:
                params: dict[str, Any] = {"max_new_tokens": 8, "ignore_eos": True}
                if kind == "bad":
                    params = {"max_new_tokens": 8, "min_new_tokens": 4, "stop_token_ids": list(range(vocab))}
                r = await client.post("/generate", json={"input_ids": [1, 2, k % 50 + 3], "sampling_params": params, "rid": f"{kind}{k}"})
                statuses[kind].append(r.status_code)

            async with trio.open_nursery() as nursery:
                for k in range(24):
                    nursery.start_soon(one, "bad" if k % 3 == 0 else "good", k)
        return statuses

    statuses = trio.run(main)
    assert set(statuses["good"]) == {200}, statuses
    assert set(statuses["bad"]) == {400}, statuses
