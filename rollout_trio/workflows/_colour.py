"""The vision toy task: name the colour of a generated image (``r``, ``g`` or ``b``).

What the built-in tiny VLM (:func:`rollout_trio.models_vision.tiny_vlm`) answers: its
untrained guesses are about uniform over the three letters, so rewards vary within a group.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["COLOUR_QUESTION", "colour_prompts", "colour_reward"]

COLOUR_QUESTION = "Which colour is this image? Answer r, g or b."
_COLOURS = {"r": (200, 30, 30), "g": (30, 190, 40), "b": (30, 40, 210)}


def colour_prompts(n: int, *, seed: int = 0, size: tuple[int, int] = (56, 56)) -> list[dict[str, Any]]:
    """``n`` tasks: a solid image in a random shade of red, green or blue, and its letter.

    Each is ``{"messages": [...], "images": [PIL image], "answer": letter}`` (the user
    message holds one ``{"type": "image"}`` part and the question).
    """
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        answer = rng.choice(sorted(_COLOURS))
        shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in _COLOURS[answer])
        content = [{"type": "image"}, {"type": "text", "text": COLOUR_QUESTION}]
        out.append({"messages": [{"role": "user", "content": content}], "images": [Image.new("RGB", size, shade)], "answer": answer})
    return out


def colour_reward(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int], answer: str, **data: Any) -> float:
    """1.0 when the completion's first letter is the image's colour, else 0.0."""
    return float(completions.strip()[:1] == answer)
