"""How far one control plane goes: the engine's costs against the number of servers.

    python bench/fleet_bench.py --curve                      # N = 8, 64, 256, 1024
    python bench/fleet_bench.py --servers 8,64,256,1024 [--quick] [--json PATH]

For each N, a fresh process (so its memory and file descriptors are its own) starts N of
bench/work.py's fixed-answer SGLang servers multiplexed in a few processes on loopback,
and bench/fake_router.py (a ``GET /workers`` listing), raises ``RLIMIT_NOFILE`` for
itself and its children, and measures one ``RemoteEngine``:

* fan-out: ``rounds`` x (pause, update_weights while paused, resume), each call one
  fan-out to every server, idle, on warm keep-alive connections (p50, p99, and this
  process's CPU per server per call); and ``cold`` pauses on connections retired by
  their keep-alive expiry first (a new TCP connection to every server, as for an
  update minutes after the last);
* client CPU per request: ``episodes`` single-request generations, ``concurrency`` at a
  time, round robin over the N servers (median of ``rounds`` rounds);
* memory per server: the process's RSS growth from opening the engine and reaching every
  server once (generation and a pause/resume), / N; and the same under tracemalloc (the
  Python objects the engine keeps: servers, pools, connections, cached request heads);
* membership: router mode (``RemoteEngine(router=...)``), the cost of one refresh
  (``GET /workers`` listing N workers, parsed and diffed: steady, and with half the
  workers replaced), of one ``check_fleet`` health round with every worker up, and of
  ``check_fleet`` bringing in N/2 workers that joined.

The parent prints a table per N, ratios against the first N, and the growth exponent
between the last two N (1: linear; 2: quadratic), and saves everything as JSON.
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trio  # noqa: E402

from rollout_trio import GenerationConfig, ModelRequest  # noqa: E402
from rollout_trio.engines import RemoteEngine  # noqa: E402
from rollout_trio.engines._remote_wire import HttpCall  # noqa: E402
from rollout_trio.engines._transport import ConnectionLimits, TrioTransport  # noqa: E402

CURVE = (8, 64, 256, 1024)
FULL = {"episodes": 6000, "concurrency": 256, "rounds": 30, "cold": 5, "load_rounds": 3, "server_procs": 4}
QUICK = {"episodes": 400, "concurrency": 32, "rounds": 5, "cold": 2, "load_rounds": 2, "server_procs": 2}
COLD_EXPIRY = 0.02  # the cold engine's keep-alive expiry: every fan-out after a pause dials anew
PROMPT = list(range(8))

#: (key, label, unit) of each figure, in the order printed.
FIGURES = [
    ("pause_p50_ms", "pause fan-out p50", "ms"),
    ("pause_p99_ms", "pause fan-out p99", "ms"),
    ("update_p50_ms", "update_weights fan-out p50", "ms"),
    ("update_p99_ms", "update_weights fan-out p99", "ms"),
    ("resume_p50_ms", "resume fan-out p50", "ms"),
    ("resume_p99_ms", "resume fan-out p99", "ms"),
    ("fanout_cpu_us_per_server", "fan-out CPU per server per call", "us"),
    ("cold_pause_p50_ms", "cold pause fan-out p50 (new connections)", "ms"),
    ("cold_pause_p99_ms", "cold pause fan-out p99 (new connections)", "ms"),
    ("cpu_us_per_request", "client CPU per request", "us"),
    ("rss_kib_per_server", "engine RSS per server", "KiB"),
    ("traced_kib_per_server", "engine Python heap per server (tracemalloc)", "KiB"),
    ("refresh_ms", "membership refresh, steady (wall)", "ms"),
    ("refresh_cpu_ms", "membership refresh, steady (CPU)", "ms"),
    ("churn_refresh_ms", "membership refresh, half replaced (wall)", "ms"),
    ("churn_refresh_cpu_ms", "membership refresh, half replaced (CPU)", "ms"),
    ("health_round_ms", "check_fleet health round, all up", "ms"),
    ("join_ms", "check_fleet bringing in N/2 joined workers", "ms"),
]


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def raise_nofile(need: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``need`` (at most the hard limit);
    children inherit it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wait_for(path: str, procs: list[subprocess.Popen[bytes]]) -> str:
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
            raise RuntimeError(f"a bench server did not start (no {os.path.basename(path)})")
        time.sleep(0.02)
    with open(path) as f:
        return f.read()


def start_servers(count: int, procs: int, workdir: str) -> tuple[list[subprocess.Popen[bytes]], list[str], str]:
    """``count`` fixed-answer servers over ``procs`` processes, and the fake router."""
    started: list[subprocess.Popen[bytes]] = []
    shares = [count // procs + (1 if i < count % procs else 0) for i in range(procs)]
    files = []
    for i, share in enumerate(s for s in shares if s):
        files.append(os.path.join(workdir, f"ports{i}"))
        started.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "work.py"), files[-1], str(share)]))
    router_file = os.path.join(workdir, "router")
    started.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "fake_router.py"), router_file]))
    addresses = [f"127.0.0.1:{line.strip()}" for path in files for line in wait_for(path, started).splitlines() if line.strip()]
    return started, addresses, f"127.0.0.1:{wait_for(router_file, started).strip()}"


async def warm(engine: RemoteEngine, n: int, concurrency: int) -> None:
    """Reach every server once: a generation each (round robin), then a pause and a resume."""
    await load(engine, n, concurrency)
    await engine.pause()
    await engine.resume()


def request() -> ModelRequest:
    return ModelRequest(input_ids=PROMPT, gconfig=GenerationConfig(max_new_tokens=16))


async def load(engine: RemoteEngine, count: int, concurrency: int) -> None:
    """``count`` generations, at most ``concurrency`` at a time."""
    slots = trio.Semaphore(concurrency)

    async def one() -> None:
        try:
            await engine.agenerate(request())
        finally:
            slots.release()

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            await slots.acquire()
            nursery.start_soon(one)


async def timed(call: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """``(wall seconds, this process's CPU seconds)`` of ``await call()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    await call()
    return time.perf_counter() - wall, time.process_time() - cpu


async def put_listing(engine: RemoteEngine, router: str, urls: list[str]) -> None:
    """Set the fake router's listing (outside what is timed)."""
    await engine._shared.session().call(
        "http://" + router, HttpCall("PUT", "/bench/listing", {"urls": urls}), timeout=60, expect_json=False
    )


async def measure(n: int, cfg: dict[str, Any], addresses: list[str], router: str, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n}
    quiet = {"verify_versions": False, "affinity_size": 0, "health_interval": 3600.0, "setup_timeout": 120.0}
    gc.collect()
    rss0 = rss_bytes()
    async with RemoteEngine(addresses, **quiet) as engine:  # type: ignore[arg-type]
        await warm(engine, n, cfg["concurrency"])
        gc.collect()
        out["rss_kib_per_server"] = (rss_bytes() - rss0) / n / 1024

        per_request = []
        for _ in range(cfg["load_rounds"]):
            _wall, cpu = await timed(lambda: load(engine, cfg["episodes"], cfg["concurrency"]))
            per_request.append(cpu / cfg["episodes"])
        out["cpu_us_per_request"] = statistics.median(per_request) * 1e6

        durations: dict[str, list[float]] = {"pause": [], "update": [], "resume": []}
        cpus: list[float] = []
        for k in range(cfg["rounds"]):
            steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
                ("pause", engine.pause),
                ("update", lambda k=k: engine.update_weights(workdir, version=k + 1)),  # paused: the reload alone
                ("resume", engine.resume),
            ]
            for name, call in steps:
                wall, cpu = await timed(call)
                durations[name].append(wall)
                cpus.append(cpu)
        for name, values in durations.items():
            out[f"{name}_p50_ms"] = p(values, 0.5) * 1e3
            out[f"{name}_p99_ms"] = p(values, 0.99) * 1e3
        out["fanout_cpu_us_per_server"] = statistics.median(cpus) / n * 1e6

    cold_transport = TrioTransport(limits=ConnectionLimits(keepalive_expiry=COLD_EXPIRY))
    async with RemoteEngine(addresses, transport=cold_transport, **quiet) as cold:  # type: ignore[arg-type]
        colds = []
        for _ in range(cfg["cold"]):
            await trio.sleep(COLD_EXPIRY * 3)
            colds.append((await timed(cold.pause))[0])
            await trio.sleep(COLD_EXPIRY * 3)
            await cold.resume()
        out["cold_pause_p50_ms"] = p(colds, 0.5) * 1e3
        out["cold_pause_p99_ms"] = p(colds, 0.99) * 1e3

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    async with RemoteEngine(addresses, **quiet) as traced:  # type: ignore[arg-type]
        await warm(traced, n, cfg["concurrency"])
        gc.collect()
        out["traced_kib_per_server"] = (tracemalloc.get_traced_memory()[0] - base) / n / 1024
    tracemalloc.stop()

    out.update(await membership(n, cfg, addresses, router, quiet))
    return out


