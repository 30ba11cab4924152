"""Requests per second: RemoteEngine vs a bare httpx loop vs aiohttp, one loopback server.

    .venv/bin/python bench/remote_bench.py [--seconds 2] [--repeats 3] [--concurrency 1 16 128]

A subprocess serves a fixed SGLang-shaped ``/generate`` answer at once (a raw asyncio
protocol server, so the server is not what is measured). Each client runs for
``--seconds`` at each concurrency, ``--repeats`` times, interleaved; the medians and the
ratios to aiohttp are printed. Columns:

* ``remote``: ``RemoteEngine.agenerate`` (sglang backend, one HTTP request per call),
  on Trio, with its own transport;
* ``transport``: the same request sent straight to ``TrioTransport.handle_async_request``
  (body read, no JSON decoding): the transport's own cost, a ceiling for ``remote``;
* ``httpx``: ``httpx.AsyncClient.post`` + ``.json()`` on Trio with httpx's default
  transport (httpcore's pool);
* ``aiohttp``: ``aiohttp.ClientSession.post`` + ``.json()`` on asyncio (the client AReaL
  uses; skipped with a message if aiohttp is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The fixed-answer loopback server (and its body) that python -m bench serves too.
from bench.work import serve_fixed as serve  # noqa: E402

PAYLOAD = {"rid": "x", "input_ids": list(range(8)), "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}


# --------------------------------------------------------------------------- server


# --------------------------------------------------------------------------- clients


def _rate(count: int, elapsed: float) -> float:
    return count / elapsed


async def _drive(op: Callable[[], Awaitable[object]], conc: int, seconds: float) -> float:
    """Requests/s of ``conc`` Trio tasks calling ``op`` back to back for ``seconds``."""
    import trio

    count = 0
    end = trio.current_time() + seconds

    async def worker() -> None:
        nonlocal count
        while trio.current_time() < end:
            await op()
            count += 1

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(conc):
            nursery.start_soon(worker)
    return _rate(count, time.perf_counter() - t0)


def bench_remote(url: str, conc: int, seconds: float) -> float:
    import trio

    from rollout_trio import GenerationConfig, ModelRequest
    from rollout_trio.engines import RemoteEngine

    req = ModelRequest(input_ids=list(range(8)), gconfig=GenerationConfig(max_new_tokens=16), rid="bench")

    async def main() -> float:
        async with RemoteEngine(url, "sglang", affinity_size=0, verify_versions=False) as eng:

            async def op() -> None:
                await eng.agenerate(req)

            await op()  # warm up
            return await _drive(op, conc, seconds)

    return trio.run(main)


def bench_transport(url: str, conc: int, seconds: float) -> float:
    import httpx
    import trio

    from rollout_trio.engines import TrioTransport

    async def main() -> float:
        target = httpx.URL(url + "/generate")
        body = json.dumps(PAYLOAD, separators=(",", ":")).encode()
        headers = [
            (b"host", target.netloc),
            (b"accept", b"application/json"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ]
        transport = TrioTransport()
        try:

            async def op() -> None:
                request = httpx.Request("POST", target, headers=headers, content=body)
                (await transport.handle_async_request(request)).content  # noqa: B018 - read whole

            await op()  # warm up
            return await _drive(op, conc, seconds)
        finally:
            await transport.aclose()

    return trio.run(main)


def bench_httpx(url: str, conc: int, seconds: float) -> float:
    import httpx
    import trio

    async def main() -> float:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        async with httpx.AsyncClient(limits=limits, timeout=None) as client:

            async def op() -> None:
                (await client.post(url + "/generate", json=PAYLOAD)).json()

            await op()  # warm up
            return await _drive(op, conc, seconds)

    return trio.run(main)


def bench_aiohttp(url: str, conc: int, seconds: float) -> float:
    import asyncio

    import aiohttp

    async def main() -> float:
        count = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.post(url + "/generate", json=PAYLOAD) as r:
                await r.json()
            loop = asyncio.get_running_loop()
            end = loop.time() + seconds

            async def worker() -> None:
                nonlocal count
                while loop.time() < end:
                    async with session.post(url + "/generate", json=PAYLOAD) as r:
                        await r.json()
                    count += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(conc)))
            return _rate(count, time.perf_counter() - t0)

    return asyncio.run(main())


CLIENTS = {"remote": bench_remote, "transport": bench_transport, "httpx": bench_httpx, "aiohttp": bench_aiohttp}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    clients = list(args.clients)
    if "aiohttp" in clients:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            print("aiohttp is not installed: skipping its column (pip install aiohttp)")
            clients.remove("aiohttp")
    port_file = f"/tmp/rollout-trio-bench-{os.getpid()}.port"
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", port_file])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("bench server did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            url = "http://127.0.0.1:" + f.read().strip()
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for conc in args.concurrency:
                for name in clients:
                    results.setdefault((name, conc), []).append(CLIENTS[name](url, conc, args.seconds))
        print(f"requests/s, median of {args.repeats} runs of {args.seconds:g} s (fixed SGLang body, loopback)")
        header = f"{'concurrency':>11} " + " ".join(f"{n:>9}" for n in clients)
        if "aiohttp" in clients:
            header += " " + " ".join(f"{n + '/aio':>12}" for n in clients if n != "aiohttp")
        print(header)
        for conc in args.concurrency:
            med = {n: statistics.median(results[(n, conc)]) for n in clients}
            line = f"{conc:>11} " + " ".join(f"{med[n]:>9.0f}" for n in clients)
            if "aiohttp" in clients:
                line += " " + " ".join(f"{med[n] / med['aiohttp']:>11.2f}x" for n in clients if n != "aiohttp")
            print(line)
    finally:
        server.terminate()
        server.wait(10)
        if os.path.exists(port_file):
            os.remove(port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
