"""Workflows and matchers shared by the executor's rule-by-rule tests."""

from __future__ import annotations

import re
from typing import Any

from rollout_trio import GenerationConfig, ModelRequest, Trajectory

GC = GenerationConfig(max_new_tokens=1)
DEADLINE = 600.0  # seconds: far more than any call of these tests needs (virtual under autojump_clock)


async def echo(engine: Any, data: Any) -> Trajectory:
    """One generation whose reward is the item (so results say which item they came from)."""
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GC))
    return Trajectory.from_response(resp, float(data))


async def scaled(engine: Any, data: Any, *, scale: float) -> Trajectory:
    """``echo`` with the reward multiplied by a workflow keyword."""
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GC))
    return Trajectory.from_response(resp, float(data) * scale)


def small_rewards_only(traj: Any) -> bool:
    """An acceptance check: rewards below 20."""
    return bool(float(traj.rewards.max()) < 20.0)


def whole(text: str) -> str:
    """A pattern ``pytest.raises(match=...)`` matches only against exactly ``text``."""
    return "^" + re.escape(text) + "$"
