"""Helpers for the RemoteEngine and server tests: a `rollout-trio serve` subprocess and a
scriptable in-process HTTP server that can misbehave (cut bodies short, stall, etc.)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import h11
import httpx
import trio

from .warm_cli import WarmPopen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServeProcess:
    """`python -m rollout_trio.cli._serve --port 0 ...` as a subprocess (forked from the warm
    CLI, tests/warm_cli.py)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        self.proc = WarmPopen(
            [sys.executable, "-m", "rollout_trio.cli._serve", "--port", "0", "--threads", "1", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if "listening on" in line or not line:
                break
        if "listening on" not in line:
            self.proc.kill()
            err = self.proc.stderr.read()  # type: ignore[union-attr]
            raise RuntimeError(f"serve did not start: {line!r} {err[-2000:]}")
        self.url = line.split("listening on ")[1].split()[0]
        self.address = self.url.removeprefix("http://")

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", timeout=10).json()

    async def astats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=10) as client:
            return (await client.get(self.url + "/stats")).json()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def serve(*args: str) -> Iterator[ServeProcess]:
    """A `rollout-trio serve` subprocess for the duration of the block."""
    p = ServeProcess(*args)
    try:
        yield p
    finally:
        p.stop()


class Raw:
    """Bytes to write verbatim, then close the connection (a broken answer)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


Reply = tuple[int, Any] | Raw
Script = Callable[[str, str, Any], Awaitable[Reply]]


def sglang_body(tokens: list[int], finish: str = "length", *, version: str = "default", message: str = "") -> dict:
    """An SGLang /generate answer."""
    fr: dict[str, Any] = {"type": finish}
    if finish == "abort":
        fr["message"] = message
    return {
        "text": "",
        "output_ids": tokens,
        "meta_info": {
            "id": "x",
            "finish_reason": fr,
            "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in tokens],
        },
    }


class FakeServer:
    """An in-process HTTP/1.1 server on loopback whose answers a test scripts.

    ``script(method, path, json_body)`` returns ``(status, json_or_bytes)`` or a
    :class:`Raw`. Every request is logged in ``self.log`` as ``(path, body)``.
    """

    def __init__(self, script: Script) -> None:
        self.script = script
        self.log: list[tuple[str, Any]] = []
        self.port = 0
        self.connections = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def paths(self, path: str) -> list[Any]:
        return [b for p, b in self.log if p == path]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._conn, listeners)

    async def _conn(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while True:
                    head = None
                    body = b""
                    while True:
                        ev = conn.next_event()
                        if ev is h11.NEED_DATA:
                            data = await stream.receive_some(65536)
                            conn.receive_data(data)
                            continue
                        if isinstance(ev, h11.Request):
                            head = ev
                        elif isinstance(ev, h11.Data):
                            body += ev.data
                        elif isinstance(ev, h11.EndOfMessage):
                            break
                        else:
                            return
                    assert head is not None
                    path = head.target.decode().split("?")[0]
                    payload = json.loads(body) if body.strip() else None
                    self.log.append((path, payload))
                    reply = await self.script(head.method.decode(), path, payload)
                    if isinstance(reply, Raw):
                        await stream.send_all(reply.data)
                        return
                    status, obj = reply
                    content = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                    out = conn.send(h11.Response(status_code=status, headers=[("content-length", str(len(content)))]))
                    out += conn.send(h11.Data(data=content)) if content else b""
                    out += conn.send(h11.EndOfMessage())
                    await stream.send_all(out)
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, h11.ProtocolError, trio.ClosedResourceError):
                return


async def default_reply(method: str, path: str, body: Any) -> Reply:
    """Answers for the control endpoints every fake needs."""
    if path == "/health":
        return 200, b""
    if path in ("/update_weight_version", "/pause_generation", "/continue_generation", "/update_weights_from_disk"):
        return 200, {"success": True, "status": "ok"}
    if path == "/abort_request":
        return 200, b""
    return 404, {"error": {"message": f"no {path}"}}
