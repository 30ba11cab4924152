"""The longest scheduler stall while a group of long rollouts is assembled.

A trio.abc.Instrument times every task step (``before_task_step`` to
``after_task_step``); the longest step is the longest time no other task could run.
Each slot of a group of G rollouts returns the usual six tensors for a sequence of
L tokens (prompt 512, the rest output); the group is merged and its rewards
normalized. The longest step is how late any other task (a concurrent group, an
HTTP client) could be woken.

Baseline, in the same process: the same assembly called directly on the Trio thread
(``assemble_group``, what ``_group.py`` did before it moved to a worker thread).

Run: python bench/group_stall_bench.py [--slots 16] [--tokens 32768] [--repeats 5]

Known: the process may abort at exit ("terminate called without an active exception")
when it ends within milliseconds of a worker-thread assembly: Python ends the idle
Trio worker thread with pthread_exit while it still holds torch thread-local state.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import trio

from rollout_trio import GroupedRolloutWorkflow
from rollout_trio._assemble import GroupPolicy, assemble_group
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder

PROMPT = 512


def slot_result(tokens: int, slot: int) -> dict[str, torch.Tensor]:
    out = tokens - PROMPT
    loss = torch.cat([torch.zeros(PROMPT, dtype=torch.int32), torch.ones(out, dtype=torch.int32)])[None]
    return {
        "input_ids": torch.randint(0, 32000, (1, tokens), dtype=torch.int32),
        "attention_mask": torch.ones(1, tokens, dtype=torch.bool),
        "loss_mask": loss,
        "logprobs": torch.where(loss.bool(), -0.5, 0.0).float(),
        "versions": torch.where(loss.bool(), 3, -1).int(),
        "rewards": torch.tensor([float(slot % 3)]),
    }


class StepTimer(trio.abc.Instrument):
    """The longest task step seen since the last reset."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._start: float | None = None  # the step that adds the instrument has no start

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._start = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._start is not None:
            self.longest = max(self.longest, time.perf_counter() - self._start)
        self._start = None


async def one_group(results: list[dict[str, torch.Tensor]], *, direct: bool) -> float:
    """The longest task step while one group of ``results`` runs (seconds)."""
    g = len(results)
    timer = StepTimer()
    if direct:

        async def run() -> None:
            await trio.lowlevel.checkpoint()
            assemble_group(results, GroupPolicy(g, 2, reward_normalization=True))

    else:
        it = iter(results)

        async def slot(engine: object, data: object) -> dict[str, torch.Tensor]:
            return next(it)

        wf = GroupedRolloutWorkflow(slot, g, reward_normalization=True, stats=StatsRecorder())

        async def run() -> None:
            await wf.arun_episode(ScriptedEngine(), {})

    trio.lowlevel.add_instrument(timer)
    try:
        await run()
        await trio.lowlevel.checkpoint()  # ends the step that ran the last of the work
    finally:
        trio.lowlevel.remove_instrument(timer)
    return timer.longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [slot_result(args.tokens, i) for i in range(args.slots)]

    async def bench() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"on the Trio thread": [], "GroupedRolloutWorkflow": []}
        for _ in range(args.repeats):
            out["on the Trio thread"].append(await one_group(results, direct=True))
            out["GroupedRolloutWorkflow"].append(await one_group(results, direct=False))
        return out

    figures = trio.run(bench)
    print(f"group of {args.slots} x {args.tokens} tokens, {args.repeats} repeats; longest task step (median):")
    base = statistics.median(figures["on the Trio thread"])
    for name, values in figures.items():
        med = statistics.median(values)
        print(f"  {name:24s} {med * 1e3:8.2f} ms  (x{med / base:.3f} of the baseline)")


if __name__ == "__main__":
    main()
