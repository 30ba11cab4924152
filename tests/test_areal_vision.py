"""AReaL 1.0.4's ``workflow/vision_rlvr.py`` runs unchanged under rollout_trio.compat.areal on
LocalEngine with the tiny VLM, single and grouped (issue 30)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from rollout_trio import Trajectory, check_trajectory_format, run_group, workflow_context
from rollout_trio.engines import LocalEngine
from rollout_trio.workflow_context import StatsRecorder, WorkflowContext
from tests.test_areal_compat import areal_sources, gconfig, hook  # noqa: F401 - fixtures
from tests.vision_helpers import colour_reward, image, prompt_text, vlm


def task(colour: str) -> dict:
    _, processor = vlm()
    # AReaL's vision datasets hand the workflow the rendered prompt and the PIL images.
    return {"messages": prompt_text(processor), "images": [image(colour)], "answer": colour}


async def test_vision_rlvr_file_runs_unchanged_single_and_grouped(hook) -> None:  # noqa: F811
    model, processor = vlm()
    vision = importlib.import_module("areal.workflow.vision_rlvr")
    assert Path(vision.__file__).is_relative_to(hook)  # AReaL's own file, not a copy
    wf = vision.VisionRLVRWorkflow(colour_reward, gconfig(max_new_tokens=3), processor.tokenizer, processor, False)
    stats = StatsRecorder()
    async with LocalEngine(model, processor.tokenizer) as engine:
        with workflow_context.use_stats_recorder(stats), workflow_context.use(WorkflowContext(task_id=0)):
            single = await wf.arun_episode(engine, task("g"))
            grouped = await run_group(wf, engine, task("b"), 3, stats=stats)
    assert check_trajectory_format(single, batch_size=1)
    (mm,) = single["multi_modal_input"]
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]] and mm["pixel_values"].shape == (16, 1176)
    assert int(single["mm_token_type_ids"].sum()) == 4
    completion = processor.tokenizer.decode(single["input_ids"][0][single["loss_mask"][0].bool()].tolist())
    assert single["rewards"].item() == float(completion.strip().startswith("g"))  # the reward saw this completion
    grouped = grouped if isinstance(grouped, Trajectory) else Trajectory.from_dict(grouped)
    assert grouped.batch_size == 3 and len(grouped.extras["multi_modal_input"]) == 3
    assert stats.summaries()["rollout/reward"].count == 4


def test_image2base64_is_areals(hook) -> None:  # noqa: F811
    from rollout_trio import ModelRequest

    utils_image = importlib.import_module("areal.utils.image")
    (encoded,) = utils_image.image2base64(image("r"))
    _, processor = vlm()
    from tests.vision_helpers import processed

    ids = processed(processor, [image("r")])["input_ids"][0].tolist()
    req = ModelRequest(input_ids=ids, image_data=[encoded], processor=processor)
    assert req.image_data[0].getpixel((3, 3)) == image("r").getpixel((3, 3))
    padded = utils_image.pad_images_batch_to_max_size([image("r"), image("g", (84, 56))])
    assert [p.size for p in padded] == [(84, 56), (84, 56)]
