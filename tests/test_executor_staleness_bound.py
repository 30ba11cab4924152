"""``max_head_offpolicyness`` bounds every consumed trajectory (issue 17 item 6), and the
price of the policy: stale trajectories are dropped, which favours short ones."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest
import trio
import trio.testing

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, workflow_context
from rollout_trio.executor import TaskOutcome, open_executor
from rollout_trio.testing import ScriptedEngine

GC = GenerationConfig(max_new_tokens=4)


async def segments(engine: Any, steps: int) -> Trajectory:
    """``steps`` generations of 4 tokens, each labelled with the version at its answer:
    a long episode spans version bumps, like a long generation on a real server."""
    ids: list[int] = [1]
    versions: list[int] = []
    for _ in range(steps):
        resp = await engine.agenerate(ModelRequest(input_ids=ids[-1:], gconfig=GC))
        ids.extend(resp.output_tokens)
        versions.extend(resp.output_versions)
    import torch

    n = len(ids)
    return Trajectory.from_dict({
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "loss_mask": torch.tensor([[0] + [1] * (n - 1)]),
        "versions": torch.tensor([[-1, *versions]]),
        "rewards": torch.tensor([float(workflow_context.get().task_id or 0)]),
    })  # fmt: skip


def output_len(traj: Trajectory) -> int:
    assert traj.loss_mask is not None
    return int(traj.loss_mask.sum())


async def train(*, s: int, steps: int, dynamic_bs: bool, accept_some: bool) -> tuple[list[int], list[int], list[int], Any]:
    """A trainer loop: prepare_batch, bump. Returns (lags at consumption, consumed lengths,
    generated lengths, final statistics)."""
    lengths = random.Random(0)
    source = [lengths.choice([1, 1, 1, 12]) for _ in range(200)]  # mostly short, some 12x longer
    generated: list[int] = []
    lags: list[int] = []
    consumed: list[int] = []

    def on_end(outcome: TaskOutcome) -> None:
        if outcome.status == "accepted":
            assert isinstance(outcome.trajectory, Trajectory)
            generated.append(output_len(outcome.trajectory))

    def accept(traj: Trajectory) -> bool:  # a filter: every fourth task is rejected
        assert traj.rewards is not None
        return int(traj.rewards[0]) % 4 != 1

    async with ScriptedEngine(delay=1) as engine:
        config = {"consumer_batch_size": 4, "max_concurrent_rollouts": 8, "max_head_offpolicyness": s}
        async with open_executor(engine, **config) as ex:
            for _ in range(steps):
                batch = await ex.prepare_batch(
                    source, segments, batch_size=4, dynamic_bs=dynamic_bs, callback=on_end,
                    should_accept_fn=accept if accept_some else None, progress=False,
                )  # fmt: skip
                now = engine.get_version()  # no checkpoint since the call returned: its instant
                for traj in batch:
                    assert traj.versions is not None
                    lags.append(now - int(traj.versions[traj.versions >= 0].min()))
                    consumed.append(output_len(traj))
                await trio.sleep(3)  # the trainer's step; generation goes on meanwhile
                ex.set_version(now + 1)
            stats = ex.statistics()
    return lags, consumed, generated, stats


@pytest.mark.parametrize(("s", "dynamic_bs", "accept_some"), [(1, False, False), (2, False, False), (0, True, True)])
async def test_no_consumed_trajectory_is_more_than_s_versions_behind(
    s: int, dynamic_bs: bool, accept_some: bool, autojump_clock: trio.testing.MockClock
) -> None:
    lags, consumed, _, stats = await train(s=s, steps=25, dynamic_bs=dynamic_bs, accept_some=accept_some)
    assert len(consumed) >= 25
    assert max(lags) <= s, sorted(lags)[-5:]
    assert stats.stale > 0  # the bound had work to do: without it these would have been consumed
    assert stats.balanced()


async def test_dropping_stale_trajectories_biases_the_batch_towards_short_ones(autojump_clock: trio.testing.MockClock) -> None:
    """The documented price of the policy (README, "Staleness"): a long generation spans
    more version bumps, so it is more often too old when its turn comes and is dropped.
    The consumed length distribution is shorter than the generated one."""
    _, consumed, generated, stats = await train(s=1, steps=40, dynamic_bs=False, accept_some=False)
    long_share = lambda xs: sum(x > 4 for x in xs) / len(xs)  # noqa: E731
    assert stats.stale > 0
    assert statistics.mean(consumed) < statistics.mean(generated)
    assert long_share(consumed) < long_share(generated)
