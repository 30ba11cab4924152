"""VisionRLVRWorkflow on LocalEngine with the tiny VLM: rows, shared preprocessing, bad images."""

from __future__ import annotations

import pytest
import torch
import trio

import rollout_trio
from rollout_trio import (
    GenerationConfig,
    ImageInputError,
    Trajectory,
    VisionRLVRWorkflow,
    check_trajectory_format,
    run_group,
    workflow_context,
)
from rollout_trio.engines import LocalEngine
from rollout_trio.workflow_context import WorkflowContext
from tests.vision_helpers import colour_reward, counting_processor, device, image, messages, png, vlm

torch.set_num_threads(1)
GCONFIG = GenerationConfig(max_new_tokens=4, temperature=1.0)


def task(colour="r", **extra):
    return {"messages": messages(), "images": [image(colour)], "answer": colour, **extra}


@pytest.fixture(scope="module")
def model():
    return vlm()[0].to(device())


def as_traj(result):
    return result if isinstance(result, Trajectory) else Trajectory.from_dict(result)


async def test_one_episode_is_a_checked_row_with_its_images(model) -> None:
    seen = []

    def reward(prompt, completions, prompt_ids, completion_ids, **data):
        seen.append((completions, data))
        return 1.0

    processor = vlm()[1]
    wf = VisionRLVRWorkflow(reward, GCONFIG, processor=processor)
    async with LocalEngine(model, processor.tokenizer) as engine:
        with workflow_context.use(WorkflowContext(task_id=0)):
            row = await wf.arun_episode(engine, task("g"))
    assert check_trajectory_format(row, batch_size=1)
    (mm,) = row.extras["multi_modal_input"]
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]] and mm["pixel_values"].shape == (16, 1176)
    types = row.extras["mm_token_type_ids"][0]
    assert int(types.sum()) == 4 and int((row.loss_mask[0] * types).sum()) == 0  # placeholders carry no loss
    (completion, data), = seen
    assert completion == processor.tokenizer.decode(row.input_ids[0, row.loss_mask[0].bool()].tolist())
    assert data["answer"] == "g" and data["images"][0].size == (56, 56)


@pytest.mark.parametrize("group_size", [1, 3, 8])
async def test_a_group_preprocesses_its_image_once_and_its_slots_share_the_tensors(model, group_size) -> None:
    processor = counting_processor()
    type(processor).calls = 0
    wf = VisionRLVRWorkflow(colour_reward, GCONFIG, processor=processor)
    async with LocalEngine(model, processor.tokenizer) as engine:
        result = as_traj(await run_group(wf, engine, task("b"), group_size))
    assert type(processor).calls == 1
    mms = result.extras["multi_modal_input"]
    assert len(mms) == result.batch_size == group_size
    assert all(m["pixel_values"] is mms[0]["pixel_values"] for m in mms)  # one tensor, G references


async def test_two_groups_with_different_images_keep_theirs(model) -> None:
    processor = counting_processor()
    type(processor).calls = 0
    wf = VisionRLVRWorkflow(colour_reward, GCONFIG, processor=processor)
    async with LocalEngine(model, processor.tokenizer) as engine:
        results = {}

        async def one(colour, size):
            results[colour] = as_traj(await run_group(wf, engine, {**task(colour), "images": [png(image(colour, size))]}, 3))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "r", (56, 56))
            nursery.start_soon(one, "b", (112, 112))
    assert type(processor).calls == 2
    assert results["r"].extras["multi_modal_input"][0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert results["b"].extras["multi_modal_input"][2]["image_grid_thw"].tolist() == [[1, 8, 8]]


async def test_a_bad_image_fails_its_group_with_the_rule_and_other_groups_finish(model) -> None:
    processor = vlm()[1]
    wf = VisionRLVRWorkflow(colour_reward, GCONFIG, processor=processor, max_image_pixels=100 * 100)
    outcomes = {}
    async with LocalEngine(model, processor.tokenizer) as engine:

        async def one(name, data):
            try:
                outcomes[name] = as_traj(await run_group(wf, engine, data, 2))
            except* ImageInputError as group:
                outcomes[name] = group.exceptions[0]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "truncated", {**task(), "images": [png(image("r"))[:50]]})
            nursery.start_soon(one, "huge", {**task(), "images": [image("r", (200, 200))]})
            nursery.start_soon(one, "extra", {**task(), "images": [image("r"), image("g")]})
            nursery.start_soon(one, "good", task("g"))
    assert outcomes["truncated"].rule == "decodable"
    assert outcomes["huge"].rule == "pixel budget"
    assert outcomes["extra"].rule == "placeholders" and "2 images but the prompt holds 1" in str(outcomes["extra"])
    assert outcomes["good"].batch_size == 2


async def test_areal_positional_arguments_and_a_rendered_prompt(model) -> None:
    processor = vlm()[1]
    wf = VisionRLVRWorkflow(colour_reward, GCONFIG, processor.tokenizer, processor, False)
    rendered = processor.apply_chat_template(messages(), add_generation_prompt=True, tokenize=False)
    async with LocalEngine(model, processor.tokenizer) as engine:
        with workflow_context.use(WorkflowContext(task_id=0)):
            row = await wf.arun_episode(engine, {"messages": rendered, "images": image("r"), "answer": "r"})
    assert check_trajectory_format(row, batch_size=1)


def test_exported_from_the_root_and_workflows_and_a_processor_is_required() -> None:
    assert rollout_trio.VisionRLVRWorkflow is rollout_trio.workflows.VisionRLVRWorkflow
    with pytest.raises(ValueError, match="processor: required"):
        VisionRLVRWorkflow(colour_reward, GCONFIG, tokenizer=vlm()[1].tokenizer)


async def test_a_completion_holding_the_image_placeholder_is_rejected_and_counted() -> None:
    from rollout_trio.models_vision import tiny_vlm
    from rollout_trio.workflow_context import StatsRecorder

    model, processor = tiny_vlm(transitions={ord("\n"): {261: 30.0}})  # always answers <|image_pad|>
    wf = VisionRLVRWorkflow(colour_reward, GCONFIG, processor=processor)
    stats = StatsRecorder()
    async with LocalEngine(model, processor.tokenizer) as engine:
        with workflow_context.use_stats_recorder(stats), workflow_context.use(WorkflowContext(task_id=0)):
            assert await wf.arun_episode(engine, task("r")) is None
    assert any("vision/placeholder_generated" in key for key in stats.summaries())
