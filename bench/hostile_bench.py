"""A healthy client's latency while hostile clients attack `rollout-trio serve` (issue 18),
and an honest reward's latency while hostile rewards share its pool (issue 34 item 1).

Starts `python -m rollout_trio serve` on loopback, measures a healthy client's
``GET /health`` latency idle, then under each attack running in a thread; prints the
median and p99 under attack and the p99 ratio against the idle baseline of the same run.
Then (``--rewards``) a process ``RewardFunction`` with two workers: honest calls' latency
idle, then while the other worker runs each hostile behaviour of ``tests/hostile_rewards.py``
in a loop, with the longest hostile call against its timeout.

    python -m bench.hostile_bench [--requests 100] [--quick] [--only serve|rewards]
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
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="healthy requests per case")
    parser.add_argument("--quick", action="store_true", help="20 requests per case, a 2 s reward timeout")
    parser.add_argument("--only", choices=["serve", "rewards"], help="run one half")
    args = parser.parse_args()
    if args.quick:
        args.requests = min(args.requests, 20)
    if args.only != "serve":
        reward_bench(args.requests, 2.0 if args.quick else 5.0)
    if args.only == "rewards":
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
