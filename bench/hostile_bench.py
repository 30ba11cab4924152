"""A healthy client's latency while hostile clients attack `rollout-trio serve` (issue 18),
an honest reward's latency while hostile rewards share its pool (issue 34 item 1), and a
bystander's latency while the same process's RemoteEngine faces hostile servers (items 2, 6).

Starts `python -m rollout_trio serve` on loopback, measures a healthy client's
``GET /health`` latency idle, then under each attack running in a thread; prints the
median and p99 under attack and the p99 ratio against the idle baseline of the same run.
Then (``--rewards``) a process ``RewardFunction`` with two workers: honest calls' latency
idle, then while the other worker runs each hostile behaviour of ``tests/hostile_rewards.py``
in a loop, with the longest hostile call against its timeout.

Serve attacks from issue 34 item 5: websocket upgrades, unsampleable rows (every id a stop
id plus min_new_tokens), clients that connect and leave, a client that never reads.

    python -m bench.hostile_bench [--requests 100] [--quick] [--only serve|rewards|peers]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _send(port: int, data: bytes, *, half_close: bool = True) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
    except OSError:
        pass


def _body(path: bytes, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        path, len(body), body)  # fmt: skip


def attacks(port: int) -> dict[str, Callable[[], None]]:
    # Just under the default 4 MiB limit ("1, " is 3 bytes); the bad top_p makes it a 400 once parsed.
    big_ids = json.dumps({"input_ids": [1] * ((4 * 1024 * 1024 - 200) // 3), "sampling_params": {"top_p": "x"}}).encode()
    return {
        "cut chunked + half-close": lambda: _send(
            port, b"GET /health HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n10\r\nabc"
        ),
        "4 MiB input_ids body": lambda: _send(port, _body(b"/generate", big_ids), half_close=False),
        "15 MiB declared body": lambda: _send(
            port, b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (15 * 1024 * 1024), half_close=False
        ),
        "JSON nested 100k deep": lambda: _send(port, _body(b"/generate", b"[" * 100_000 + b"]" * 100_000), half_close=False),
        "40 KB head": lambda: _send(port, b"GET /health HTTP/1.1\r\nhost: x\r\nx: " + b"a" * 40_000 + b"\r\n\r\n", half_close=False),
        "1 MiB rid": lambda: _send(port, _body(b"/generate", json.dumps({"input_ids": [1], "rid": "r" * 1024 * 1024}).encode()), half_close=False),
        "top_p 1e-300": lambda: _send(port, _body(b"/generate", b'{"input_ids":[1,2],"sampling_params":{"max_new_tokens":4,"top_p":1e-300}}'), half_close=False),
        # issue 34 item 5
        "websocket upgrade": lambda: _send(port, b"GET /generate HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                                                 b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n", half_close=False),
        "unsampleable row": lambda: _send(port, _body(b"/generate", json.dumps({"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 4, "min_new_tokens": 2, "stop_token_ids": list(range(VOCAB))}}).encode()), half_close=False),
        "50 connect-and-leave": lambda: _connect_and_leave(port, 50),
        "never-reading client": lambda: _never_read(port),
    }


VOCAB = 512  # more than the tiny model's vocabulary: every id a stop id


def _connect_and_leave(port: int, n: int) -> None:
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
    except OSError:
        pass
    for s in socks:
        s.close()


def _never_read(port: int) -> None:
    """Pipelines 200 /metrics requests and reads nothing for 2 s (the answers pile up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 200)
            time.sleep(2.0)
    except OSError:
        pass