async def membership(n: int, cfg: dict[str, Any], addresses: list[str], router: str, quiet: dict[str, Any]) -> dict[str, Any]:
    """Router mode: refreshes (steady, half replaced), health rounds, bringing in joiners."""
    listed = ["http://" + a for a in addresses]
    # Half the workers replaced by others (never contacted: a refresh only lists them).
    other = listed[: n // 2] + [f"http://127.0.0.2:{20000 + i}" for i in range(n - n // 2)]
    async with RemoteEngine(addresses[:1], **quiet) as helper:  # type: ignore[arg-type]
        await put_listing(helper, router, listed)
        async with RemoteEngine(router=router, **quiet) as engine:  # type: ignore[arg-type]
            steady = [await timed(engine._members.refresh_workers) for _ in range(cfg["rounds"])]
            churn = []
            for k in range(cfg["rounds"]):
                await put_listing(helper, router, other if k % 2 == 0 else listed)
                churn.append(await timed(engine._members.refresh_workers))
            health, joins = [], []
            for _ in range(max(1, cfg["rounds"] // 5)):
                await put_listing(helper, router, other)
                await engine._members.refresh_workers()
                await put_listing(helper, router, listed)
                await engine._members.refresh_workers()  # the second half joins again, out of service
                joins.append((await timed(engine.check_fleet))[0])
                assert all(s.up for s in engine.servers) and len(engine.servers) == n, "a joined worker was not brought in"
                health.append((await timed(engine.check_fleet))[0])
    return {
        "refresh_ms": statistics.median(w for w, _ in steady) * 1e3,
        "refresh_cpu_ms": statistics.median(c for _, c in steady) * 1e3,
        "churn_refresh_ms": statistics.median(w for w, _ in churn) * 1e3,
        "churn_refresh_cpu_ms": statistics.median(c for _, c in churn) * 1e3,
        "health_round_ms": statistics.median(health) * 1e3,
        "join_ms": statistics.median(joins) * 1e3,
    }


def one(n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Everything for one N, in this process (the parent runs it as ``--one N``)."""
    limit = raise_nofile(4 * n + 4096)
    gc.freeze()  # as docs/fleet.md advises a trainer: the start-up heap is never rescanned
    with tempfile.TemporaryDirectory() as workdir:
        procs, addresses, router = start_servers(n, min(cfg["server_procs"], n), workdir)
        try:
            out = trio.run(measure, n, cfg, addresses, router, workdir)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    out["nofile"] = limit
    out["server_procs"] = min(cfg["server_procs"], n)
    return out


# --------------------------------------------------------------------------- the parent


def run_curve(counts: list[int], cfg: dict[str, Any], json_path: str | None) -> int:
    """Measure each N in its own process, print the curve, save the JSON."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    points = []
    for n in counts:
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", str(n), json.dumps(cfg)],
            capture_output=True, text=True, cwd=ROOT,  # fmt: skip
        )
        if run.returncode != 0:
            print(f"fleet curve: N={n} failed: {run.stderr.strip().splitlines()[-1:] or run.returncode}", file=sys.stderr)
            sys.stderr.write(run.stderr[-4000:])
            return 1
        points.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(f"  N={n} measured ({time.perf_counter() - started:.0f} s so far)", flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "config": {**cfg, "counts": counts},
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "seconds": time.perf_counter() - started,
        "points": points,
    }
    report(result)
    path = json_path or os.path.join(ROOT, "bench", "results", f"{result['date']}-curve.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"saved {os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}")
    return 0


def growth(v0: float, v1: float, n0: int, n1: int) -> float:
    """The exponent k of ``v ~ N^k`` between two points (nan when undefined)."""
    if v0 <= 0 or v1 <= 0 or n0 == n1:
        return float("nan")
    return math.log(v1 / v0) / math.log(n1 / n0)


def report(result: dict[str, Any]) -> None:
    points = result["points"]
    ns = [pt["n"] for pt in points]
    cfg = result["config"]
    print(f"fleet curve: one RemoteEngine against N fixed-answer loopback servers ({cfg['server_procs']} server "
          f"processes), {result['cpus']} CPUs, load average {result['loadavg_before'][0]:.2f} before, "
          f"{result['loadavg_after'][0]:.2f} after; fan-outs: {cfg['rounds']} rounds, idle; client CPU: "
          f"{cfg['episodes']} requests x {cfg['load_rounds']} rounds, {cfg['concurrency']} in flight")  # fmt: skip
    width = 44
    head = f"{'':<{width}} {'unit':<4}" + "".join(f"{f'N={n}':>11}" for n in ns)
    ratios = "".join(f"{f'x{n // ns[0]}' if n % ns[0] == 0 else f'N={n}':>9}" for n in ns[1:])
    print(head + "   ratio to N=" + str(ns[0]) + ":" + ratios + f"   growth N^k ({ns[-2] if len(ns) > 1 else ns[0]}->{ns[-1]})")
    for key, label, unit in FIGURES:
        values = [pt[key] for pt in points]
        row = f"{label:<{width}} {unit:<4}" + "".join(f"{v:>11.2f}" for v in values)
        row += " " * (len("   ratio to N=" + str(ns[0]) + ":")) + "".join(
            f"{(v / values[0] if values[0] > 0 else float('nan')):>9.2f}" for v in values[1:]
        )
        k = growth(values[-2], values[-1], ns[-2], ns[-1]) if len(ns) > 1 else float("nan")
        print(row + f"   k={k:.2f}")


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--one":
        print(json.dumps(one(int(argv[1]), json.loads(argv[2]))))
        return 0
    print("usage: run it through bench/fleet_bench.py --curve (or --servers 8,64,...)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
