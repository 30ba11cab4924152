"""A real dump to inspect and replay: the main job's RLVR groups on the tiny model, over several versions."""

from __future__ import annotations

from pathlib import Path

import trio

from rollout_trio import GenerationConfig, run_group
from rollout_trio.workflows import arithmetic_prompts, arithmetic_reward
from rollout_trio.engines import LocalEngine
from rollout_trio.executor import TrajectoryDumper
from rollout_trio.models import tiny_model
from rollout_trio.workflow_context import StatsRecorder
from rollout_trio.workflows import rlvr_workflow

MAX_NEW_TOKENS = 6


async def write_arithmetic_dump(
    root: Path, *, groups: int = 6, group_size: int = 4, versions: int = 3, seed: int = 0, normalize: bool = False
) -> list[dict]:
    """Dump ``groups`` arithmetic groups (task id = prompt index, as the main job numbers them),
    spread over ``versions`` weight versions; returns the prompts."""
    prompts = arithmetic_prompts(groups, seed=seed)
    model, tok = tiny_model(seed=seed)
    workflow = rlvr_workflow(tok, arithmetic_reward, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0))
    async with LocalEngine(model, tok, seed=seed) as engine, TrajectoryDumper(root, "exp", "trial", tok) as dumper:
        for k, data in enumerate(prompts):
            engine.set_version(k * versions // groups)
            traj = await run_group(
                workflow, engine, data, group_size, stats=StatsRecorder(), reward_normalization=normalize
            )
            assert traj is not None
            await dumper.dump(traj, task_id=k, accepted=k % 5 != 4)
    assert dumper.statistics().dump_failed == 0
    return prompts


def write_dump_sync(root: Path, **kwargs) -> list[dict]:
    return trio.run(lambda: write_arithmetic_dump(root, **kwargs))
