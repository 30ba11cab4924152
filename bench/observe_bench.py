"""What watching a run costs: executor episodes/s with metrics, traces and the server on vs off.

64 tasks in flight, a trainer loop of ``wait``. "metrics" adds ``ExecutorMetrics`` as an
observer and ``open_metrics_server``, scraped once a second from another process (as
``rollout-trio top`` does); "all" adds ``TraceRecorder`` and ``TracedEngine`` around the
engine. The three alternate run by run (the order rotating) in one process, after a
warm-up and ``gc.freeze()`` (as docs/fleet.md advises trainers); the figures are the
median of the per-round ratios to "off" (target >= 0.99) and the median extra CPU
microseconds per task.

``--engine instant`` (the default) answers at once (``ScriptedEngine``): about 130 us per
task, the worst case for any per-task cost. ``--engine tiny`` generates with the embedded
default engine (``LocalEngine`` on the tiny model, CPU), what ``rollout-trio run`` does.

Run: python bench/observe_bench.py [--engine instant|tiny] [--tasks N] [--rounds R]
(about 40 s with the defaults)
"""

from __future__ import annotations

import argparse
import gc
import socket
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import trio

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, open_executor
from rollout_trio.observe import ExecutorMetrics, TracedEngine, TraceRecorder, open_metrics_server
from rollout_trio.testing import ScriptedEngine

# Scrapes url/metrics once a second until killed: another process, as `top` is. It runs
# through the whole bench (between runs and during "off" ones it finds nobody listening),
# so every mode shares the machine with it alike.
SCRAPER = """
import sys, time, urllib.request
while True:
    try:
        urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=5).read()
    except OSError:
        pass
    time.sleep(1.0)
"""
MODES = ("off", "metrics", "all")

GC = GenerationConfig(max_new_tokens=4)


async def workflow(engine: Any, data: Any) -> Trajectory:
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GC))
    return Trajectory.from_response(resp, 1.0)


def open_engine(kind: str) -> Any:
    if kind == "instant":
        return ScriptedEngine()
    from rollout_trio.engines import LocalEngine
    from rollout_trio.models import tiny_model

    model, tokenizer = tiny_model(device="cpu")
    return LocalEngine(model, tokenizer, device="cpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def one_run(engine_kind: str, tasks: int, mode: str, port: int) -> float:
    """CPU seconds per task of one run of ``tasks`` tasks in ``mode``."""
    async with AsyncExitStack() as stack:
        engine: Any = await stack.enter_async_context(open_engine(engine_kind))
        observers: list[Any] = []
        if mode != "off":
            metrics = ExecutorMetrics()
            observers = [metrics]
            if mode == "all":
                recorder = TraceRecorder()
                observers.append(recorder)
                engine = TracedEngine(engine, recorder)
            await stack.enter_async_context(open_metrics_server(metrics, port=port))
        start = time.process_time()
        async with open_executor(engine, max_head_offpolicyness=1000, max_concurrent_rollouts=64,
                                 consumer_batch_size=64, observers=observers) as ex:  # fmt: skip
            done = 0
            submitted = 0
            while done < tasks:
                while submitted < tasks and submitted - done < 128:
                    ex.submit({}, workflow)
                    submitted += 1
                done += len(await ex.wait(min(64, tasks - done)))
        return (time.process_time() - start) / tasks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["instant", "tiny"], default="instant")
    p.add_argument("--tasks", type=int, help="tasks per run (default 2000 instant, 128 tiny)")
    p.add_argument("--rounds", type=int, default=15, help="runs of each mode, alternating")
    args = p.parse_args()
    tasks = args.tasks or (2000 if args.engine == "instant" else 128)
    per_task: dict[str, list[float]] = {mode: [] for mode in MODES}
    port = free_port()
    scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{port}"])
    try:
        trio.run(one_run, args.engine, max(64, tasks // 4), "all", port)  # warm-up: imports, first allocations
        gc.collect()
        gc.freeze()
        for r in range(args.rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:  # rotate, so no mode always runs first
                per_task[mode].append(trio.run(one_run, args.engine, tasks, mode, port))
    finally:
        scraper.kill()
        scraper.wait()
    off = per_task["off"]
    print(f"{args.engine} engine, {tasks} tasks per run, {args.rounds} rounds; CPU per task off: {statistics.median(off) * 1e6:,.1f} us")
    for mode, label in (("metrics", "metrics + server"), ("all", "metrics + trace + server")):
        ratios = [o / m for o, m in zip(off, per_task[mode], strict=True)]  # episodes/s on / off
        extra = statistics.median(m - o for o, m in zip(off, per_task[mode], strict=True)) * 1e6
        print(
            f"{label:<26} episodes/s ratio {statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            f"  extra CPU per task {extra:+.1f} us  (target >= 0.99)"
        )


if __name__ == "__main__":
    main()
