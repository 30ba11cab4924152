"""An AReaL-style ``RolloutWorkflow`` class, run unchanged on rollout_trio.

What it shows: a workflow written for AReaL (a ``RolloutWorkflow`` subclass whose
``arun_episode`` builds a ``ModelRequest``, awaits ``engine.agenerate`` and returns a
plain dict of ``[1, L]`` tensors) runs as it is. Only the imports change: AReaL's
``areal.api`` names come from ``rollout_trio``. The class body below is AReaL's
single-turn RLVR pattern, line for line (but two ``list()`` calls: the response's
sequences are tuples here, lists in AReaL); rollout_trio validates the returned dict
against the contract (dtypes, shapes, ``versions == -1`` wherever ``loss_mask == 0``)
and groups it with :class:`~rollout_trio.GroupedRolloutWorkflow`, as AReaL's executor
would.

Run it::

    python examples/areal_style_class.py --groups 2 --group-size 8
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

import torch
import trio

# In AReaL: from areal.api.workflow_api import RolloutWorkflow
#           from areal.api.io_struct import ModelRequest
#           from areal.api.cli_args import GenerationHyperparameters
from rollout_trio import GenerationConfig as GenerationHyperparameters
from rollout_trio import GroupedRolloutWorkflow, ModelRequest, RolloutWorkflow
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model


def exact_match_reward(prompt, completions, prompt_ids, completion_ids, answer, **kwargs):
    return float(completions.strip() == str(answer))


class RLVRWorkflow(RolloutWorkflow):
    def __init__(self, reward_fn, gconfig: GenerationHyperparameters, tokenizer):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer

    async def arun_episode(self, engine, data):
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=input_ids,
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        resp = await engine.agenerate(req)

        seq = resp.input_tokens + resp.output_tokens
        # AReaL's lists; rollout_trio's ModelResponse holds tuples, hence the list() calls.
        logprobs = [0.0] * resp.input_len + list(resp.output_logprobs)
        loss_mask = [0] * resp.input_len + [1] * resp.output_len
        versions = [-1] * resp.input_len + list(resp.output_versions)

        prompt_str = self.tokenizer.decode(input_ids)
        completions_str = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = self.reward_fn(prompt_str, completions_str, resp.input_tokens, resp.output_tokens, **data)

        res = dict(
            input_ids=torch.tensor(seq).unsqueeze(0),
            loss_mask=torch.tensor(loss_mask).unsqueeze(0),
            logprobs=torch.tensor(logprobs).unsqueeze(0),
            versions=torch.tensor(versions).unsqueeze(0),
            attention_mask=torch.ones(len(seq), dtype=torch.bool).unsqueeze(0),
            rewards=torch.tensor([float(reward)]),
        )
        return res


async def main_async(groups: int, group_size: int) -> list[Any]:
    model, tokenizer = tiny_model(seed=0)
    gconfig = GenerationHyperparameters(max_new_tokens=4, temperature=1.0).with_stop_and_pad_token_ids(tokenizer)
    workflow = RLVRWorkflow(exact_match_reward, gconfig, tokenizer)
    grouped = GroupedRolloutWorkflow(workflow, group_size, reward_normalization=True)
    data: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": f"What is {k}+{k + 1}?"}], "answer": 2 * k + 1} for k in range(groups)
    ]
    results: list[Any] = [None] * groups
    async with LocalEngine(model, tokenizer, seed=0) as engine:

        async def one(k: int) -> None:
            results[k] = await grouped.arun_episode(engine, data[k])

        async with trio.open_nursery() as nursery:
            for k in range(groups):
                nursery.start_soon(one, k)
    for item, traj in zip(data, results):
        question = item["messages"][0]["content"]
        if traj is None:
            print(f"{question}: group dropped")
            continue
        raw = " ".join(f"{r:.0f}" for r in traj.original_rewards.tolist())
        norm = " ".join(f"{r:+.2f}" for r in traj.rewards.tolist())
        print(f"{question}  batch {tuple(traj.input_ids.shape)}  rewards [{raw}] -> normalized [{norm}]")
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
