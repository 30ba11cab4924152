"""Builders shared by the group tests (the `I(r)` and `traj(t)` of spec/group.md §14)."""

import torch

from rollout_trio import Interaction, ModelResponse, Trajectory


def I(reward, *, rollout_reward=None, cache_rewards=None, cache_dtype=torch.float32):  # noqa: E743 - the spec's name
    """An interaction with a one-row cache: input_ids [[1,2]], loss_mask [[0,1]], rewards [r]."""
    rows = 1 if cache_rewards is None else len(cache_rewards)
    cache = Trajectory(
        input_ids=torch.tensor([[1, 2]] * rows),
        attention_mask=torch.ones(rows, 2, dtype=torch.bool),
        loss_mask=torch.tensor([[0, 1]] * rows),
        rewards=torch.tensor(cache_rewards if cache_rewards is not None else [0.0 if reward is None else reward], dtype=cache_dtype),
    )
    resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-0.5], output_versions=[0])
    return Interaction(model_response=resp, reward=reward, rollout_reward=rollout_reward, cache=cache)


def traj(t):
    """{input_ids [[t]], attention_mask [[True]]}."""
    return {"input_ids": torch.tensor([[t]]), "attention_mask": torch.tensor([[True]])}


def scripted(results):
    """A workflow whose slot i returns results[i] (a value, or an exception to raise)."""
    calls = []

    async def workflow(engine, data):
        from rollout_trio import workflow_context

        i = workflow_context.get().sample_idx
        calls.append(i)
        r = results[i]
        if isinstance(r, BaseException):
            raise r
        return r

    workflow.calls = calls
    return workflow


def assert_same_trajectory(a: Trajectory, b: Trajectory) -> None:
    """The same keys, and each value equal: tensors in dtype, shape and every element."""
    da, db = a.to_dict(), b.to_dict()
    assert set(da) == set(db)
    for key, va in da.items():
        vb = db[key]
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.shape == vb.shape and torch.equal(va, vb), key
        else:
            assert va == vb, key
