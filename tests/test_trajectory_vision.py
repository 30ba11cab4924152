"""Vision rows in the contract: multi_modal_input per row survives joining, padding,
normalization and splitting; a row whose image tokens do not match its pixel rows is refused."""

from __future__ import annotations

import pytest
import torch

from rollout_trio import (
    Trajectory,
    WorkflowContractError,
    check_trajectory_format,
    concat_trajectories,
    run_group,
    split_trajectories,
    workflow_context,
)
from tests.vision_helpers import generate_row

torch.set_num_threads(1)


def test_a_generated_vision_row_passes_the_contract() -> None:
    row = generate_row("g")
    assert check_trajectory_format(row, batch_size=1)
    (mm,) = row.extras["multi_modal_input"]
    assert mm["pixel_values"].shape == (16, 1176) and mm["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int(row.extras["mm_token_type_ids"].sum()) == 4


def test_joining_rows_of_different_images_and_lengths_keeps_each_rows_tensors() -> None:
    rows = [generate_row("r"), generate_row("b", size=(112, 112), max_new_tokens=1), generate_row("g")]
    joined = concat_trajectories(rows)
    assert joined.batch_size == 3
    mms = joined.extras["multi_modal_input"]
    for r, row in zip(mms, rows):
        assert r["pixel_values"] is row.extras["multi_modal_input"][0]["pixel_values"]  # not copied
    assert [m["image_grid_thw"].tolist() for m in mms] == [[[1, 4, 4]], [[1, 8, 8]], [[1, 4, 4]]]
    types = joined.extras["mm_token_type_ids"]
    assert types.shape == joined.input_ids.shape and types.sum(dim=1).tolist() == [4, 16, 4]
    assert joined.to_dict()["multi_modal_input"] is mms
    # the joined batch is itself a valid trajectory (rebuilt through the checking constructor)
    again = Trajectory.from_dict(joined.to_dict())
    assert again.extras["multi_modal_input"][1]["pixel_values"].shape == (64, 1176)
    pieces = split_trajectories(joined, [1, 1, 1])
    for piece, row in zip(pieces, rows):
        assert piece.extras["multi_modal_input"][0] is row.extras["multi_modal_input"][0]
        assert torch.equal(piece.extras["mm_token_type_ids"], row.extras["mm_token_type_ids"])


async def test_a_normalized_group_keeps_the_images_with_their_rows() -> None:
    rewards = {0: 1.0, 1: 0.0, 2: 0.5, 3: 0.0}
    made = {}

    async def workflow(engine, data):
        slot = workflow_context.get().sample_idx
        made[slot] = generate_row("rgbr"[slot], reward=rewards[slot])
        return made[slot]

    result = await run_group(workflow, None, {}, 4, reward_normalization=True)
    traj = result if isinstance(result, Trajectory) else Trajectory.from_dict(result)
    mms = traj.extras["multi_modal_input"]
    assert len(mms) == 4
    order = [next(k for k, row in made.items() if row.extras["multi_modal_input"][0] is mm) for mm in mms]
    assert sorted(order) == [0, 1, 2, 3]
    for i, slot in enumerate(order):  # each image still sits with its own row
        width = made[slot].seqlen
        assert torch.equal(traj.input_ids[i, :width], made[slot].input_ids[0])
    assert traj.rewards.tolist() != [rewards[s] for s in order]  # normalized


def test_a_row_whose_image_tokens_do_not_match_its_pixel_rows_is_refused() -> None:
    row = generate_row("r")
    mm = row.extras["multi_modal_input"][0]
    bigger = {"pixel_values": torch.zeros(64, 1176), "image_grid_thw": torch.tensor([[1, 8, 8]])}
    with pytest.raises(WorkflowContractError, match="image tokens"):
        Trajectory.from_dict({**row.to_dict(), "multi_modal_input": [bigger]})
    with pytest.raises(WorkflowContractError, match="pixel rows"):
        Trajectory.from_dict({**row.to_dict(), "multi_modal_input": [{**mm, "pixel_values": mm["pixel_values"][:15]}]})
    with pytest.raises(WorkflowContractError, match="image placeholders need their pixel values"):
        Trajectory.from_dict({**row.to_dict(), "multi_modal_input": [None]})
    with pytest.raises(WorkflowContractError, match="one item per row"):
        Trajectory.from_dict({**row.to_dict(), "multi_modal_input": [mm, mm]})
    with pytest.raises(WorkflowContractError, match="must be a list"):
        Trajectory.from_dict({**row.to_dict(), "multi_modal_input": mm})
    two = {"pixel_values": torch.cat([mm["pixel_values"]] * 2), "image_grid_thw": torch.cat([mm["image_grid_thw"]] * 2)}
    with pytest.raises(WorkflowContractError, match="placeholders"):
        Trajectory.from_dict({**row.to_dict(), "multi_modal_input": [two]})


def test_joining_refuses_a_slot_with_mismatched_images_naming_the_slot() -> None:
    good = generate_row("r")
    bad = generate_row("g").to_dict()
    bad["multi_modal_input"] = [{"pixel_values": torch.zeros(64, 1176), "image_grid_thw": torch.tensor([[1, 8, 8]])}]
    with pytest.raises(WorkflowContractError, match="slot 1: .*image tokens"):
        concat_trajectories([good, bad])


def test_text_only_rows_next_to_vision_rows() -> None:
    row = generate_row("r")
    text = Trajectory.from_dict({**row.to_dict(), "multi_modal_input": [None],
                                 "mm_token_type_ids": torch.zeros_like(row.input_ids)})  # fmt: skip
    joined = concat_trajectories([row, text])
    assert joined.extras["multi_modal_input"][1] is None


def test_an_image_placeholder_generated_in_the_completion_is_refused() -> None:
    row = generate_row("r").to_dict()
    ids = row["input_ids"].clone()
    ids[0, -1] = 261  # <|image_pad|> as the last completion token
    with pytest.raises(WorkflowContractError, match="image placeholder token outside the image placeholders"):
        Trajectory.from_dict({**row, "input_ids": ids})
