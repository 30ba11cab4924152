"""The fleet at scale: one trainer process against 64 loopback servers, and sglang-router's cost.

    python bench/fleet_bench.py [--quick] [--servers 64] [--episodes 20000] [--concurrency 256]
                                [--control-rounds 100] [--router-workers 4] [--rounds 3] [--seconds 3]

Part 1, direct: one subprocess listens on ``--servers`` ports with bench/work.py's
fixed-answer SGLang server (the server is not what is measured). One ``RemoteEngine``
sends ``--episodes`` single-request episodes, ``--concurrency`` at a time, while a probe
in the same Trio loop measures its lag (sleep 1 ms, how late it wakes): client CPU per
request is this process's CPU time over the requests. Then, under the same load, a
trainer task pauses, resumes and updates every server ``--control-rounds`` times, 100 ms
apart: each call's duration is one fan-out to every server. Printed with their targets.

Part 2, router: ``rollout-trio fleet`` starts ``--router-workers`` ``rollout-trio serve``
workers (the tiny model) behind sglang-router; requests/s through the router
(``RemoteEngine(router=...)``) and straight to the same workers (``RemoteEngine(addresses)``)
are measured in alternating rounds of ``--seconds``; medians and their ratio are printed.

``--quick`` is a smoke run (8 servers, 1000 episodes, one worker, one short round) that
also prints how long the full run would take on this machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trio  # noqa: E402

from bench.work import CLIENT_NEW_TOKENS, CLIENT_PROMPT  # noqa: E402
from rollout_trio import GenerationConfig, ModelRequest  # noqa: E402
from rollout_trio.engines import RemoteEngine  # noqa: E402

TARGETS = {"cpu_us": 50.0, "lag_ms": 10.0, "fanout_ms": 50.0}
CONTROL_EVERY = 0.1  # seconds between the trainer task's pause/resume/update rounds
FULL = {"servers": 64, "episodes": 20000, "concurrency": 256, "control_rounds": 100, "router_workers": 4, "rounds": 3, "seconds": 3.0}
QUICK = {"servers": 8, "episodes": 1000, "concurrency": 64, "control_rounds": 10, "router_workers": 1, "rounds": 1, "seconds": 0.5}


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def verdict(value: float, target: float, strict: bool = False) -> str:
    ok = value < target if strict else value <= target
    return "ok" if ok else "MISSED"


# --------------------------------------------------------------------------- part 1: direct


def start_fixed_servers(count: int, workdir: str) -> tuple[subprocess.Popen[bytes], list[str]]:
    """bench/work.py's fixed-answer server on ``count`` loopback ports, in one process."""
    port_file = os.path.join(workdir, "ports")
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "work.py"), port_file, str(count)])
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise RuntimeError("the fixed-answer servers did not start")
        time.sleep(0.05)
    with open(port_file) as f:
        return server, [f"127.0.0.1:{line.strip()}" for line in f if line.strip()]


async def direct_run(
    addresses: list[str], episodes: int, concurrency: int, control_rounds: int, checkpoint: str
) -> dict[str, Any]:
    """Phase A: ``episodes`` episodes, nothing else (CPU per request, loop lag). Phase B:
    the same load while a trainer task pauses, resumes and updates every server
    ``control_rounds`` times, ``CONTROL_EVERY`` apart (each call's duration)."""
    request = ModelRequest(input_ids=CLIENT_PROMPT, gconfig=GenerationConfig(max_new_tokens=CLIENT_NEW_TOKENS))
    lags: list[float] = []
    pauses: list[float] = []
    resumes: list[float] = []
    updates: list[float] = []
    async with RemoteEngine(addresses, verify_versions=False, affinity_size=0) as engine:
        await engine.agenerate(request)  # warm up: one connection made

        async def probe(done: trio.Event) -> None:
            while not done.is_set():
                start = trio.current_time()
                await trio.sleep(0.001)
                lags.append(trio.current_time() - start - 0.001)

        async def load(count: int | None, done: trio.Event) -> None:
            """``count`` episodes (None: until ``done``), ``concurrency`` at a time."""
            slots = trio.Semaphore(concurrency)

            async def episode() -> None:
                try:
                    await engine.agenerate(request)
                finally:
                    slots.release()

            sent = 0
            async with trio.open_nursery() as nursery:
                while not done.is_set() if count is None else sent < count:
                    await slots.acquire()  # never more than ``concurrency`` episodes alive
                    nursery.start_soon(episode)
                    sent += 1
            done.set()

        async def timed(call: Callable[[], Awaitable[object]], into: list[float]) -> None:
            start = time.perf_counter()
            await call()
            into.append(time.perf_counter() - start)

        async def trainer(done: trio.Event) -> None:
            version = engine.get_version()
            for _ in range(control_rounds):
                await trio.sleep(CONTROL_EVERY)
                await timed(engine.pause, pauses)
                await timed(engine.resume, resumes)
                version += 1
                await timed(lambda: engine.update_weights(checkpoint, version=version), updates)
            done.set()

        generated = trio.Event()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe, generated)
            await load(episodes, generated)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0

        controlled = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, None, controlled)
            await trainer(controlled)
    return {
        "episodes": episodes,
        "wall_s": wall,
        "rate": episodes / wall,
        "cpu_us": cpu / episodes * 1e6,
        "lag_p99_ms": p99(lags) * 1e3,
        "pause_p99_ms": p99(pauses) * 1e3,
        "resume_p99_ms": p99(resumes) * 1e3,
        "update_p99_ms": p99(updates) * 1e3,
        "control_rounds": len(updates),
    }


