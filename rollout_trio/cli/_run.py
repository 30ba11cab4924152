"""``rollout-trio run``: grouped rollouts of toy arithmetic on the embedded engine."""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import trio
from .._config import GenerationConfig
from .._stats import StatsRecorder
from .._trajectory import Trajectory
from ..engines import LocalEngine
from ..executor import RolloutConfig, TaskOutcome, open_executor
from ..workflows import rlvr_workflow

__all__ = ["arithmetic_prompts", "arithmetic_reward", "run_main"]


def arithmetic_prompts(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` single-digit addition questions whose answers are below 10."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        out.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": a + b})
    return out


def arithmetic_reward(completion: str, data: Mapping[str, Any]) -> float:
    """1.0 for the right number, partial credit ``1 - |error| / 10`` for a near miss, 0 otherwise.

    The partial credit keeps the reward informative for a tiny model that guesses.
    """
    match = re.search(r"-?\d+", completion)
    if match is None:
        return 0.0
    error = abs(int(match.group()) - int(data["answer"]))
    return max(0.0, 1.0 - error / 10.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout-trio run",
        description=(
            "Run grouped rollouts of toy arithmetic on the embedded engine through the executor, "
            "printing each group as it finishes, then group statistics. Ctrl-C stops new work, "
            "aborts the episodes in flight, prints the summary and exits 130."
        ),
    )
    p.add_argument("--groups", type=int, default=16, help="prompts (one group each); default 16")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (G); default 8")
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight at once; default 4")
    p.add_argument("--consumer-batch-size", type=int, default=None,
                   help="groups the consumer takes per batch (default: --concurrency)")
    p.add_argument("--max-head-offpolicyness", type=int, default=1000,
                   help="versions a batch may lag (the run never bumps the version); default 1000")
    p.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if present, else cpu)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--reward-normalization", action="store_true", help="normalize rewards within each group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episode-timeout", type=float, default=None,
                   help="seconds one group may take; a group past it counts as failed (default: no limit)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before the whole run stops as if interrupted (default: no limit)")
    p.add_argument("--dump", metavar="DIR", default=None,
                   help="write every trajectory as JSONL under DIR/run/<trial>/ (see docs/dumps.md)")
    return p  # fmt: skip


def _build_engine(args: argparse.Namespace) -> LocalEngine:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model:
        return LocalEngine.from_pretrained(args.model, device=device, seed=args.seed)
    from ..models import tiny_model

    model, tokenizer = tiny_model(seed=args.seed, device=device)
    return LocalEngine(model, tokenizer, seed=args.seed)


class _Summary:
    """Streams one line per finished group and counts the outcomes."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.counts: dict[str, int] = {"accepted": 0, "dropped": 0, "failed": 0}
        self.episodes = 0

    def header(self) -> None:
        print(f"group  question     per-slot rewards (G={self.group_size})", flush=True)

    def on_outcome(self, outcome: TaskOutcome) -> None:
        if outcome.status == "cancelled":
            return
        k = outcome.data["index"]
        question = outcome.data["messages"][0]["content"]
        traj = outcome.trajectory
        if outcome.status == "accepted" and isinstance(traj, Trajectory):
            raw = traj.original_rewards if traj.original_rewards is not None else traj.rewards
            assert raw is not None
            shown = " ".join(f"{r:.1f}" for r in raw.tolist())
            line = f"{k:>3}  {question:<12} rewards [{shown}]  mean {raw.mean():.2f}"
            self.counts["accepted"] += 1
        elif outcome.status == "failed":
            line = f"{k:>3}  {question:<12} failed ({outcome.reason})"
            self.counts["failed"] += 1
        else:
            line = f"{k:>3}  {question:<12} dropped"
            self.counts["dropped"] += 1
        self.episodes += self.group_size
        print(line, flush=True)


async def _run(args: argparse.Namespace) -> int:
    prompts = [dict(p, index=k) for k, p in enumerate(arithmetic_prompts(args.groups, seed=args.seed))]
    stats = StatsRecorder()
    summary = _Summary(args.group_size)
    batch_size = args.consumer_batch_size or args.concurrency
    config = RolloutConfig(
        consumer_batch_size=batch_size,
        max_concurrent_rollouts=args.concurrency,
        max_head_offpolicyness=args.max_head_offpolicyness,
        queue_size=max(batch_size, args.concurrency) * 16,
        episode_timeout=args.episode_timeout,
        dump_to_file=args.dump is not None,
        fileroot=args.dump,
        experiment_name="run" if args.dump is not None else None,
        trial_name=f"seed{args.seed}" if args.dump is not None else None,
    )
    interrupted = False
    started = time.perf_counter()
    async with _build_engine(args) as engine:
        workflow = rlvr_workflow(
            engine.tokenizer,
            arithmetic_reward,
            GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature),
        )
        summary.header()
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as work, trio.open_signal_receiver(signal.SIGINT) as sigint:

                async def stop_on_sigint() -> None:
                    nonlocal interrupted
                    async for _ in sigint:
                        interrupted = True
                        print("interrupted: stopping new work and aborting episodes in flight", file=sys.stderr, flush=True)
                        work.cancel()

                nursery.start_soon(stop_on_sigint)
                if args.timeout is not None:
                    work.deadline = trio.current_time() + args.timeout
                async with open_executor(engine, config, tokenizer=engine.tokenizer, stats=stats) as ex:
                    remaining = len(prompts)
                    while remaining:
                        n = min(batch_size, remaining)
                        await ex.prepare_batch(
                            prompts, workflow, batch_size=n, dynamic_bs=True, cycle=False, progress=False,
                            callback=summary.on_outcome, group_size=args.group_size,
                            reward_normalization=args.reward_normalization,
                        )  # fmt: skip
                        remaining -= n
            nursery.cancel_scope.cancel()
    if work.cancelled_caught and not interrupted:
        print(f"rollout-trio run: stopped after --timeout {args.timeout} s", file=sys.stderr)
    elapsed = time.perf_counter() - started
    c = summary.counts
    print(f"\n{c['accepted']} groups kept, {c['dropped']} dropped, {c['failed']} failed"
          f"{f', {len(prompts) - sum(c.values())} not finished' if sum(c.values()) < len(prompts) else ''}")  # fmt: skip
    print(f"\ngroup statistics (mean over {sum(c.values())} groups):")
    for key, value in stats.export().items():
        print(f"  {key:<40} {value:.3f}")
    print(f"\n{summary.episodes} episodes in {elapsed:.1f} s")
    if args.dump is not None:
        print(f"trajectories dumped under {os.path.join(args.dump, 'run', f'seed{args.seed}')}")
    return 130 if interrupted else 0


def run_main(argv: list[str]) -> int:
    """Entry point of ``rollout-trio run``."""
    args = _parser().parse_args(argv)
    for name in ("groups", "group_size", "concurrency", "max_new_tokens", "consumer_batch_size"):
        if getattr(args, name) is None:
            continue
        if getattr(args, name) < 1:
            print(f"rollout-trio run: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.max_head_offpolicyness < 0:
        print("rollout-trio run: --max-head-offpolicyness must be >= 0", file=sys.stderr)
        return 2
    for name in ("episode_timeout", "timeout"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            print(f"rollout-trio run: --{name.replace('_', '-')} must be > 0 seconds", file=sys.stderr)
            return 2
    return trio.run(_run, args)
