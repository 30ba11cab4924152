"""Properties of vision rows: joining and padding groups keep every image's tensors with its
row, and a group's preprocessing runs once whatever its size."""

from __future__ import annotations

import functools

import torch
import trio
from hypothesis import given
from hypothesis import strategies as st

from rollout_trio import ModelResponse, Trajectory, VisionRLVRWorkflow, concat_trajectories, run_group, split_trajectories
from rollout_trio.testing import ScriptedEngine
from tests.vision_helpers import colour_reward, counting_processor, image, processed, vlm

torch.set_num_threads(1)

# Prompts: the sizes of their images (0, 1 or 2 images of different sizes).
PROMPTS = [(), ((56, 56),), ((84, 56),), ((112, 112),), ((56, 56), (56, 112))]


@functools.cache
def prompt(k: int):
    """The processor's output for PROMPTS[k] (computed once per process)."""
    _, processor = vlm()
    return processed(processor, [image("rgb"[i % 3], size) for i, size in enumerate(PROMPTS[k])])


def row(uid: int, k: int, n_out: int) -> Trajectory:
    """A row whose pixel values are its own (offset by ``uid``), so any mix-up shows."""
    out = prompt(k)
    ids = out["input_ids"][0].tolist()
    new = [(uid * 7 + j) % 200 + 20 for j in range(n_out)]
    resp = ModelResponse(input_tokens=ids, output_tokens=new, output_logprobs=[-0.25] * n_out, output_versions=[uid] * n_out)
    types = torch.tensor([out["mm_token_type_ids"][0].tolist() + [0] * n_out])
    mm = None
    if PROMPTS[k]:
        mm = {"pixel_values": out["pixel_values"] + uid, "image_grid_thw": out["image_grid_thw"].clone()}
    return Trajectory.from_response(resp, float(uid), multi_modal_input=[mm], mm_token_type_ids=types)


groups_plan = st.lists(
    st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 6)), min_size=1, max_size=4),
    min_size=1,
    max_size=4,
)


@given(plan=groups_plan, order=st.randoms(use_true_random=False))
def test_joined_and_padded_groups_keep_each_images_tensors_with_its_row(plan, order) -> None:
    rows, uid = [], 0
    groups = []
    for group in plan:
        members = []
        for k, n_out in group:
            members.append(row(uid, k, n_out))
            rows.append((uid, k, members[-1]))
            uid += 1
        groups.append(concat_trajectories(members))
    order.shuffle(groups)
    batch = concat_trajectories(groups)  # groups of different widths: padded again
    assert Trajectory.from_dict(batch.to_dict()).batch_size == len(rows)  # the padded batch passes the contract
    by_uid = {int(batch.versions[i][batch.loss_mask[i].bool()][0]): i for i in range(batch.batch_size)}
    mms = batch.extras["multi_modal_input"]
    types = batch.extras["mm_token_type_ids"]
    for uid, k, original in rows:
        i = by_uid[uid]
        width = original.seqlen
        assert torch.equal(batch.input_ids[i, :width], original.input_ids[0])
        assert not batch.attention_mask[i, width:].any() and not types[i, width:].any()
        mm = mms[i]
        if not PROMPTS[k]:
            assert mm is None
            continue
        assert mm is original.extras["multi_modal_input"][0]
        grid = mm["image_grid_thw"]
        assert torch.equal(mm["pixel_values"], prompt(k)["pixel_values"] + uid)
        assert int(types[i].sum()) == int(grid.prod(dim=1).sum()) // 4  # the row's placeholders, its pixel rows
    pieces = split_trajectories(batch, [g.batch_size for g in groups])
    for piece, group in zip(pieces, groups):
        for a, b in zip(piece.extras["multi_modal_input"], group.extras["multi_modal_input"]):
            assert a is b


@given(group_size=st.integers(1, 8), size=st.sampled_from([(56, 56), (84, 112), (112, 112)]))
def test_a_groups_preprocessing_runs_once_whatever_its_size(group_size, size) -> None:
    processor = counting_processor()
    type(processor).calls = 0
    wf = VisionRLVRWorkflow(colour_reward, processor=processor)
    data = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
            "images": [image("g", size)], "answer": "g"}  # fmt: skip

    async def main():
        async with ScriptedEngine() as engine:
            return await run_group(wf, engine, data, group_size)

    result = trio.run(main)
    result = result if isinstance(result, Trajectory) else Trajectory.from_dict(result)
    assert type(processor).calls == 1
    mms = result.extras["multi_modal_input"]
    assert len(mms) == group_size and all(m["pixel_values"] is mms[0]["pixel_values"] for m in mms)
