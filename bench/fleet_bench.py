"""The fleet at scale: one trainer process against 64 loopback servers, and sglang-router's cost.

    python bench/fleet_bench.py [--quick] [--servers 64] [--episodes 20000] [--concurrency 256]
                                [--control-rounds 100] [--router-workers 4] [--rounds 3] [--seconds 3]
    python bench/fleet_bench.py --curve [--servers 8,64,256,1024] [--quick] [--json PATH]

``--curve`` (or ``--servers`` with several counts) measures how the control plane's costs
grow with the number of servers instead: see bench/fleet_curve.py (there ``--episodes``
and ``--concurrency`` are the load per round, ``--control-rounds`` the fan-out and
refresh rounds, ``--rounds`` the load rounds).

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
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trio  # noqa: E402

from bench.work import CLIENT_NEW_TOKENS, CLIENT_PROMPT  # noqa: E402
from rollout_trio import GenerationConfig, ModelRequest  # noqa: E402
from rollout_trio.engines import RemoteEngine  # noqa: E402
from rollout_trio.engines._sglang import SGLangBackend  # noqa: E402

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


class BareClient:
    """The floor: the same requests as pre-framed bytes over pooled Trio sockets, the
    answer's body found by its Content-Length and decoded with ``json.loads``; nothing
    else (no validation, routing, retries or deadlines). Run in the same process against
    the same servers, it shows what Trio and the kernel's loopback cost alone."""

    def __init__(self, addresses: list[str], body: bytes) -> None:
        self.origins = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addresses]
        self.idle: dict[tuple[str, int], list[trio.SocketStream]] = {o: [] for o in self.origins}
        self.generate = self.frame(b"POST", b"/generate", body)
        self.next = 0

    @staticmethod
    def frame(method: bytes, path: bytes, body: bytes) -> bytes:
        return b"%s %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            method, path, len(body), body)  # fmt: skip

    async def exchange(self, origin: tuple[str, int], data: bytes) -> Any:
        idle = self.idle[origin]
        stream = idle.pop() if idle else await trio.open_tcp_stream(*origin)
        await stream.send_all(data)
        buf = b""
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += await stream.receive_some(65536)
        head = buf[:end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) >= 0 else len(head)]) if at >= 0 else 0
        while len(buf) < end + 4 + length:
            buf += await stream.receive_some(65536)
        idle.append(stream)
        return json.loads(buf[end + 4 : end + 4 + length]) if length else None

    async def agenerate(self) -> Any:
        origin = self.origins[self.next]
        self.next = (self.next + 1) % len(self.origins)
        return await self.exchange(origin, self.generate)

    async def fan_out(self, path: bytes, body: bytes) -> None:
        data = self.frame(b"POST", path, body)
        async with trio.open_nursery() as nursery:
            for origin in self.origins:
                nursery.start_soon(self.exchange, origin, data)

    async def aclose(self) -> None:
        for streams in self.idle.values():
            for stream in streams:
                await stream.aclose()


CONTROL_BODIES = {  # what SGLangBackend sends, for the bare client's fan-outs
    "pause": (b"/pause_generation", b'{"mode": "abort"}'),
    "resume": (b"/continue_generation", b"{}"),
    "update": (b"/update_weights_from_disk", b'{"model_path": "x", "abort_all_requests": true, "weight_version": "1"}'),
}


