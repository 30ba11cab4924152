"""A workflow as a plain Trio ``async def``: prompt in, one completion, a reward, one training row.

What it shows: a workflow is any ``async def workflow(engine, data)`` returning a
:class:`~rollout_trio.Trajectory` (or a plain tensor dict, or ``None`` to reject the
rollout). It may use any Trio feature: here the reward runs in a worker thread, as a
slow verifier would. Episodes run concurrently in a nursery against the embedded
engine (the built-in tiny model, no download).

Run it::

    python examples/workflow_function.py --episodes 8
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio

from rollout_trio import GenerationConfig, ModelRequest, Trajectory
from rollout_trio.engines import InferenceEngine, LocalEngine
from rollout_trio.models import tiny_model


def check_answer(completion: str, answer: int) -> float:
    """A (possibly slow) verifier: 1.0 when the completion is exactly the answer."""
    return 1.0 if completion.strip() == str(answer) else 0.0


async def addition(engine: InferenceEngine, data: dict[str, Any], *, tokenizer: Any) -> Trajectory | None:
    """One episode: ask "What is a+b?", score the answer, pack the row."""
    messages = [{"role": "user", "content": f"What is {data['a']}+{data['b']}?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    gconfig = GenerationConfig(max_new_tokens=4, temperature=1.0).with_stop_and_pad_token_ids(tokenizer)
    resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig, tokenizer=tokenizer))
    completion = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
    if not completion.strip():
        return None  # nothing to learn from: reject the rollout
    reward = await trio.to_thread.run_sync(check_answer, completion, data["a"] + data["b"])
    return Trajectory.from_response(resp, reward)


async def main_async(episodes: int) -> list[Trajectory | None]:
    model, tokenizer = tiny_model(seed=0)
    problems = [{"a": k % 5, "b": (3 * k) % 5} for k in range(episodes)]
    results: list[Trajectory | None] = [None] * episodes
    async with LocalEngine(model, tokenizer, seed=0) as engine:

        async def one(k: int) -> None:
            results[k] = await addition(engine, problems[k], tokenizer=tokenizer)

        async with trio.open_nursery() as nursery:
            for k in range(episodes):
                nursery.start_soon(one, k)
    for data, traj in zip(problems, results):
        if traj is None:
            print(f"{data['a']}+{data['b']}: rejected")
            continue
        assert traj.loss_mask is not None and traj.rewards is not None
        answer = tokenizer.decode(traj.input_ids[0][traj.loss_mask[0].bool()], skip_special_tokens=True)
        print(f"{data['a']}+{data['b']} = {answer!r:<6} reward {float(traj.rewards[0]):.1f}  ({traj.seqlen} tokens)")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=8)
    args = p.parse_args(argv)
    trio.run(main_async, args.episodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
