"""The group properties (merging, rollout-time normalization, leave-one-out) through
RemoteEngine against a real vLLM server: the same engine client a GPU deployment uses.

The server is the session's (tests/vllm_server.py: ROLLOUT_TRIO_VLLM_URL, else one started
from bench/.vllm-venv); skipped when neither is there. Each slot records the response the
server gave it, so the properties compare the merged batch with what vLLM answered, with no
assumption that sampling repeats.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio import (
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    NormConfig,
    Trajectory,
    normalize_rewards,
    run_group,
    workflow_context,
)
from rollout_trio.engines import RemoteEngine
from rollout_trio.workflow_context import StatsRecorder

from .vllm_server import SKIP_REASON
from .vllm_server import available as vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason=SKIP_REASON)]

PROMPT = [1, 2, 3]
GCONFIG = GenerationConfig(max_new_tokens=4, temperature=1.0)
# Rewards are multiples of 1/4 (exact in binary), so the oracles below are exact.
REWARDS = st.integers(-40, 40).map(lambda v: v / 4)
# A live server answers each example in tens of milliseconds: 25 examples per property.
LIVE = settings(max_examples=25, deadline=None)

URL = ""


@pytest.fixture(scope="module", autouse=True)
def _url(vllm_url: str) -> None:
    global URL
    URL = vllm_url


def recording(rewards: list[float | None], seen: dict[int, ModelResponse]):  # type: ignore[no-untyped-def]
    """A workflow whose slot i generates once, records vLLM's answer, and returns it with
    reward ``rewards[i]`` (None: the slot rejects its sample)."""

    async def wf(engine, data):  # type: ignore[no-untyped-def]
        i = workflow_context.get().sample_idx
        resp = await engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=GCONFIG))
        seen[i] = resp
        return None if rewards[i] is None else Trajectory.from_response(resp, reward=rewards[i])

    return wf


async def live_group(rewards: list[float | None], **options: object) -> tuple[Trajectory | None, dict[int, ModelResponse], int]:
    """One group on the live server: the merged trajectory, each slot's answer, the engine's version."""
    seen: dict[int, ModelResponse] = {}
    with trio.fail_after(120):  # a guard against a hung server, not a timing assertion
        async with RemoteEngine(URL, "vllm", seed=0, setup_timeout=60, vllm_reload_path=None) as eng:
            out = await run_group(recording(rewards, seen), eng, {}, len(rewards), stats=StatsRecorder(), **options)
            return out, seen, eng.get_version()


def oracle(refs: list[float], use_std: bool) -> list[float]:
    """Rollout-time group normalization in Python floats: (r - mean) / (pstdev + 1e-8), the
    divisor 1 without the std or when the std is <= 1e-8."""
    mean = math.fsum(refs) / len(refs)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in refs) / len(refs))
    divisor = 1.0 if not use_std or std <= 1e-8 else std + 1e-8
    return [(r - mean) / divisor for r in refs]


@LIVE
@given(st.lists(st.none() | REWARDS, min_size=1, max_size=6))
async def test_vllm_merge_keeps_each_usable_slot_once_in_slot_order(rewards: list[float | None]) -> None:
    """Through RemoteEngine on vLLM: one row per usable slot, in slot order, each row the
    prompt and that slot's own answer (tokens and logprobs), versions the server's where
    loss_mask is 1 and -1 elsewhere, and each row's reward its slot's."""
    out, seen, version = await live_group(rewards)
    usable = [i for i, r in enumerate(rewards) if r is not None]
    assert sorted(seen) == list(range(len(rewards)))  # every slot ran once
    if not usable:
        assert out is None
        return
    assert out is not None and out.batch_size == len(usable)
    assert out.rollout_group.row_counts == (1,) * len(usable)
    for row, i in enumerate(usable):
        resp = seen[i]
        n = len(PROMPT) + resp.output_len
        assert out.input_ids[row, :n].tolist() == [*PROMPT, *resp.output_tokens]
        assert int(out.attention_mask[row].sum()) == n
        assert out.logprobs[row, len(PROMPT) : n].tolist() == pytest.approx(list(resp.output_logprobs), abs=1e-6)
        assert float(out.rewards[row]) == rewards[i]
    assert bool((out.versions[out.loss_mask == 0] == -1).all())
    assert bool((out.versions[out.loss_mask == 1] == version).all())


@LIVE
@given(st.integers(2, 6).flatmap(lambda g: st.lists(REWARDS, min_size=g, max_size=g)), st.booleans())
async def test_vllm_group_rewards_normalize_to_the_oracle(rewards: list[float], use_std: bool) -> None:
    """With reward_normalization on, a vLLM group's rewards are the oracle's (r - mean) /
    (std + 1e-8) of its slots' rewards, and its original rewards are kept unchanged."""
    out, _, _ = await live_group(list(rewards), reward_normalization=True, reward_normalization_use_std=use_std)
    assert out is not None
    assert out.original_rewards.tolist() == rewards
    assert out.rewards.tolist() == pytest.approx(oracle(rewards, use_std), rel=1e-5, abs=1e-5)


@LIVE
@given(st.lists(st.integers(1, 4).flatmap(lambda g: st.lists(REWARDS, min_size=g, max_size=g)), min_size=1, max_size=3))
async def test_vllm_leave_one_out_baseline_is_the_mean_of_the_other_rollouts(groups: list[list[float]]) -> None:
    """Groups generated on vLLM, then normalized with a group leave-one-out baseline: each
    row's reward minus the mean of the other rollouts of its group (itself when alone)."""
    trajectories = []
    for rewards in groups:
        out, _, _ = await live_group(list(rewards))
        assert out is not None
        trajectories.append(out)
    x = torch.cat([t.rewards.to(torch.float64) for t in trajectories])
    cfg = NormConfig(mean_level="group", std_level=None, leave_one_out=True)
    got = iter(normalize_rewards(x, cfg, rollout_groups=[t.rollout_group for t in trajectories]).tolist())
    for rewards in groups:
        for k, r in enumerate(rewards):
            others = [v for j, v in enumerate(rewards) if j != k]
            baseline = statistics.fmean(others) if others else r
            assert next(got) == pytest.approx(r - baseline, abs=1e-6)