# --------------------------------------------------------------------------- part 2: router


class Fleet:
    """``rollout-trio fleet`` as a subprocess: the workers' and the router's addresses."""

    def __init__(self, workers: int) -> None:
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_trio", "fleet", "--workers", str(workers), "--port", "0",
             "--policy", "round_robin", "--startup-timeout", "300"],  # fmt: skip
            stdout=subprocess.PIPE, text=True, cwd=ROOT,  # fmt: skip
            env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )
        assert self.proc.stdout is not None
        self.workers: list[str] = []
        self.router = ""
        try:
            for line in self.proc.stdout:  # the fleet's own --startup-timeout bounds this (it exits: EOF)
                if line.startswith("worker "):
                    self.workers.append(line.split()[2])
                elif line.startswith("router: "):
                    self.router = line.split()[1]
                    break
            if not self.router:
                raise RuntimeError("rollout-trio fleet did not start (its stderr says why)")
        except BaseException:  # Ctrl-C while it starts included: never leave it running
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def router_rounds(fleet: Fleet, rounds: int, seconds: float, concurrency: int) -> dict[str, list[float]]:
    """Requests/s through the router and straight to its workers, in alternating rounds."""
    request = ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=4, ignore_eos=True))
    rates: dict[str, list[float]] = {"router": [], "direct": []}
    async with RemoteEngine(router=fleet.router) as routed, RemoteEngine(fleet.workers) as direct:
        engines = {"router": routed, "direct": direct}
        for engine in engines.values():
            await engine.agenerate(request)  # warm up
        for _ in range(rounds):
            for name, engine in engines.items():
                count = 0
                end = trio.current_time() + seconds

                async def worker(engine: RemoteEngine = engine) -> None:
                    nonlocal count
                    while trio.current_time() < end:
                        await engine.agenerate(request)
                        count += 1

                start = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(worker)
                rates[name].append(count / (time.perf_counter() - start))
    return rates


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run; prints how long the full run takes")
    for name, value in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None, help=f"(full run: {value})")
    args = p.parse_args()
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k]) for k in FULL}

    with tempfile.TemporaryDirectory() as workdir:
        server, addresses = start_fixed_servers(cfg["servers"], workdir)
        try:
            direct = trio.run(direct_run, addresses, cfg["episodes"], cfg["concurrency"], cfg["control_rounds"], workdir)
        finally:
            server.terminate()
            server.wait(10)
    print(f"part 1: one trainer process, {cfg['servers']} fixed-answer loopback servers, {cfg['episodes']} episodes, "
          f"{cfg['concurrency']} in flight: {direct['rate']:.0f} episodes/s; then under the same load, "
          f"{direct['control_rounds']} rounds of pause, resume, update every {CONTROL_EVERY * 1e3:.0f} ms")  # fmt: skip
    rows = [
        ("client CPU per request", direct["cpu_us"], "us", TARGETS["cpu_us"], "<=", False),
        ("Trio loop lag p99", direct["lag_p99_ms"], "ms", TARGETS["lag_ms"], "<", True),
        (f"pause fan-out p99 ({cfg['servers']} servers)", direct["pause_p99_ms"], "ms", TARGETS["fanout_ms"], "<", True),
        (f"resume fan-out p99 ({cfg['servers']} servers)", direct["resume_p99_ms"], "ms", TARGETS["fanout_ms"], "<", True),
        (f"update fan-out p99 ({cfg['servers']} servers)", direct["update_p99_ms"], "ms", TARGETS["fanout_ms"], "<", True),
    ]
    for label, value, unit, target, op, strict in rows:
        print(f"  {label:<38} {value:>8.1f} {unit}   target {op} {target:g} {unit}   {verdict(value, target, strict)}")

    fleet_startup = 0.0
    if cfg["router_workers"] > 0:
        fleet = Fleet(cfg["router_workers"])
        try:
            fleet_startup = fleet.startup_s
            rates = trio.run(router_rounds, fleet, cfg["rounds"], cfg["seconds"], 16)
        finally:
            fleet.stop()
        routed, straight = statistics.median(rates["router"]), statistics.median(rates["direct"])
        print(f"part 2: {cfg['router_workers']} rollout-trio serve workers (tiny model), 16 in flight, "
              f"medians of {cfg['rounds']} alternating rounds of {cfg['seconds']:g} s")  # fmt: skip
        print(f"  through sglang-router {routed:>8.1f} req/s   direct {straight:>8.1f} req/s   "
              f"router / direct {routed / straight:.2f}x   (rounds: router {[round(r) for r in rates['router']]}, "
              f"direct {[round(r) for r in rates['direct']]})")  # fmt: skip

    if args.quick:  # episodes at this rate, the router's rounds, and workers loading side by side
        startup = fleet_startup * FULL["router_workers"] / max(cfg["router_workers"], 1) if fleet_startup else 60.0
        control = FULL["control_rounds"] * (CONTROL_EVERY + 1e-3 * (direct["pause_p99_ms"] + direct["resume_p99_ms"] + direct["update_p99_ms"]))
        full = FULL["episodes"] / direct["rate"] + control + FULL["rounds"] * FULL["seconds"] * 2 + startup
        print(f"the full run (python bench/fleet_bench.py) takes about {full:.0f} s on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
