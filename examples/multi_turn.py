"""The multi-turn workflow: retry with feedback until the answer is right.

What it shows: :class:`~rollout_trio.MultiTurnWorkflow` asks, scores the answer, and
when the reward is 0 appends a feedback turn ("Your answer is either wrong ...") and
asks again, up to ``max_turns``. The episode is ONE training row: every attempt is
trained on (``loss_mask`` 1), the inserted feedback is not (``loss_mask`` 0, version
-1), and the row's reward is ``turn_discount ** (k - 1)`` for success at attempt
``k``. The reward function goes through :class:`~rollout_trio.RewardFunction` (a
worker thread with a timeout). Groups of episodes run with :func:`~rollout_trio.run_group`.

Run it::

    python examples/multi_turn.py --groups 2 --group-size 4 --max-turns 3
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio

from rollout_trio import GenerationConfig, MultiTurnWorkflow, RewardFunction, Trajectory, run_group
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model


def exact(prompt: str, completion: str, prompt_ids: Any, completion_ids: Any, **data: Any) -> float:
    """1.0 when the completion (without its end-of-turn token) is the answer."""
    return float(completion.removesuffix("<|im_end|>").strip() == str(data["answer"]))


def attempts(traj: Trajectory, row: int, tokenizer: Any) -> list[str]:
    """The model's answers in one row, one per attempt (``turn_ids`` numbers them)."""
    turn_ids = traj.extras["turn_ids"][row]
    real = traj.attention_mask[row]  # a joined group pads extras such as turn_ids with 0
    texts = []
    for t in range(int(turn_ids[real].max()) + 1):
        tokens = traj.input_ids[row][(turn_ids == t) & real]
        texts.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    return texts


async def main_async(groups: int, group_size: int, max_turns: int) -> list[Any]:
    model, tokenizer = tiny_model(seed=0)
    workflow = MultiTurnWorkflow(
        RewardFunction(exact, timeout=5),
        GenerationConfig(max_new_tokens=3, temperature=1.0),
        tokenizer,
        max_turns=max_turns,
        turn_discount=0.9,
    )
    data: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": f"What is {k}+{k}?"}], "answer": 2 * k} for k in range(1, groups + 1)
    ]
    results: list[Any] = [None] * groups
    async with LocalEngine(model, tokenizer, seed=0) as engine:

        async def one(k: int) -> None:
            results[k] = await run_group(workflow, engine, data[k], group_size)

        async with trio.open_nursery() as nursery:
            for k in range(groups):
                nursery.start_soon(one, k)
    for item, traj in zip(data, results):
        print(item["messages"][0]["content"])
        if traj is None:
            print("  group dropped")
            continue
        assert traj.loss_mask is not None and traj.rewards is not None
        for row in range(traj.batch_size):
            tries = attempts(traj, row, tokenizer)
            trained = int(traj.loss_mask[row].sum())
            length = int(traj.attention_mask[row].sum())
            print(f"  attempts {tries!s:<22} reward {float(traj.rewards[row]):.2f}  trained {trained:>2} of {length} tokens")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=3)
    args = p.parse_args(argv)
    trio.run(main_async, args.groups, args.group_size, args.max_turns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
