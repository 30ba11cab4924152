"""A GRPO batch of grouped rollouts: rewards normalized per group, and what a failing slot does.

What it shows:

1. :func:`~rollout_trio.run_group` runs ``G`` samples of one prompt as one group in a
   nursery; with ``reward_normalization=True`` each row's reward becomes
   ``(r - mean) / std`` over its group (the GRPO advantage) and the raw rewards stay in
   ``original_rewards``. Groups are joined into one right-padded training batch with
   :func:`~rollout_trio.concat_trajectories`.
2. A slot that *returns* ``None`` is a rejected sample: the group goes on with the rest.
3. A slot that *raises* fails its whole group: its siblings are cancelled at once (their
   generations leave the engine's batch), and the group raises a strict
   ``ExceptionGroup`` whose error carries the slot index as a note. Other groups are
   unaffected.

Run it::

    python examples/grouped_grpo_batch.py --groups 3 --group-size 8
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, concat_trajectories, run_group, workflow_context
from rollout_trio.engines import InferenceEngine, LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflows import rlvr_workflow


def close_enough(completion: str, data: Any) -> float:
    """Partial credit: 1 for the sum, 0.1 less per unit of error."""
    digits = "".join(ch for ch in completion if ch.isdigit())
    return max(0.0, 1.0 - abs(int(digits) - data["answer"]) / 10) if digits else 0.0


class VerifierDown(RuntimeError):
    """The failure injected into one slot."""


def question(a: int, b: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": a + b}


async def main_async(groups: int, group_size: int) -> Trajectory:
    model, tokenizer = tiny_model(seed=0)
    rlvr = rlvr_workflow(tokenizer, close_enough, GenerationConfig(max_new_tokens=3, temperature=1.0))

    async def picky(engine: InferenceEngine, data: Any) -> Trajectory | None:
        """The RLVR workflow, except that slot 0 rejects its sample (returns None)."""
        traj = await rlvr(engine, data)
        return None if workflow_context.get().sample_idx == 0 else traj

    async with LocalEngine(model, tokenizer, seed=0) as engine:
        # 1. A batch of groups, rewards normalized within each group.
        prompts = [question(k % 5, (k * 2) % 5) for k in range(groups)]
        results: list[Any] = [None] * groups

        async def one(k: int) -> None:
            results[k] = await run_group(rlvr, engine, prompts[k], group_size, reward_normalization=True)

        async with trio.open_nursery() as nursery:
            for k in range(groups):
                nursery.start_soon(one, k)
        kept = [t for t in results if t is not None]
        batch = concat_trajectories(kept)
        print(f"1. {len(kept)} groups of {group_size} -> batch {tuple(batch.input_ids.shape)}")
        for data, traj in zip(prompts, results):
            if traj is None:
                print(f"   {data['messages'][0]['content']}: dropped (fewer than two usable samples)")
                continue
            assert traj.original_rewards is not None and traj.rewards is not None
            raw = " ".join(f"{r:.1f}" for r in traj.original_rewards.tolist())
            adv = " ".join(f"{r:+.2f}" for r in traj.rewards.tolist())
            print(f"   {data['messages'][0]['content']}  rewards [{raw}]\n{'':17}advantages [{adv}]")

        # 2. A rejected sample: the group is kept with G - 1 rows.
        traj = await run_group(picky, engine, question(2, 3), group_size, reward_normalization=True)
        assert isinstance(traj, Trajectory)
        print(f"2. slot 0 returned None: the group kept {traj.batch_size} of {group_size} rows")

        # 3. A failing slot: its siblings are cancelled and the group raises.
        long_answer = GenerationConfig(max_new_tokens=1000, temperature=1.0, ignore_eos=True)

        async def flaky_long(engine: LocalEngine, data: Any) -> Trajectory:
            """Slot 1 fails once its siblings are generating (1000 tokens each)."""
            if workflow_context.get().sample_idx == 1:
                with trio.fail_after(30):  # every wait has a deadline
                    while len(engine.statistics().live_rids) < group_size - 1:
                        await trio.sleep(0.01)
                raise VerifierDown("the verifier service is unreachable")
            prompt = tokenizer.apply_chat_template(data["messages"], add_generation_prompt=True, return_dict=False)
            resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=long_answer))
            return Trajectory.from_response(resp, 0.0)

        tokens_before = engine.statistics().generated_tokens
        try:
            await run_group(flaky_long, engine, question(1, 1), group_size)
        except* VerifierDown as eg:
            error = eg.exceptions[0]
            print(f"3. the group raised {type(eg).__name__}: {error!r}, note {error.__notes__}")
        stats = engine.statistics()
        spent = stats.generated_tokens - tokens_before
        print(
            f"   its {group_size - 1} siblings were cancelled after {spent} tokens "
            f"(of {(group_size - 1) * 1000} asked for); requests left in the engine: {len(stats.live_rids)}"
        )
    return batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args(argv)
    trio.run(main_async, args.groups, args.group_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
