"""The executor's costs: bookkeeping throughput, event-loop stalls while dumping, memory.

1. Accepted groups per second with 256 in flight on an instant engine, through the
   executor (a trainer loop of prepare_batch + version bump) against the same groups
   through bare ``run_group`` calls in a nursery behind a 256-slot limiter (target: the
   executor keeps >= 0.9x).
2. The longest event-loop stall (a Trio instrument timing each task step) while the
   executor dumps trajectories of 4k tokens, against the same run without dumps
   (target < 10 ms).
3. RSS while a trainer stops consuming: sampled after the buffer reaches queue_size and
   again much later (target: flat).
4. RSS drift over many accepted trajectories with dumps on: from after a warm-up to the
   end (target < 5%).
5. The cost of the per-trajectory staleness bound (issue 27): a trainer loop at
   ``max_head_offpolicyness=1`` with a mix of short and long episodes (a long one takes 12x
   as long), ``drop_stale=True`` against AReaL's rule (``drop_stale=False``): the share of
   accepted results dropped as stale, the mean length generated and consumed, and the
   oldest lag consumed. Counts, not speed: it runs on a virtual clock.

Run: python bench/executor_bench.py [--quick] [--repeats R]
     (--quick: fewer trajectories; the full run dumps 10,000 trajectories of 4k tokens,
     about 1.5 GB, to a temporary directory it deletes. Expect about 14 minutes for the full
     run on 2 CPU cores (834 s measured), about a minute with --quick (51 s measured).)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import trio
import trio.testing

from rollout_trio import ModelRequest, ModelResponse, Trajectory, run_group
from rollout_trio.executor import TrajectoryDumper, open_executor
from rollout_trio.models import byte_tokenizer
from rollout_trio.workflow_context import StatsRecorder

IN_FLIGHT = 256
GROUP = 4


class InstantEngine:
    """Answers at once (one checkpoint); versions as set."""

    def __init__(self, out_len: int = 48) -> None:
        self.version = 0
        self.out_len = out_len

    def get_version(self) -> int:
        return self.version

    def set_version(self, v: int) -> None:
        self.version = v

    async def pause(self) -> None:
        await trio.lowlevel.checkpoint()

    async def resume(self) -> None:
        await trio.lowlevel.checkpoint()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await trio.lowlevel.checkpoint()
        n = self.out_len
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=[(7 * k) % 250 + 3 for k in range(n)],
            output_logprobs=[-0.5] * n,
            output_versions=[self.version] * n,
        )


PROMPT = tuple(range(1, 33))


async def episode(engine: Any, data: Any) -> Trajectory:
    resp = await engine.agenerate(ModelRequest(input_ids=PROMPT))
    return Trajectory.from_response(resp, 1.0)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- 1. throughput ------------------------------------------------------------------------


async def bare_groups(n: int) -> float:
    engine = InstantEngine()
    limiter = trio.CapacityLimiter(IN_FLIGHT)
    stats = StatsRecorder()
    out: list[Any] = []

    async def one() -> None:
        async with limiter:
            out.append(await run_group(episode, engine, {}, GROUP, stats=stats))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    assert len(out) == n
    return n / (time.perf_counter() - start)


async def executor_groups(n: int) -> float:
    engine = InstantEngine()
    got = 0
    start = time.perf_counter()
    async with open_executor(
        engine, consumer_batch_size=IN_FLIGHT, max_concurrent_rollouts=IN_FLIGHT, max_head_offpolicyness=1,
        stats=StatsRecorder(),
    ) as ex:  # fmt: skip
        source = range(n)
        while got < n:
            batch = await ex.prepare_batch(source, episode, batch_size=IN_FLIGHT, group_size=GROUP, progress=False)
            got += len(batch)
            ex.set_version(engine.version + 1)
    return got / (time.perf_counter() - start)


# -- 2. stalls ------------------------------------------------------------------------------


class StallMeter(trio.abc.Instrument):
    """The longest single task step: time the scheduler could not run anything else.

    ``longest`` is wall time; ``longest_cpu`` the event-loop thread's own CPU time in a
    step, which excludes waiting for the GIL or for a core on a loaded machine.
    """

    def __init__(self) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self._t = 0.0
        self._cpu = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t = time.perf_counter()
        self._cpu = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._t:  # the step that added the instrument had no start
            self.longest = max(self.longest, time.perf_counter() - self._t)
            self.longest_cpu = max(self.longest_cpu, time.thread_time() - self._cpu)
        self._t = 0.0


def long_trajectory(tokens: int = 4096) -> Trajectory:
    prompt, out = 1024, tokens - 1024
    resp = ModelResponse(
        input_tokens=[(k % 200) + 30 for k in range(prompt)],
        output_tokens=[(k % 90) + 32 for k in range(out)],
        output_logprobs=[-0.5] * out,
        output_versions=[0] * out,
    )
    return Trajectory.from_response(resp, 1.0)


async def dump_run(n: int, root: str | None) -> tuple[float, float]:
    template = long_trajectory()

    async def long_episode(engine: Any, data: Any) -> Trajectory:
        await trio.lowlevel.checkpoint()
        return template

    meter = StallMeter()
    trio.lowlevel.add_instrument(meter)
    try:
        dumper = TrajectoryDumper(root, "bench", "stall", byte_tokenizer()) if root else None
        async with open_executor(
            InstantEngine(), consumer_batch_size=64, max_concurrent_rollouts=64, max_head_offpolicyness=10**9,
            dumper=dumper,
        ) as ex:  # fmt: skip
            source = range(n)
            got = 0
            while got < n:
                got += len(await ex.prepare_batch(source, long_episode, batch_size=64, progress=False))
    finally:
        trio.lowlevel.remove_instrument(meter)
    return meter.longest, meter.longest_cpu


# -- 3. memory with a trainer that stops consuming -------------------------------------------


async def stalled_trainer(queue_size: int) -> tuple[float, float, float]:
    async def fresh(engine: Any, data: Any) -> Trajectory:
        await trio.lowlevel.checkpoint()
        return long_trajectory(8192)  # new tensors every time: memory follows what is held

    gc.collect()
    before = rss_mib()
    async with open_executor(
        InstantEngine(), max_concurrent_rollouts=32, max_head_offpolicyness=10**9, queue_size=queue_size
    ) as ex:  # fmt: skip
        for _ in range(queue_size * 20):
            ex.submit({}, fresh)
        while ex.statistics().buffered < queue_size:
            await trio.sleep(0.01)
        gc.collect()
        at_full = rss_mib()
        await trio.sleep(1.0)  # the trainer is busy elsewhere; nothing may start
        gc.collect()
        later = rss_mib()
        assert ex.statistics().buffered == queue_size
    return before, at_full, later


# -- 4. drift with dumps ----------------------------------------------------------------------


async def drift(n: int, root: str) -> tuple[float, float]:
    dumper = TrajectoryDumper(root, "bench", "drift", byte_tokenizer())
    warm = n // 10
    marks: list[float] = []
    async with open_executor(
        InstantEngine(out_len=480), consumer_batch_size=64, max_concurrent_rollouts=64,
        max_head_offpolicyness=10**9, dumper=dumper,
    ) as ex:  # fmt: skip
        source = range(n)
        got = 0
        while got < n:
            got += len(await ex.prepare_batch(source, episode, batch_size=64, progress=False))
            if not marks and got >= warm:
                gc.collect()
                marks.append(rss_mib())
    gc.collect()
    marks.append(rss_mib())
    return marks[0], marks[1]


async def staleness_cost(drop_stale: bool, steps: int) -> dict[str, float]:
    """One trainer loop: prepare_batch(8), bump, on a virtual clock (see the module docstring)."""
    rng = __import__("random").Random(0)
    lengths = [4 if rng.random() < 0.7 else 48 for _ in range(512)]
    engine = InstantEngine()

    async def varied(engine: Any, n: int) -> Trajectory:
        v = engine.get_version()  # its first token's version: a long generation spans more bumps
        await trio.sleep(n / 4)
        return Trajectory.from_dict({
            "input_ids": torch.ones(1, 2 + n, dtype=torch.long),
            "attention_mask": torch.ones(1, 2 + n, dtype=torch.bool),
            "loss_mask": torch.tensor([[0, 0] + [1] * n]),
            "versions": torch.tensor([[-1, -1] + [v] * n]),
        })  # fmt: skip

    consumed_tokens, consumed, worst_lag = 0, 0, 0
    async with open_executor(engine, consumer_batch_size=8, max_concurrent_rollouts=8, max_head_offpolicyness=1, drop_stale=drop_stale) as ex:
        for step in range(steps):
            batch = await ex.prepare_batch(lengths, varied, batch_size=8)
            for t in batch:
                assert isinstance(t, Trajectory) and t.loss_mask is not None and t.versions is not None
                consumed_tokens += int(t.loss_mask.sum())
                consumed += 1
                worst_lag = max(worst_lag, step - int(t.versions[0, -1]))
            ex.set_version(step + 1)
        s = ex.statistics()
    generated = s.accepted + s.buffered + s.stale
    return {
        "stale_share": s.stale / max(1, generated),
        "stale_tokens": float(s.stale_tokens),
        "consumed_mean_len": consumed_tokens / max(1, consumed),
        "generated_mean_len": (consumed_tokens + s.stale_tokens) / max(1, consumed + s.stale),
        "worst_lag": float(worst_lag),
    }


def section(name: str, quick: bool, repeats: int) -> None:
    groups = 2048 if quick else 10240
    dumps = 1000 if quick else 10_000
    drift_n = 2000 if quick else 10_000
    if name == "throughput":
        bare, ex = [], []
        for _ in range(repeats):  # interleaved, so machine noise hits both sides alike
            bare.append(trio.run(bare_groups, groups))
            ex.append(trio.run(executor_groups, groups))
        mb, me = statistics.median(bare), statistics.median(ex)
        print(f"1. groups of {GROUP} per second, {IN_FLIGHT} in flight, {groups} groups, median of {repeats}:")
        print(f"   bare run_group in a nursery   {mb:10.0f}")
        print(f"   executor (prepare_batch)      {me:10.0f}   ratio {me / mb:.2f}x  (target >= 0.9x)")
    elif name == "stall":
        with tempfile.TemporaryDirectory() as root:
            plain = [trio.run(dump_run, dumps, None) for _ in range(repeats)]
            dumped = [trio.run(dump_run, dumps, root) for _ in range(repeats)]
        print(f"2. longest event-loop stall, {dumps} trajectories of 4096 tokens, median of {repeats} (wall / loop-thread CPU):")
        for label, runs in (("without dumps", plain), ("with dumps   ", dumped)):
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(f"   {label} {wall * 1e3:7.2f} ms / {cpu * 1e3:5.2f} ms CPU  (target < 10 ms)")
        print(f"   (load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: wall stalls include waiting for a core)")
    elif name == "stalled":
        before, full, later = trio.run(stalled_trainer, 64)
        print("3. RSS with a trainer that stops consuming (queue_size 64, 1280 submitted, 8192-token rows):")
        print(f"   start {before:7.1f} MiB   buffer full {full:7.1f} MiB   1 s later {later:7.1f} MiB"
              f"   growth after full {later - full:+.1f} MiB  (target: flat)")  # fmt: skip
    elif name == "drift":
        with tempfile.TemporaryDirectory() as root:
            warm, end = trio.run(drift, drift_n, root)
        print(f"4. RSS drift over {drift_n} accepted trajectories with dumps on (warm-up: the first tenth):")
        print(f"   after warm-up {warm:7.1f} MiB   at the end {end:7.1f} MiB   drift {100 * (end - warm) / warm:+.1f}%  (target < 5%)")
    elif name == "staleness":
        steps = 100 if quick else 500
        clock = trio.testing.MockClock(autojump_threshold=0)
        print(f"5. the staleness bound's cost, s=1, {steps} steps of prepare_batch(8), 30% of episodes 12x longer:")
        for drop in (True, False):
            r = trio.run(staleness_cost, drop, steps, clock=clock)
            print(f"   drop_stale={drop!s:5}  dropped {100 * r['stale_share']:5.1f}% of accepted ({r['stale_tokens']:.0f} tokens)"
                  f"   mean length generated {r['generated_mean_len']:5.1f}, consumed {r['consumed_mean_len']:5.1f}"
                  f"   oldest lag consumed {r['worst_lag']:.0f} (bound 1)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer trajectories (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="runs per measurement (default 5, quick 3)")
    p.add_argument("--only", choices=SECTIONS, default=None, help="one section, in this process")
    args = p.parse_args()
    torch.set_num_threads(1)
    repeats = args.repeats or (3 if args.quick else 5)
    if args.only:
        section(args.only, args.quick, repeats)
        return
    if not args.quick:
        print("executor_bench: the full run takes about 14 minutes on 2 CPU cores (--quick: about 1)", flush=True)
    # Each section in a fresh process: memory figures must not inherit another section's heap.
    for name in SECTIONS:
        cmd = [sys.executable, __file__, "--only", name, "--repeats", str(repeats)] + (["--quick"] if args.quick else [])
        subprocess.run(cmd, check=True)


SECTIONS = ("throughput", "stall", "stalled", "drift", "staleness")

if __name__ == "__main__":
    main()