async def direct_run(
    addresses: list[str], episodes: int, concurrency: int, control_rounds: int, checkpoint: str, rounds: int
) -> dict[str, Any]:
    """Phase A: ``episodes`` episodes, nothing else, in ``rounds`` alternating rounds of
    RemoteEngine and the bare client (CPU per request each, loop lag). Phase B: the same
    load while a trainer task pauses, resumes and updates every server ``control_rounds``
    times, ``CONTROL_EVERY`` apart, each call followed by the bare client's fan-out of the
    same call (durations), first with no load (idle), then under load."""
    request = ModelRequest(input_ids=CLIENT_PROMPT, gconfig=GenerationConfig(max_new_tokens=CLIENT_NEW_TOKENS))
    lags: list[float] = []
    cpu: dict[str, list[float]] = {"ours": [], "bare": []}
    fanouts: dict[tuple[str, str, str], list[float]] = {}  # (load, call, client) -> seconds
    async with RemoteEngine(addresses, verify_versions=False, affinity_size=0) as engine:
        call = SGLangBackend().generate(CLIENT_PROMPT, request.gconfig, max_new=CLIENT_NEW_TOKENS, min_new=0, rid="bench")
        bare = BareClient(addresses, json.dumps(call.json).encode())  # the body RemoteEngine sends
        await engine.agenerate(request)  # warm up: one connection made
        await bare.agenerate()

        async def probe(done: trio.Event) -> None:
            while not done.is_set():
                start = trio.current_time()
                await trio.sleep(0.001)
                lags.append(trio.current_time() - start - 0.001)

        async def load(one: Callable[[], Awaitable[object]], count: int | None, done: trio.Event) -> None:
            """``count`` calls of ``one`` (None: until ``done``), ``concurrency`` at a time."""
            slots = trio.Semaphore(concurrency)

            async def episode() -> None:
                try:
                    await one()
                finally:
                    slots.release()

            sent = 0
            async with trio.open_nursery() as nursery:
                while not done.is_set() if count is None else sent < count:
                    await slots.acquire()  # never more than ``concurrency`` episodes alive
                    nursery.start_soon(episode)
                    sent += 1
            done.set()

        async def timed(key: tuple[str, str, str], call: Callable[[], Awaitable[object]]) -> None:
            start = time.perf_counter()
            await call()
            fanouts.setdefault(key, []).append(time.perf_counter() - start)

        async def trainer(load_name: str, count: int, done: trio.Event | None) -> None:
            version = engine.get_version()
            for _ in range(count):
                await trio.sleep(CONTROL_EVERY)
                for call in ("pause", "resume", "update"):
                    if call == "update":
                        version += 1
                        ours = partial(engine.update_weights, checkpoint, version=version)
                    else:
                        ours = getattr(engine, call)
                    await timed((load_name, call, "ours"), ours)
                    await timed((load_name, call, "bare"), partial(bare.fan_out, *CONTROL_BODIES[call]))
            if done is not None:
                done.set()

        async def ours_one() -> None:
            await engine.agenerate(request)

        per_round = max(1, episodes // rounds)
        generated = trio.Event()
        wall_ours = 0.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe, generated)
            for _ in range(rounds):
                for name, one in (("ours", ours_one), ("bare", bare.agenerate)):
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    await load(one, per_round, trio.Event())
                    cpu[name].append((time.process_time() - cpu0) / per_round)
                    if name == "ours":
                        wall_ours += time.perf_counter() - wall0
            generated.set()

        await trainer("idle", max(1, control_rounds // 5), None)
        controlled = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, ours_one, None, controlled)
            await trainer("load", control_rounds, controlled)
        await bare.aclose()
    ratios = [o / b for o, b in zip(cpu["ours"], cpu["bare"])]
    return {
        "episodes": per_round * rounds,
        "rate": per_round * rounds / wall_ours,
        "cpu_us": statistics.median(cpu["ours"]) * 1e6,
        "bare_cpu_us": statistics.median(cpu["bare"]) * 1e6,
        "cpu_ratio": statistics.median(ratios),
        "lag_p99_ms": p99(lags) * 1e3,
        "fanout_p99_ms": {key: p99(values) * 1e3 for key, values in fanouts.items()},
        "control_rounds": control_rounds,
    }


# --------------------------------------------------------------------------- part 2: router


class Fleet:
    """``rollout-trio fleet`` as a subprocess: the workers' and the router's addresses."""

    def __init__(self, workers: int) -> None:
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_trio", "fleet", "--workers", str(workers), "--port", "0",
             "--policy", "round_robin", "--startup-timeout", "300",
             "--no-api-key"],  # a measurement on loopback; the key is tested in tests/test_fleet_cli.py  # fmt: skip
            stdout=subprocess.PIPE, text=True, cwd=ROOT,  # fmt: skip
            env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )
        assert self.proc.stdout is not None
        self.workers: list[str] = []
        self.router = ""
        self.router_pid = 0
        try:
            for line in self.proc.stdout:  # the fleet's own --startup-timeout bounds this (it exits: EOF)
                if line.startswith("worker "):
                    self.workers.append(line.split()[2])
                elif line.startswith("router: "):
                    self.router = line.split()[1]
                    self.router_pid = int(line.split("(pid ")[1].split(",")[0].split(")")[0])
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def router_rounds(fleet: Fleet, rounds: int, seconds: float, concurrency: int) -> dict[str, list[float]]:
    """Requests/s through the router and straight to its workers, in alternating rounds;
    and the router process's own CPU per routed request (``router_cpu_us``)."""
    gconfig = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    request = ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig)
    rates: dict[str, list[float]] = {"router": [], "direct": [], "router_cpu_us": []}
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
                        # A new request (a new rid) each time, as episodes send: one rid
                        # reused would pin every request to one worker (rid affinity).
                        await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig))
                        count += 1

                start, router_cpu = time.perf_counter(), cpu_seconds(fleet.router_pid)
                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(worker)
                rates[name].append(count / (time.perf_counter() - start))
                if name == "router":
                    rates["router_cpu_us"].append((cpu_seconds(fleet.router_pid) - router_cpu) / max(count, 1) * 1e6)
    return rates


