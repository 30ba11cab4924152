"""A plain (non-Trio) training loop fed by ``SyncRolloutExecutor``.

What it shows: a trainer written as ordinary blocking Python (no ``async``, no Trio)
embeds rollout_trio through :class:`~rollout_trio.SyncRolloutExecutor`. The executor
runs Trio, the engine and the rollouts in one background thread; every method is a
blocking call. Each step takes a grouped batch with ``prepare_batch`` (rollouts for the
next step keep running meanwhile, within ``max_head_offpolicyness``), takes a
policy-gradient step on a training copy of the model, and pushes the weights back with
``update_weights(state_dict, version)``.

Run it::

    python examples/sync_trainer.py --steps 5

Ctrl-C stops it between or during steps: the call in flight is cancelled in the
executor's thread, the executor closes (aborting generations), and it exits 130 after
saying how many steps finished.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import torch

from rollout_trio import GenerationConfig, RolloutConfig, SyncRolloutExecutor, concat_trajectories
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflows import rlvr_workflow


def exact_answer(completion: str, data: Any) -> float:
    return 1.0 if completion.strip() == str(data["answer"]) else 0.0


def policy_gradient_step(model: Any, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    """``-advantage * logprob`` over the completion tokens (rewards are group-normalized)."""
    ids = batch.input_ids.long()
    logits = model(input_ids=ids, attention_mask=batch.attention_mask.long()).logits[:, :-1]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = batch.loss_mask[:, 1:].float()
    loss = -(batch.rewards[:, None] * logprobs * mask).sum() / mask.sum().clamp(min=1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--groups-per-batch", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    args = p.parse_args(argv)

    model, tokenizer = tiny_model(seed=0)
    policy = copy.deepcopy(model).train()  # the trainer's copy; the engine serves `model`
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    workflow = rlvr_workflow(tokenizer, exact_answer, GenerationConfig(max_new_tokens=3, temperature=1.0))
    prompts = [
        {"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": a + b} for a in range(5) for b in range(5)
    ]
    config = RolloutConfig(consumer_batch_size=args.groups_per_batch, max_head_offpolicyness=1)

    done = 0
    try:
        with SyncRolloutExecutor(LocalEngine(model, tokenizer, seed=0), config) as executor:
            for step in range(args.steps):
                version = executor.get_version()
                groups = executor.prepare_batch(
                    prompts, workflow, batch_size=args.groups_per_batch, group_size=args.group_size,
                    reward_normalization=True,
                )  # fmt: skip
                batch = concat_trajectories(groups)
                assert batch.versions is not None and batch.loss_mask is not None and batch.original_rewards is not None
                versions = batch.versions[batch.loss_mask.bool()]
                loss = policy_gradient_step(policy, optimizer, batch)
                executor.update_weights({k: v.detach().clone() for k, v in policy.state_dict().items()}, version + 1)
                done += 1
                print(
                    f"step {step}: {batch.batch_size} rows at version {version}, token versions "
                    f"{int(versions.min())}..{int(versions.max())}, mean reward {float(batch.original_rewards.mean()):.3f}, "
                    f"loss {loss:+.4f}",
                    flush=True,
                )
            stats = executor.statistics()
    except KeyboardInterrupt:  # the call in flight was cancelled and the executor closed
        print(f"interrupted: {done} step(s) finished", file=sys.stderr)
        return 130
    print(f"executor: {stats.accepted} groups accepted, {stats.rejected} rejected, {stats.failed} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
