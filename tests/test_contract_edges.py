"""Contract edge cases found with generated inputs (issue 11 items 1-3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from rollout_trio import (
    GroupedRolloutWorkflow,
    Interaction,
    ModelResponse,
    Trajectory,
    WorkflowContractError,
    run_group,
)
from rollout_trio._normalize import rollout_time_affine, rollout_time_apply
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder

from .group_helpers import I, scripted, traj


async def run(results, **options):
    return await run_group(scripted(results), ScriptedEngine(), {}, len(results), stats=StatsRecorder(), **options)


def bare(reward: float) -> Interaction:
    """An interaction without a cached tensor form."""
    resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-0.5], output_versions=[0])
    return Interaction(model_response=resp, reward=reward)


def row(reward: float, *, dtype=torch.float32, **changes) -> dict:
    d = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "versions": torch.tensor([[-1, 0, 0]]),
        "rewards": torch.tensor([reward], dtype=dtype),
    }
    d.update(changes)
    return d


# -- item 1: only None and {} are rejections ---------------------------------------------


BAD_RESULTS = {
    "multi-element tensor": torch.tensor([1.0, 2.0]),
    "numpy array": np.array([1, 2]),
    "0": 0,
    "0.0": 0.0,
    "False": False,
    "empty str": "",
    "empty list": [],
    "empty tuple": (),
}


@pytest.mark.parametrize("bad", BAD_RESULTS.values(), ids=BAD_RESULTS.keys())
async def test_a_non_trajectory_result_is_a_contract_error_naming_the_slot(bad) -> None:
    with pytest.raises(WorkflowContractError, match=r"^slot 1: a workflow must return a Trajectory, a dict or None"):
        await run([traj(1), bad, None])


async def test_none_and_empty_dict_are_the_only_rejections() -> None:
    rec = StatsRecorder()
    out = await run_group(scripted([traj(1), None, {}]), ScriptedEngine(), {}, 3, stats=rec)
    assert out.batch_size == 1
    assert rec.export()["rollout/usable_slot_count"] == 1


class HookedWorkflow:
    """Slot 1 returns a tensor at once; slot 0 raises once slot 1 has returned."""

    def __init__(self) -> None:
        self.returned = trio.Event()
        self.hook_calls = 0

    def record_group_metrics(self, data, rewards, group_size) -> None:
        self.hook_calls += 1

    async def arun_episode(self, engine, data):
        from rollout_trio import workflow_context

        if workflow_context.get().sample_idx == 1:
            self.returned.set()
            return torch.tensor([1.0, 2.0])
        await self.returned.wait()
        raise KeyError("slot 0 failed")


async def test_a_bad_result_never_replaces_a_sibling_failure() -> None:
    wf = HookedWorkflow()
    with pytest.RaisesGroup(pytest.RaisesExc(KeyError, match="slot 0 failed")):
        await GroupedRolloutWorkflow(wf, 2, stats=StatsRecorder()).arun_episode(ScriptedEngine(), {})
    assert wf.hook_calls == 0  # a tensor result is no interaction dict: the hook does not run


# -- item 2: versions, empty sequences, devices -------------------------------------------


async def test_a_version_on_a_prompt_token_is_a_contract_error() -> None:
    bad = row(1.0, versions=torch.tensor([[5, 0, 0]]))
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'versions': must be -1 wherever loss_mask is 0.*version 5"):
        await run([row(0.0), bad])
    with pytest.raises(WorkflowContractError, match="'versions'"):
        Trajectory.from_dict(row(0.0, versions=torch.tensor([[0, 0, 0]])))  # the reference's 0 padding


async def test_a_zero_length_sequence_is_rejected() -> None:
    empty = {k: v[:, :0] if v.ndim == 2 else v for k, v in row(1.0).items()}
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'input_ids': must hold at least one position .*0-length"):
        await run([row(0.0), empty])


def test_a_row_attending_nowhere_is_rejected() -> None:
    d = row(1.0)
    two = {k: torch.cat([v, v]) for k, v in d.items()}
    two["attention_mask"][1] = False
    two["loss_mask"][1] = 0
    two["versions"][1] = -1
    with pytest.raises(WorkflowContractError, match=r"'attention_mask': every row must attend .*row 1 with none"):
        Trajectory.from_dict(two)


async def test_a_tensor_on_another_device_names_the_key_and_slot() -> None:
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'loss_mask': must be on the same device as input_ids; expected cpu, got meta"):
        await run([row(0.0), row(1.0, loss_mask=torch.tensor([[0, 1, 1]], device="meta"))])


async def test_a_slot_on_another_device_names_the_slot() -> None:
    on_meta = {k: v.to("meta") for k, v in row(1.0).items()}
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'input_ids': every slot's tensors must be on one device"):
        await run([row(0.0), on_meta])


# -- item 3: normalization statistics in float64, rewards within float32 -------------------


@pytest.mark.parametrize("big", [1e20, 3e38])
async def test_huge_rewards_are_normalized_not_zeroed(big: float) -> None:
    a, b = I(big), I(-big)
    await run([{"a": a}, {"b": b}], reward_normalization=True)
    assert (a.reward, b.reward) == (pytest.approx(1.0), pytest.approx(-1.0))
    out = await run([row(big), row(-big)], reward_normalization=True)
    assert out.rewards.tolist() == [pytest.approx(1.0), pytest.approx(-1.0)]
    assert out.original_rewards.tolist() == [pytest.approx(big, rel=1e-6), pytest.approx(-big, rel=1e-6)]


def test_statistics_are_float64_returned_as_float32() -> None:
    # float32 arithmetic squares 1e20 to inf and the std to inf (so everything became 0).
    mean, scale = rollout_time_affine([1e20, -1e20, 3e20])
    assert mean.dtype == scale.dtype == torch.float32
    assert mean.item() == pytest.approx(1e20, rel=1e-6)
    assert scale.item() == pytest.approx(float(np.std([1e20, -1e20, 3e20])), rel=1e-6)
    assert rollout_time_apply(3e20, mean, scale).item() == pytest.approx(2 / np.std([1, -1, 3]), rel=1e-6)


async def test_a_reward_float32_cannot_hold_names_the_slot() -> None:
    with pytest.raises(WorkflowContractError, match=r"^slot 1: reward: must fit in float32"):
        await run([{"a": bare(1.0)}, {"b": bare(3.5e38)}], reward_normalization=True)
    with pytest.raises(WorkflowContractError, match=r"^slot 1: 'rewards': rewards must fit in float32"):
        await run([row(1.0), row(3.5e38, dtype=torch.float64)], reward_normalization=True)
    with pytest.raises(WorkflowContractError, match=r"^slot 0: 'rollout_reward': must fit in float32"):
        await run([row(1.0, rollout_reward=-1e39), row(0.0)])
