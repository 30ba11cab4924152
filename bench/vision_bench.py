"""Vision rollouts: shared vs per-slot preprocessing, and LocalEngine's VLM decode vs generate.

a. episodes/s of groups of 8 slots sharing one image (a 448x448 PNG, as a dataset holds
   it): :class:`~rollout_trio.VisionRLVRWorkflow` (one decode + processor run per group,
   through the group's processor cache) against the same workflow preprocessing in every
   slot (what a workflow without the cache does). An instant engine answers, so the
   difference is the preprocessing.
b. tokens/s of :class:`~rollout_trio.engines.LocalEngine` serving the tiny VLM to 8
   concurrent image requests (continuous batching) against one static transformers
   ``generate`` batch of the same 8 prompts (left-padded), the same number of new tokens.

Both sides of each case alternate round by round in this process; printed: each side's
median over the rounds and the median ratio (> 1: the first side faster).

Run: python bench/vision_bench.py [--rounds R] [--groups N] [--new-tokens T]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from typing import Any

import torch
import trio
from PIL import Image

from rollout_trio import GenerationConfig, ModelRequest, VisionRLVRWorkflow, run_group
from rollout_trio.engines import LocalEngine
from rollout_trio.models_vision import ImageOnlyProcessor, tiny_image_processor, tiny_vlm
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflows._vision_rlvr import VisionInput, preprocess_vision

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour? r, g or b."}]}]


def reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    return float(completion[:1] == data["answer"])


class PerSlotVision(VisionRLVRWorkflow):
    """The same workflow, preprocessing in every slot (no shared cache)."""

    async def prepare(self, data: Any) -> VisionInput:
        images = list(self.data_extract_images_fn(data))
        return await trio.to_thread.run_sync(lambda: preprocess_vision(self.processor, data["messages"], images))


def png_image(seed: int, size: int = 448) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size, size, 3, generator=gen) * 255).to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


async def episodes_per_second(workflow: VisionRLVRWorkflow, groups: int, group_size: int) -> float:
    tasks = [{"messages": QUESTION, "images": [png_image(i)], "answer": "r"} for i in range(groups)]
    async with ScriptedEngine() as engine:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for data in tasks:
                nursery.start_soon(run_group, workflow, engine, data, group_size)
        return groups * group_size / (time.perf_counter() - start)


def engine_requests(processor: Any, new_tokens: int) -> tuple[list[ModelRequest], Any]:
    colours = [(200, 30, 30), (30, 190, 40), (30, 40, 210), (120, 120, 120)] * 2
    images = [Image.new("RGB", (56 + 28 * (i % 3), 56), c) for i, c in enumerate(colours)]
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    gconfig = GenerationConfig(max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    reqs = []
    for img in images:
        out = processor(images=[img], text=[text], return_tensors="pt")
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        reqs.append(ModelRequest(input_ids=out["input_ids"][0].tolist(), image_data=[img], processor=processor,
                                 multi_modal_input=mm, gconfig=gconfig))  # fmt: skip
    processor.tokenizer.padding_side = "left"
    batch = processor(images=images, text=[text] * len(images), padding=True, return_tensors="pt")
    return reqs, batch


async def engine_tokens_per_second(model: Any, processor: Any, reqs: list[ModelRequest]) -> float:
    async with LocalEngine(model, processor.tokenizer) as engine:
        total = 0

        async def one(r: ModelRequest) -> None:
            nonlocal total
            n = (await engine.agenerate(r)).output_len  # awaited first: `total += await ...` loses updates
            total += n

        for timed in (False, True):  # the first round warms the engine's thread and kernels up
            total = 0
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for r in reqs:
                    nursery.start_soon(one, r)
        return total / (time.perf_counter() - start)


def generate_tokens_per_second(model: Any, batch: Any, new_tokens: int) -> float:
    model.model.rope_deltas = None
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    produced = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return produced / (time.perf_counter() - start)


def report(name: str, ours: list[float], theirs: list[float], unit: str, labels: tuple[str, str]) -> None:
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    print(
        f"{name}: {labels[0]} {statistics.median(ours):.1f} {unit}, {labels[1]} {statistics.median(theirs):.1f} {unit}, "
        f"ratio {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tiny = tiny_vlm()
    processor = ImageOnlyProcessor(image_processor=tiny_image_processor(max_pixels=448 * 448), tokenizer=tiny.tokenizer)
    shared = VisionRLVRWorkflow(reward, GenerationConfig(max_new_tokens=4), processor=processor)
    per_slot = PerSlotVision(reward, GenerationConfig(max_new_tokens=4), processor=processor)
    a: list[float] = []
    b: list[float] = []
    for _ in range(args.rounds):
        a.append(trio.run(episodes_per_second, shared, args.groups, 8))
        b.append(trio.run(episodes_per_second, per_slot, args.groups, 8))
    report("a. group of 8 sharing one 448x448 image", a, b, "episodes/s", ("shared", "per-slot"))
    reqs, batch = engine_requests(tiny, args.new_tokens)
    c: list[float] = []
    d: list[float] = []
    generate_tokens_per_second(model, batch, args.new_tokens)  # warm-up, as the engine's first round
    for _ in range(args.rounds):
        c.append(trio.run(engine_tokens_per_second, model, tiny, reqs))
        d.append(generate_tokens_per_second(model, batch, args.new_tokens))
    report(f"b. 8 image requests x {args.new_tokens} tokens", c, d, "tokens/s", ("LocalEngine", "static generate"))


if __name__ == "__main__":
    main()
