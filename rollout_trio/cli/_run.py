"""``rollout-trio run``: grouped rollouts of toy arithmetic on the embedded engine."""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
import time
from collections.abc import Mapping, Sequence
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
from ._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Parser,
    UsageError,
    device,
    interruptible,
    load_model_and_tokenizer,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    run_command,
)

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


def _parser() -> Parser:
    p = Parser(
        "rollout-trio run",
        "Run grouped rollouts of toy arithmetic on the embedded engine and print rewards and group statistics.",
    )
    p.add_argument("--groups", type=positive_int, default=16, help="prompts (one group each)")
    p.add_argument("--group-size", type=positive_int, default=8, help="samples per prompt (G)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="groups in flight at once")
    p.add_argument(
        "--model", default=None, help="a local Hugging Face checkpoint directory (default: the built-in tiny model)"
    )
    p.add_argument(
        "--device", type=device, default=None, help="cpu, cuda, cuda:N or mps (default: cuda if present, else cpu)"
    )
    p.add_argument("--temperature", type=non_negative_float, default=1.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="tokens generated per sample at most")
    p.add_argument(
        "--reward-normalization",
        action="store_true",
        help="normalize rewards within each group (needs --group-size >= 2); prints both rewards",
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seeds the prompts and sampling; the same seed gives the same samples whatever the scheduling",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help="seconds before the whole run is abandoned (default: no deadline)",
    )
    return p


def _build_engine(args: argparse.Namespace) -> LocalEngine:
    model, tokenizer, _ = load_model_and_tokenizer(args.model, args.device)
    return LocalEngine(model, tokenizer, seed=args.seed)


def _shown(rewards: torch.Tensor) -> str:
    return f"[{' '.join(f'{r:.1f}' for r in rewards.tolist())}]  mean {rewards.mean():.2f}"


async def _run(args: argparse.Namespace) -> int:
    prompts = arithmetic_prompts(args.groups, seed=args.seed)
    stats = StatsRecorder()
    started = time.perf_counter()
    engine = await trio.to_thread.run_sync(_build_engine, args)
    lines: list[str | None] = [None] * len(prompts)
    async with engine, interruptible() as interrupt:
        workflow = rlvr_workflow(
            engine.tokenizer,
            arithmetic_reward,
            GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature),
        )
        group = GroupedRolloutWorkflow(
            workflow, args.group_size, reward_normalization=args.reward_normalization, stats=stats
        )
        limiter = trio.CapacityLimiter(args.concurrency)
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
                    assert traj.rewards is not None
                    line = f"{k:>3}  {question:<12} rewards "
                    if traj.original_rewards is not None:
                        line += f"{_shown(traj.original_rewards)}  normalized {_shown(traj.rewards)}"
                    else:
                        line += _shown(traj.rewards)
                    lines[k] = line
                bar.update(1)

            with trio.move_on_after(math.inf if args.timeout is None else args.timeout) as deadline:
                with workflow_context.use_seed(args.seed):
                    async with trio.open_nursery() as nursery:
                        for k, data in enumerate(prompts):
                            nursery.start_soon(one, k, data)
            if deadline.cancelled_caught:
                raise CommandError(f"--timeout {args.timeout}: the run did not finish in time")
    elapsed = time.perf_counter() - started
    finished = [line for line in lines if line is not None]
    print(f"group  question     per-slot rewards (G={args.group_size})")
    for line in finished:
        print(line)
    print(f"\ngroup statistics (mean over {len(finished)} groups):")
    for key, value in stats.export().items():
        print(f"  {key:<40} {value:.3f}")
    print(f"\n{len(finished) * args.group_size} episodes in {elapsed:.1f} s")
    if interrupt.received:
        print(f"rollout-trio run: interrupted; {len(finished)} of {len(prompts)} groups finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _main(args: argparse.Namespace) -> int:
    if args.reward_normalization and args.group_size < 2:
        raise UsageError("--reward-normalization needs --group-size >= 2 (it normalizes within a group)")
    return trio.run(_run, args)


def run_main(argv: Sequence[str]) -> int:
    """Entry point of ``rollout-trio run``; returns the exit status."""
    return run_command("rollout-trio run", _parser(), argv, _main)
