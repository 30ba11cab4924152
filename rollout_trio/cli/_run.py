"""``rollout-trio run``: grouped rollouts of toy arithmetic on the embedded engine."""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import trio
from tqdm import tqdm

from .. import workflow_context
from .._config import GenerationConfig
from .._group import GroupedRolloutWorkflow
from .._stats import StatsRecorder
from .._trajectory import Trajectory
from ..engines import LocalEngine
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
        description="Run grouped rollouts of toy arithmetic on the embedded engine and print rewards and group statistics.",
    )
    p.add_argument("--groups", type=int, default=16, help="prompts (one group each); default 16")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (G); default 8")
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight at once; default 4")
    p.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if present, else cpu)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--reward-normalization", action="store_true", help="normalize rewards within each group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the whole run is abandoned")
    return p


def _build_engine(args: argparse.Namespace) -> LocalEngine:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model:
        return LocalEngine.from_pretrained(args.model, device=device, seed=args.seed)
    from ..models import tiny_model

    model, tokenizer = tiny_model(seed=args.seed, device=device)
    return LocalEngine(model, tokenizer, seed=args.seed)


async def _run(args: argparse.Namespace) -> int:
    prompts = arithmetic_prompts(args.groups, seed=args.seed)
    stats = StatsRecorder()
    started = time.perf_counter()
    async with _build_engine(args) as engine:
        workflow = rlvr_workflow(
            engine.tokenizer,
            arithmetic_reward,
            GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature),
        )
        group = GroupedRolloutWorkflow(
            workflow, args.group_size, reward_normalization=args.reward_normalization, stats=stats
        )
        limiter = trio.CapacityLimiter(args.concurrency)
        lines: list[str | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), unit="group", file=sys.stderr, dynamic_ncols=True) as bar:

            async def one(k: int, data: dict[str, Any]) -> None:
                async with limiter:
                    with workflow_context.use(workflow_context.WorkflowContext(task_id=k)):
                        traj = await group.arun_episode(engine, data)
                question = data["messages"][0]["content"]
                if traj is None:
                    lines[k] = f"{k:>3}  {question:<12} dropped"
                else:
                    assert isinstance(traj, Trajectory)  # the RLVR workflow returns tensor rows
                    raw = traj.original_rewards if traj.original_rewards is not None else traj.rewards
                    assert raw is not None
                    shown = " ".join(f"{r:.1f}" for r in raw.tolist())
                    lines[k] = f"{k:>3}  {question:<12} rewards [{shown}]  mean {raw.mean():.2f}"
                bar.update(1)

            with trio.fail_after(args.timeout):
                async with trio.open_nursery() as nursery:
                    for k, data in enumerate(prompts):
                        nursery.start_soon(one, k, data)
    elapsed = time.perf_counter() - started
    print(f"group  question     per-slot rewards (G={args.group_size})")
    for line in lines:
        print(line)
    print(f"\ngroup statistics (mean over {len(prompts)} groups):")
    for key, value in stats.export().items():
        print(f"  {key:<40} {value:.3f}")
    print(f"\n{len(prompts) * args.group_size} episodes in {elapsed:.1f} s")
    return 0


def run_main(argv: list[str]) -> int:
    """Entry point of ``rollout-trio run``."""
    args = _parser().parse_args(argv)
    for name in ("groups", "group_size", "concurrency", "max_new_tokens"):
        if getattr(args, name) < 1:
            print(f"rollout-trio run: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    return trio.run(_run, args)