def measure(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            start = time.perf_counter()
            r = client.get(url + "/health")
            out.append(time.perf_counter() - start)
            assert r.status_code == 200, r.status_code
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


REWARD_ATTACKS: dict[str, tuple[str, object]] = {
    "fork a child holding pipes": ("fork_holding_pipes", 1000),
    "... and hang past timeout": ("fork_holding_pipes_and_hang", 1000),
    "setsid child": ("setsid_child", os.devnull),
    "double-forked daemon": ("daemon", os.devnull),
    "pickled None on the pipe": ("pickled_none", None),
    "pickle with exec (value)": ("pickle_exec", os.devnull),
    "thread reading commands": ("forger_thread", None),
    "sys.exit(3)": ("sys_exit", None),
    "KeyboardInterrupt": ("keyboard_interrupt", None),
    "os._exit(3)": ("os_exit", None),
    "sleep past the timeout": ("sleep", 1000),
    "64 MiB return value": ("huge", 64 << 20),
    "non-JSON return value": ("not_json", None),
}


def reward_bench(requests: int, timeout: float) -> None:
    """Honest calls' latency idle and beside each hostile behaviour (one pool of two workers)."""
    import trio

    sys.path.insert(0, ROOT)
    from rollout_trio.rewards import RewardError, RewardFunction
    from tests import hostile_rewards

    async def honest(reward: RewardFunction, n: int) -> list[float]:
        out = []
        for i in range(n):
            start = time.perf_counter()
            assert await reward(float(i), "honest") == float(i)
            out.append(time.perf_counter() - start)
        return out

    async def run() -> None:
        async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=2, timeout=timeout) as reward:
            idle = await honest(reward, requests)
            base = p99(idle)
            print(f"\n{'reward attack':<28} {'median ms':>10} {'p99 ms':>8} {'p99 / idle p99':>15} {'worst attack s':>15} {'outcome':<18}")
            print(f"{'idle':<28} {statistics.median(idle) * 1e3:>10.2f} {base * 1e3:>8.2f} {1.0:>15.2f}")
            for name, (behaviour, arg) in REWARD_ATTACKS.items():
                worst, outcome, done = 0.0, "value", trio.Event()

                async def attack() -> None:
                    nonlocal worst, outcome
                    while not done.is_set():
                        start = time.perf_counter()
                        try:
                            await reward(1.0, behaviour, arg)
                        except RewardError as exc:
                            outcome = type(exc).__name__
                        worst = max(worst, time.perf_counter() - start)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(attack)
                    under = await honest(reward, requests)
                    done.set()
                print(f"{name:<28} {statistics.median(under) * 1e3:>10.2f} {p99(under) * 1e3:>8.2f} "
                      f"{p99(under) / base:>15.2f} {worst:>15.2f} {outcome:<18}")  # fmt: skip

    trio.run(run)


def peers_bench(requests: int) -> None:
    """RemoteEngine facing hostile servers (issue 34 items 2, 6): a bystander's generate
    latency on an honest server while the same engine calls a hostile one, as a ratio to
    idle, with the hostile call's time and the peak memory traced in the process."""
    import gzip
    import tracemalloc

    import trio

    from rollout_trio import EngineError, GenerationConfig, ModelRequest
    from rollout_trio.engines import RemoteEngine, TrioTransport
    from rollout_trio.engines._remote_http import RetryPolicy

    sys.path.insert(0, ROOT)
    from tests.conftest_remote import FakeServer, Raw, default_reply, sglang_body

    bomb_body = gzip.compress(b'{"a": 1' + b" " * (1 << 30) + b"}", compresslevel=1)  # ~1 MiB, 1 GiB inflated
    hostile: dict[str, object] = {
        "gzip bomb (1 GiB) on /generate": Raw(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s" % (len(bomb_body), bomb_body)),
        "JSON nested 100k deep": (200, b"[" * 100_000 + b"]" * 100_000),
        "invalid UTF-8 answer": (200, b'{"text": "\xff"}'),
    }
    req = ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=4))

    async def honest(method: str, path: str, body: object) -> object:
        if path == "/generate":
            return 200, sglang_body([7, 8, 9, 10])
        return await default_reply(method, path, body)

    async def run() -> None:
        print(f"{'hostile server answer':<34} {'bystander p99 ms':>17} {'p99 / idle':>11} {'hostile call s':>15} {'peak MiB':>9} outcome")
        async with trio.open_nursery() as nursery:
            good = FakeServer(honest)
            await nursery.start(good.run)
            reply: list[object] = [None]

            async def bad_script(method: str, path: str, body: object) -> object:
                if path == "/generate":
                    return reply[0]
                return await default_reply(method, path, body)

            bad = FakeServer(bad_script)
            await nursery.start(bad.run)
            kw = dict(seed=0, setup_timeout=10, retry=RetryPolicy(attempts=1), health_interval=3600)
            async with RemoteEngine([good.address], "sglang", transport=TrioTransport(), **kw) as g_eng, \
                    RemoteEngine([bad.address], "sglang", transport=TrioTransport(), **kw) as b_eng:  # fmt: skip

                async def bystander(n: int) -> list[float]:
                    out = []
                    for _ in range(n):
                        t0 = time.perf_counter()
                        await g_eng.agenerate(req)
                        out.append(time.perf_counter() - t0)
                    return out

                base = p99(await bystander(requests))
                print(f"{'idle':<34} {base * 1e3:>17.2f} {1.0:>11.2f}")
                for name, answer in hostile.items():
                    reply[0] = answer
                    done = trio.Event()
                    result: dict[str, object] = {}

                    async def attack() -> None:
                        tracemalloc.start()
                        t0 = time.perf_counter()
                        try:
                            await b_eng.agenerate(req)
                            result["outcome"] = "accepted!"
                        except EngineError as exc:
                            result["outcome"] = type(exc).__name__
                        except Exception as exc:  # noqa: BLE001 - an untyped error is what this reports
                            result["outcome"] = f"UNTYPED {type(exc).__name__}"
                        result["time"] = time.perf_counter() - t0
                        result["peak"] = tracemalloc.get_traced_memory()[1] / 2**20
                        tracemalloc.stop()
                        done.set()

                    async with trio.open_nursery() as inner:
                        inner.start_soon(attack)
                        under = await bystander(requests)
                        await done.wait()
                    print(f"{name:<34} {p99(under) * 1e3:>17.2f} {p99(under) / base:>11.2f} {result['time']:>15.2f} "
                          f"{result['peak']:>9.1f} {result['outcome']}")  # fmt: skip
            nursery.cancel_scope.cancel()

    trio.run(run)


