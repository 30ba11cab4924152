"""GRPO on images: the tiny VLM learns to name the colour of a generated image, on CPU.

What it shows:

* :class:`~rollout_trio.VisionRLVRWorkflow` on a :class:`~rollout_trio.engines.LocalEngine`
  serving an image-text-to-text model (the tiny Qwen2-VL of
  :mod:`rollout_trio.models_vision`, built in code);
* a group's slots share one preprocessing of their image (the processor runs once per
  group whatever ``--group-size`` is), and each row carries its image tensors under
  ``multi_modal_input``;
* the trainer's forward pass takes those tensors back (``pixel_values`` and
  ``image_grid_thw`` joined in row order) and the new weights go to the engine with
  ``update_weights`` after every step.

The task: a solid image in a random shade of red, green or blue; the prompt asks for the
colour and the answer is one letter (``r``, ``g`` or ``b``), rewarded 1 when right. The
untrained model answers about uniformly (mean reward about 0.3, greedy accuracy 0.37 on
the evaluation images); in 60 steps it learns to read the colour from the image: the mean
reward reaches 0.8-1.0 and the greedy accuracy 0.6-1.0 (seeds 0-3; seeds 0-2 end at 0.97-1.0).

Run it (under a minute on two CPU cores)::

    python examples/vision_grpo.py --steps 60 --seed 0 --out-dir /tmp/vision_grpo

It prints one line per step and writes ``reward_curve.csv`` in ``--out-dir``;
``--device cuda`` runs the same loop on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import csv
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import trio
from PIL import Image

from rollout_trio import GenerationConfig, Trajectory, VisionRLVRWorkflow, concat_trajectories, run_group
from rollout_trio.engines import LocalEngine
from rollout_trio.models_vision import tiny_vlm

COLOURS = {"r": (200, 30, 30), "g": (30, 190, 40), "b": (30, 40, 210)}
QUESTION = "Which colour is this image? Answer r, g or b."


def colour_task(rng: random.Random) -> dict[str, Any]:
    """One task: a 56x56 image in a random shade of one colour, and its letter."""
    answer = rng.choice(sorted(COLOURS))
    shade = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLOURS[answer])
    img = Image.new("RGB", (56, 56), shade)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return {"messages": messages, "images": [img], "answer": answer}


def colour_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], answer: str, **data: Any) -> float:
    """1.0 when the completion's first letter is the image's colour."""
    return float(completion.strip()[:1] == answer)


def grpo_loss(model: Any, batch: Trajectory, *, clip: float = 0.2) -> torch.Tensor:
    """The clipped GRPO surrogate over the completion tokens, the images fed back in."""
    device = next(model.parameters()).device
    ids = batch.input_ids.to(device=device, dtype=torch.long)
    attn = batch.attention_mask.to(device).long()
    mms = batch.extras["multi_modal_input"]
    pixels = torch.cat([m["pixel_values"] for m in mms]).to(device)
    grid = torch.cat([m["image_grid_thw"] for m in mms]).to(device)
    types = batch.extras["mm_token_type_ids"].to(device)
    assert batch.loss_mask is not None and batch.logprobs is not None and batch.rewards is not None
    mask = batch.loss_mask[:, 1:].to(device=device, dtype=torch.float32)
    old = batch.logprobs[:, 1:].to(device)
    adv = batch.rewards.to(device=device, dtype=torch.float32)[:, None]
    model.model.rope_deltas = None  # positions from this batch's images, not a cached generate's
    logits = model(input_ids=ids, attention_mask=attn, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types).logits
    new = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(new - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1.0)


async def evaluate(workflow: VisionRLVRWorkflow, engine: LocalEngine, tasks: list[dict[str, Any]]) -> float:
    """Greedy accuracy over ``tasks``."""
    greedy = VisionRLVRWorkflow(colour_reward, GenerationConfig(max_new_tokens=2, greedy=True), processor=workflow.processor)
    rewards: list[float] = []

    async def one(data: dict[str, Any]) -> None:
        row = await greedy.arun_episode(engine, data)
        assert row.rewards is not None
        rewards.append(float(row.rewards[0]))

    async with trio.open_nursery() as nursery:
        for data in tasks:
            nursery.start_soon(one, data)
    return sum(rewards) / len(rewards)


async def train(args: argparse.Namespace) -> list[dict[str, float]]:
    """The training loop; returns one record per step, then the final greedy accuracy
    (the first line printed is the untrained model's)."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, processor = tiny_vlm(device=args.device)  # fixed weights; --seed draws the tasks and samples
    trainer_model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(trainer_model.parameters(), lr=args.lr, weight_decay=0.0)
    workflow = VisionRLVRWorkflow(colour_reward, GenerationConfig(max_new_tokens=2, temperature=1.0), processor=processor)
    eval_tasks = [colour_task(random.Random(10_000 + i)) for i in range(30)]
    curve: list[dict[str, float]] = []
    async with LocalEngine(model, processor.tokenizer, seed=args.seed) as engine:
        print(f"step 0: greedy accuracy {await evaluate(workflow, engine, eval_tasks):.2f}", flush=True)
        for step in range(1, args.steps + 1):
            tasks = [colour_task(rng) for _ in range(args.groups)]
            groups: list[Any] = [None] * len(tasks)

            async def one(i: int) -> None:
                groups[i] = await run_group(workflow, engine, tasks[i], args.group_size, reward_normalization=True)

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(len(tasks)):
                    nursery.start_soon(one, i)
            batch = concat_trajectories([g for g in groups if g is not None])  # a group can reject every answer
            raw = batch.original_rewards if batch.original_rewards is not None else batch.rewards
            assert raw is not None
            mean = float(raw.float().mean())

            def step_once() -> float:
                optimizer.zero_grad(set_to_none=True)
                loss = grpo_loss(trainer_model, batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainer_model.parameters(), 1.0)
                optimizer.step()
                return float(loss.detach())

            loss = await trio.to_thread.run_sync(step_once)
            state = {k: v.detach().clone() for k, v in trainer_model.state_dict().items()}
            await engine.update_weights(state, step)
            curve.append({"step": step, "mean_reward": mean, "loss": loss})
            print(f"step {step}: mean reward {mean:.2f} loss {loss:+.3f} ({time.perf_counter() - start:.1f}s)", flush=True)
        final = await evaluate(workflow, engine, eval_tasks)
        print(f"step {args.steps}: greedy accuracy {final:.2f}", flush=True)
        curve.append({"step": args.steps, "mean_reward": final, "loss": float("nan")})
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--groups", type=int, default=12, help="images (groups) per step")
    p.add_argument("--group-size", type=int, default=8, help="answers per image")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    curve = trio.run(train, args)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "reward_curve.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", "mean_reward", "loss"])
            writer.writeheader()
            writer.writerows(curve[:-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
