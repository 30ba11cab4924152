"""examples/vision_grpo.py: the tiny VLM's reward on the colour task really rises, on CPU."""

from __future__ import annotations

import argparse
import csv

from tests.test_examples import load_example


async def test_vision_grpo_learns_the_colour_from_the_image(tmp_path) -> None:
    example = load_example("vision_grpo")
    args = argparse.Namespace(steps=30, groups=12, group_size=8, lr=3e-4, seed=1, device="cpu", out_dir=None)
    curve = await example.train(args)
    steps, final = curve[:-1], curve[-1]["mean_reward"]
    first = sum(r["mean_reward"] for r in steps[:5]) / 5
    last = sum(r["mean_reward"] for r in steps[-5:]) / 5
    assert first < 0.5 and last > first + 0.3, steps
    assert final > 0.6  # greedy accuracy on held-out images (0.37 untrained)


def test_vision_grpo_main_writes_the_curve(tmp_path) -> None:
    example = load_example("vision_grpo")
    assert example.main(["--steps", "2", "--groups", "2", "--group-size", "2", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "reward_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]
