"""An agent written with the ``openai`` SDK, rolled out in-process.

What it shows: an agent is any object with ``async def run(data, **kwargs)`` that talks
to the model through an OpenAI client. :class:`~rollout_trio.AgentRolloutWorkflow`
serves an OpenAI-compatible endpoint backed by the engine, in the same Trio run and
without a socket (``http_client`` routes the SDK's requests straight into the app),
records every chat completion as an :class:`~rollout_trio.Interaction` with its tokens,
logprobs and per-token versions, and turns the agent's return value into rewards
(``discount`` passes later rewards back to earlier turns). The agent code is plain
``openai``: the same class runs against any OpenAI-compatible server.

Run it::

    python examples/openai_agent.py --groups 2 --group-size 8
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import openai
import trio

from rollout_trio import AgentRolloutWorkflow, Interaction, Trajectory, interactions_to_trajectory, run_group
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model


class SelfCheckingAgent:
    """Answers, is asked "Are you sure?", answers again; the final answer is scored."""

    async def run(self, data: dict[str, Any], *, base_url: str, http_client: Any, api_key: str) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        messages = list(data["messages"])
        answer = ""
        for _ in range(2):
            reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=1.0)
            answer = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Are you sure?"}]
        return 1.0 if answer.strip() == str(data["answer"]) else 0.0


async def main_async(groups: int, group_size: int) -> list[Any]:
    model, tokenizer = tiny_model(seed=0)
    agent = AgentRolloutWorkflow(SelfCheckingAgent(), discount=0.9)
    data: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": f"What is {k}+3?"}], "answer": k + 3} for k in range(groups)
    ]
    results: list[Any] = [None] * groups
    async with LocalEngine(model, tokenizer, seed=0) as engine:

        async def one(k: int) -> None:
            results[k] = await run_group(agent, engine, data[k], group_size)

        async with trio.open_nursery() as nursery:
            for k in range(groups):
                nursery.start_soon(one, k)
    for item, interactions in zip(data, results):
        print(item["messages"][0]["content"])
        if interactions is None:
            print("  group dropped")
            continue
        batch: Trajectory = interactions_to_trajectory(interactions)
        assert batch.rewards is not None
        print(f"  {len(interactions)} completions -> {batch.batch_size} training rows")
        for inter in interactions.values():
            assert inter.model_response is not None
            resp = inter.model_response
            text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            print(
                f"    rollout {inter.rollout_index}: {text!r:<6} reward {inter.reward:.2f}  "
                f"{resp.output_len} tokens, versions {sorted(set(resp.output_versions))}"
            )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args(argv)
    trio.run(main_async, args.groups, args.group_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
