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


def generate_row(colour: str = "r", size: tuple[int, int] = (56, 56), reward: float | None = None, max_new_tokens: int = 3, mm=None):
    """One vision training row: the tiny VLM's greedy answer to a coloured image, packed as
    the vision workflow packs it (``multi_modal_input`` and ``mm_token_type_ids``)."""
    import torch

    from rollout_trio import ModelResponse, Trajectory

    model, processor = vlm()
    out = processed(processor, [image(colour, size)])
    with torch.no_grad():
        gen = model.generate(**out, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True)
    prompt = out["input_ids"][0].tolist()
    new = gen.sequences[0, len(prompt):].tolist()
    lps = [float(s.log_softmax(-1)[0, t]) for s, t in zip(gen.scores, new)]
    resp = ModelResponse(input_tokens=prompt, output_tokens=new, output_logprobs=lps, output_versions=[0] * len(new))
    types = torch.tensor([out["mm_token_type_ids"][0].tolist() + [0] * len(new)])
    if mm is None:
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    r = float(chr(new[0]) == colour) if reward is None else reward
    return Trajectory.from_response(resp, r, multi_modal_input=[mm], mm_token_type_ids=types)


def device() -> str:
    """Where the vision engine tests run: CUDA where present (``ROLLOUT_TRIO_TEST_DEVICE`` overrides)."""
    import os

    import torch

    return os.environ.get("ROLLOUT_TRIO_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def reference(model, processor, images, max_new_tokens: int):
    """``(tokens, logprobs)`` of greedy decoding by full forward passes of the model (no KV
    cache, positions computed by the model itself): the oracle the engine is held to."""
    import torch

    out = processed(processor, images).to(model.device)
    ids, types = out["input_ids"], out["mm_token_type_ids"]
    extra = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            model.model.rope_deltas = None
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **extra).logits[0, -1]
            lp = logits.float().log_softmax(-1)
            t = int(lp.argmax())
            tokens.append(t)
            logprobs.append(float(lp[t]))
            ids = torch.cat([ids, ids.new_tensor([[t]])], dim=1)
            types = torch.cat([types, types.new_zeros((1, 1))], dim=1)
    return tokens, logprobs


def counting_processor():
    """The tiny VLM's real processor, counting its calls (how often a prompt was preprocessed)."""
    from rollout_trio.models_vision import ImageOnlyProcessor

    class CountingProcessor(ImageOnlyProcessor):
        calls = 0

        def __call__(self, *args, **kwargs):
            type(self).calls += 1
            return super().__call__(*args, **kwargs)

    _, processor = vlm()
    return CountingProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer)


def colour_reward(prompt, completions, prompt_ids, completion_ids, answer, **data):
    """1.0 when the completion starts with the image's colour letter."""
    return float(completions.strip().startswith(answer))