# --------------------------------------------------------------------------- main


def server_counts(text: str) -> list[int]:
    """``--servers``: one count, or a comma-separated list of them (a curve)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or a comma-separated list of them, got {text!r}") from None
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"counts must be distinct and >= 1, got {text!r}")
    return sorted(counts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run; prints how long the full run takes")
    p.add_argument("--curve", action="store_true", help="the control plane's costs for N = 8, 64, 256, 1024 "
                   "servers (bench/fleet_curve.py; with --servers: those N)")  # fmt: skip
    p.add_argument("--json", default=None, help="curve mode: save the results here (default bench/results/DATE-curve.json)")
    for name, value in FULL.items():
        kind = server_counts if name == "servers" else type(value)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=f"(full run: {value})")
    args = p.parse_args()
    if args.curve or (args.servers is not None and len(args.servers) > 1):
        from bench import fleet_curve

        curve = dict(fleet_curve.QUICK if args.quick else fleet_curve.FULL)
        for ours, theirs in (("episodes", "episodes"), ("concurrency", "concurrency"), ("control_rounds", "rounds"),
                             ("rounds", "load_rounds")):  # fmt: skip
            if getattr(args, ours) is not None:
                curve[theirs] = getattr(args, ours)
        return fleet_curve.run_curve(args.servers or list(fleet_curve.CURVE), curve, args.json)
    if args.servers is not None:
        args.servers = args.servers[0]
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k]) for k in FULL}

    # What docs/fleet.md advises a trainer: with torch imported, a full collection of the
    # heap stalls the loop ~100 ms now and then (a fan-out's p99); objects alive after
    # start-up are moved out of the collector's reach.
    gc.freeze()
    with tempfile.TemporaryDirectory() as workdir:
        server, addresses = start_fixed_servers(cfg["servers"], workdir)
        try:
            direct = trio.run(
                direct_run, addresses, cfg["episodes"], cfg["concurrency"], cfg["control_rounds"], workdir, cfg["rounds"]
            )
        finally:
            server.terminate()
            server.wait(10)
    print(f"part 1: one trainer process, {cfg['servers']} fixed-answer loopback servers, {direct['episodes']} episodes, "
          f"{cfg['concurrency']} in flight: {direct['rate']:.0f} episodes/s; then "
          f"{direct['control_rounds']} rounds of pause, resume, update every {CONTROL_EVERY * 1e3:.0f} ms, "
          f"idle and under the same load")  # fmt: skip
    print(f"  {'client CPU per request':<38} {direct['cpu_us']:>8.1f} us   target <= {TARGETS['cpu_us']:g} us   "
          f"{verdict(direct['cpu_us'], TARGETS['cpu_us'])}   (bare Trio socket client {direct['bare_cpu_us']:.1f} us: "
          f"ours / bare {direct['cpu_ratio']:.2f}x, median of {cfg['rounds']} interleaved rounds)")  # fmt: skip
    lag = direct["lag_p99_ms"]
    print(f"  {'Trio loop lag p99':<38} {lag:>8.1f} ms   target < {TARGETS['lag_ms']:g} ms   {verdict(lag, TARGETS['lag_ms'], True)}")
    fan = direct["fanout_p99_ms"]
    for call in CONTROL_BODIES:
        ours, floor = fan[("load", call, "ours")], fan[("load", call, "bare")]
        label = f"{call} fan-out p99 ({cfg['servers']} servers)"
        print(f"  {label:<38} {ours:>8.1f} ms   "
              f"target < {TARGETS['fanout_ms']:g} ms   {verdict(ours, TARGETS['fanout_ms'], True)}   "
              f"(bare client under the same load {floor:.1f} ms; idle: ours {fan[('idle', call, 'ours')]:.1f}, "
              f"bare {fan[('idle', call, 'bare')]:.1f} ms)")  # fmt: skip

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
        print(f"  the router process's own CPU per routed request {statistics.median(rates['router_cpu_us']):.0f} us "
              f"(on {os.cpu_count()} cores it is taken from the workers)")  # fmt: skip

    if args.quick:  # episodes at this rate, the router's rounds, and workers loading side by side
        startup = fleet_startup * FULL["router_workers"] / max(cfg["router_workers"], 1) if fleet_startup else 60.0
        control = 1.2 * FULL["control_rounds"] * (CONTROL_EVERY + 2e-3 * sum(direct["fanout_p99_ms"].values()) / 2)
        full = 2 * FULL["episodes"] / direct["rate"] + control + FULL["rounds"] * FULL["seconds"] * 2 + startup
        print(f"the full run (python bench/fleet_bench.py) takes about {full:.0f} s on this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
