"""Shared pieces of the vision tests: the tiny VLM (built once per process) and images."""

from __future__ import annotations

import functools
import io

from PIL import Image

from rollout_trio.models_vision import tiny_vlm

COLOURS = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (30, 40, 220)}


@functools.cache
def vlm():
    """``(model, processor)``, shared by the tests of one process (the model is not trained)."""
    return tiny_vlm()


def image(colour: str = "r", size: tuple[int, int] = (56, 56), mode: str = "RGB") -> Image.Image:
    img = Image.new("RGB", size, COLOURS[colour])
    return img if mode == "RGB" else img.convert(mode)


def png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def messages(n_images: int = 1, text: str = "Which colour? Answer r, g or b.") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(n_images)), {"type": "text", "text": text}]}]


def prompt_text(processor, n_images: int = 1) -> str:
    return processor.apply_chat_template(messages(n_images), add_generation_prompt=True, tokenize=False)


def processed(processor, images, n_images: int | None = None):
    """The processor's output for ``images`` under a prompt with ``n_images`` placeholders."""
    n = len(images) if n_images is None else n_images
    return processor(images=list(images) or None, text=[prompt_text(processor, n)], return_tensors="pt")