def versions_bench(requests: int) -> None:
    """Poisoned versions (issue 34 item 3): one engine over an honest server and one whose
    answers carry a hostile label; failed requests out of ``requests`` (main failed 4 of
    10 next to a server answering 999) and the p99 latency as a ratio to two honest ones."""
    import trio

    from rollout_trio import EngineError, GenerationConfig, ModelRequest
    from rollout_trio.engines import RemoteEngine, TrioTransport
    from rollout_trio.engines._remote_http import RetryPolicy

    sys.path.insert(0, ROOT)
    from tests.conftest_remote import FakeServer, default_reply, sglang_body

    labels: dict[str, object] = {
        "honest (0)": "0", "999 on answers": "999", "10**30": 10**30, "2**63 as text": str(2**63),
        "'1_000'": "1_000", "' 0 '": " 0 ", "Arabic-Indic zero": "\u0660",
    }  # fmt: skip
    req = ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=4))

    def script(label: list[object]) -> object:
        async def answer(method: str, path: str, body: object) -> object:
            if path == "/get_model_info":
                return 200, {"weight_version": "0"}
            if path == "/generate":
                out = sglang_body([7, 8, 9, 10])
                out["meta_info"]["weight_version"] = label[0]
                return 200, out
            return await default_reply(method, path, body)

        return answer

    async def run() -> None:
        print(f"{'second server labels':<22} {'failed':>8} {'p99 ms':>8} {'p99 / honest':>13} {'engine version':>15}")
        base = 0.0
        async with trio.open_nursery() as nursery:
            good, bad_label = FakeServer(script(["0"])), ["0"]
            bad = FakeServer(script(bad_label))
            for server in (good, bad):
                await nursery.start(server.run)
            for name, label in labels.items():
                bad_label[0] = label
                kw = dict(seed=0, setup_timeout=10, retry=RetryPolicy(attempts=3, backoff_base=0.001), health_interval=3600)
                async with RemoteEngine([good.address, bad.address], "sglang", transport=TrioTransport(), **kw) as eng:  # type: ignore[arg-type]
                    failed, times = 0, []
                    for i in range(requests):
                        t0 = time.perf_counter()
                        try:
                            await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=req.gconfig, rid=f"v{i}"))
                        except EngineError:
                            failed += 1
                        times.append(time.perf_counter() - t0)
                    base = base or p99(times)
                    print(f"{name:<22} {failed:>4}/{requests:<3} {p99(times) * 1e3:>8.2f} {p99(times) / base:>13.2f} {eng.get_version():>15}")
            nursery.cancel_scope.cancel()

    trio.run(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="healthy requests per case")
    parser.add_argument("--quick", action="store_true", help="20 requests per case, a 2 s reward timeout")
    parser.add_argument("--only", choices=["serve", "rewards", "peers", "versions"], help="run one part")
    args = parser.parse_args()
    if args.quick:
        args.requests = min(args.requests, 20)
    if args.only in (None, "versions"):
        versions_bench(args.requests)
    if args.only in (None, "peers"):
        peers_bench(args.requests)
    if args.only in (None, "rewards"):
        reward_bench(args.requests, 2.0 if args.quick else 5.0)
    if args.only in ("rewards", "peers", "versions"):
        return
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_trio", "serve", "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        url = line.split("listening on ")[1].split()[0]
        port = int(url.rsplit(":", 1)[1])
        idle = measure(url, args.requests)
        base = p99(idle)
        print(f"{'case':<28} {'median ms':>10} {'p99 ms':>8} {'p99 / idle p99':>15}")
        print(f"{'idle':<28} {statistics.median(idle) * 1e3:>10.2f} {base * 1e3:>8.2f} {1.0:>15.2f}")
        for name, attack in attacks(port).items():
            stop = threading.Event()

            def loop(attack: Callable[[], None] = attack) -> None:
                while not stop.is_set():
                    attack()

            thread = threading.Thread(target=loop, daemon=True)
            thread.start()
            try:
                under = measure(url, args.requests)
            finally:
                stop.set()
                thread.join(60)
            assert proc.poll() is None, f"serve died under {name}"
            print(f"{name:<28} {statistics.median(under) * 1e3:>10.2f} {p99(under) * 1e3:>8.2f} {p99(under) / base:>15.2f}")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
