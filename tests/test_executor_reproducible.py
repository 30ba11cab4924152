"""A seeded run is reproducible bit for bit: ``examples/train_grpo.py --seed`` (issue 17's
determinism paragraph) trains on the same batches and draws the same curve twice."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import attrs
import trio

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_grpo.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_grpo_reproducible", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_train_grpo_with_a_seed_draws_the_same_curve_twice() -> None:
    grpo = load()

    async def run() -> tuple[list[dict[str, object]], float]:
        result = await grpo.train(
            steps=3, groups_per_batch=4, group_size=4, seed=3, reproducible=True, eval_prompts=4, eval_samples=1,
            log=lambda *_: None,
        )  # fmt: skip
        curve = [attrs.asdict(r, filter=lambda a, _: a.name != "seconds") for r in result.steps]
        return curve, result.eval_after

    with trio.fail_after(100):
        first = await run()
        assert first == await run()
    curve, _ = first
    assert [r["version"] for r in curve] == [0, 1, 2]
    assert all(r["min_token_version"] == r["max_token_version"] == r["version"] for r in curve)  # on-policy
