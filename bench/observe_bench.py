"""What watching a run costs: executor episodes/s with metrics, traces and the server on vs off.

An instant engine (``ScriptedEngine``), 64 tasks in flight, a trainer loop of ``wait``;
"on" adds ``ExecutorMetrics`` and ``TraceRecorder`` as observers, ``TracedEngine`` around
the engine and ``open_metrics_server`` (scraped once a second, as ``top`` does). Runs
alternate off/on in one process; the figure is the ratio of medians (target >= 0.99).

Run: python bench/observe_bench.py [--tasks N] [--repeats R]   (about 40 s by default)
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AsyncExitStack
from typing import Any

import httpx
import trio

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, open_executor
from rollout_trio.observe import ExecutorMetrics, TracedEngine, TraceRecorder, open_metrics_server
from rollout_trio.testing import ScriptedEngine


GC = GenerationConfig(max_new_tokens=4)


async def workflow(engine: Any, data: Any) -> Trajectory:
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GC))
    return Trajectory.from_response(resp, 1.0)


async def one_run(tasks: int, watched: bool, trace: bool = True) -> float:
    async with AsyncExitStack() as stack:
        engine: Any = await stack.enter_async_context(ScriptedEngine())
        observers: list[Any] = []
        nursery = await stack.enter_async_context(trio.open_nursery())
        if watched:
            metrics = ExecutorMetrics()
            observers = [metrics]
            if trace:
                recorder = TraceRecorder()
                observers.append(recorder)
                engine = TracedEngine(engine, recorder)
            url = await stack.enter_async_context(open_metrics_server(metrics))

            async def scrape() -> None:
                async with httpx.AsyncClient() as client:
                    while True:
                        await client.get(f"{url}/metrics")
                        await trio.sleep(1.0)

            nursery.start_soon(scrape)
        start = time.perf_counter()
        async with open_executor(engine, max_head_offpolicyness=1000, max_concurrent_rollouts=64,
                                 consumer_batch_size=64, observers=observers) as ex:  # fmt: skip
            done = 0
            submitted = 0
            while done < tasks:
                while submitted < tasks and submitted - done < 128:
                    ex.submit({}, workflow)
                    submitted += 1
                done += len(await ex.wait(min(64, tasks - done)))
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return tasks / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    off: list[float] = []
    metrics: list[float] = []
    on: list[float] = []
    trio.run(one_run, 500, True)  # warm-up
    for _ in range(args.repeats):
        off.append(trio.run(one_run, args.tasks, False))
        metrics.append(trio.run(one_run, args.tasks, True, False))
        on.append(trio.run(one_run, args.tasks, True))
    m_off, m_metrics, m_on = (statistics.median(x) for x in (off, metrics, on))
    print(f"episodes/s off (median of {args.repeats}): {m_off:,.0f}")
    print(f"episodes/s metrics + server: {m_metrics:,.0f}  ratio {m_metrics / m_off:.3f}")
    print(f"episodes/s metrics + trace + server: {m_on:,.0f}  ratio {m_on / m_off:.3f} (target >= 0.99)")


if __name__ == "__main__":
    main()
