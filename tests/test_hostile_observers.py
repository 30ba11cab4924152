"""An observer can never end a run (issue 34, item 4): the metrics server beside a run has
a hard connection cap, and an observer's failure stops that observer alone."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest
import trio

from rollout_trio._http import ServerLimits
from rollout_trio.observe import ExecutorMetrics, open_metrics_server


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


async def test_idle_connections_beyond_the_cap_get_a_503_and_hold_no_descriptor() -> None:
    """200 idle clients against a cap of 16: the server keeps at most 16 (plus those being
    refused), each other one is answered 503 and closed, and once the idle ones go the
    metrics are served again."""
    with trio.fail_after(60):
        async with open_metrics_server(ExecutorMetrics(), connection_cap=16) as url:
            port = int(url.rsplit(":", 1)[1])
            before = _open_fds()
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
            try:
                refused = 0
                for s in idle:
                    s.settimeout(10)
                async def answered(s: socket.socket) -> bytes:
                    return await trio.to_thread.run_sync(lambda: s.recv(4096))
                # The first 16 stay open and silent; every later one is answered 503 and closed.
                for s in idle[16:]:
                    data = await answered(s)
                    assert data.startswith(b"HTTP/1.1 503"), data[:80]
                    refused += 1
                assert refused == 184
                await trio.sleep(0)  # the refused connections are closed by the time they are answered
                assert _open_fds() - before <= 200 + 16 + 8  # the client's 200 + the server's 16 + slack
            finally:
                for s in idle:
                    s.close()
            async with httpx.AsyncClient() as client:
                for _ in range(100):  # the server notices the idle clients left
                    r = await client.get(url + "/metrics")
                    if r.status_code == 200:
                        break
                    await trio.sleep(0.05)
            assert r.status_code == 200 and b"rollout_trio" in r.content


def test_connection_cap_must_be_a_positive_integer_or_none() -> None:
    assert ServerLimits(connection_cap=None).connection_cap is None
    for bad in (0, -3):
        with pytest.raises(ValueError, match="connection_cap"):
            ServerLimits(connection_cap=bad)


async def test_a_failing_loop_lag_watch_is_logged_and_stops_alone(caplog: pytest.LogCaptureFixture) -> None:
    """An observer task that fails once the block runs is logged; the block and the
    metrics server go on."""

    class BrokenGauge:
        def set(self, value: float) -> None:
            raise RuntimeError("observer bug")

    metrics = ExecutorMetrics()
    metrics.loop_lag = BrokenGauge()  # type: ignore[assignment]
    caplog.set_level(logging.ERROR, logger="rollout_trio.observe")
    with trio.fail_after(30):
        async with open_metrics_server(metrics, loop_lag_interval=0.01) as url:
            while not any("loop-lag watch failed" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.01)
            async with httpx.AsyncClient() as client:
                assert (await client.get(url + "/metrics")).status_code == 200
