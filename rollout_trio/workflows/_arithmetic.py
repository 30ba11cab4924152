"""The main job's toy task: single-digit addition with partial credit.

Small enough for the built-in tiny model, and graded so that its guesses give varied
rewards (what GRPO needs to learn anything).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["arithmetic_prompts", "arithmetic_reward"]


def arithmetic_prompts(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` single-digit addition questions whose answers are below 10."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        out.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"}], "answer": a + b})
    return out


def arithmetic_reward(completion: str, data: Mapping[str, Any]) -> float:
    """1.0 for the right number, partial credit ``1 - |error| / 10`` for a near miss, 0 otherwise.

    The partial credit keeps the reward informative for a tiny model that guesses.
    """
    match = re.search(r"-?\d+", completion)
    if match is None:
        return 0.0
    error = abs(int(match.group()) - int(data["answer"]))
    return max(0.0, 1.0 - error / 10.0)
