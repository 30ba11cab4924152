"""Dumps of vision rows: the group's image tensors written once beside its lines, read back
(and replayed into a trajectory) exactly, and a hostile image file refused by rule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rollout_trio import (
    GenerationConfig,
    RolloutConfig,
    Trajectory,
    VisionRLVRWorkflow,
    check_trajectory_format,
    concat_trajectories,
    open_executor,
    read_dump,
)
from rollout_trio.engines import LocalEngine
from rollout_trio.executor._dump import iter_dump
from tests.vision_helpers import colour_reward, device, image, messages, vlm

torch.set_num_threads(1)
GCONFIG = GenerationConfig(max_new_tokens=3, temperature=1.0)


def task(colour: str) -> dict:
    return {"messages": messages(), "images": [image(colour)], "answer": colour}


@pytest.fixture(scope="module")
def tiny():
    model, processor = vlm()
    return model.to(device()), processor


async def dumped_run(tiny, root: Path, colours: list[str], group_size: int) -> list[Trajectory]:
    model, processor = tiny
    cfg = RolloutConfig(
        consumer_batch_size=1,
        max_head_offpolicyness=1000,
        dump_to_file=True,
        fileroot=str(root),
        experiment_name="exp",
        trial_name="t",
    )
    wf = VisionRLVRWorkflow(colour_reward, GCONFIG, processor=processor)
    # Seeded: an unseeded sample can be the image placeholder, and the workflow rejects that row.
    async with LocalEngine(model, processor.tokenizer, seed=0) as engine:
        async with open_executor(engine, cfg, tokenizer=processor.tokenizer) as ex:
            batch = await ex.rollout_batch([task(c) for c in colours], wf, group_size=group_size, progress=False)
    return batch


def image_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


async def test_a_group_writes_its_image_tensors_once_and_reads_them_back_exactly(tiny, tmp_path) -> None:
    (traj,) = await dumped_run(tiny, tmp_path, ["g"], group_size=4)
    files = image_files(tmp_path)
    assert len(files) == 1, files  # one file, one entry, for the group's 4 rows
    records = read_dump(tmp_path)
    assert len(records) == traj.batch_size == 4
    wrote = traj.extras["multi_modal_input"]
    for record, mm in zip(sorted(records, key=lambda r: r.sample_idx), wrote):
        assert record.multi_modal_input is not None
        assert set(record.multi_modal_input) == set(mm)
        assert all(torch.equal(record.multi_modal_input[k], mm[k].cpu()) for k in mm)
        row = traj.extras["mm_token_type_ids"][record.sample_idx]
        assert record.tokens is not None and record.tokens.mm_token_type_ids == tuple(row[: record.seqlen].tolist())
    # A group's rows share one loaded dict, as they shared one preprocessing.
    assert len({id(r.multi_modal_input) for r in records}) == 1


async def test_a_dumped_vision_row_becomes_a_checked_trajectory_again(tiny, tmp_path) -> None:
    await dumped_run(tiny, tmp_path, ["b"], group_size=2)
    rows = [r.to_trajectory() for r in read_dump(tmp_path)]
    merged = concat_trajectories(rows)
    assert check_trajectory_format(merged, batch_size=2)
    assert len(merged.extras["multi_modal_input"]) == 2


async def test_two_groups_keep_their_own_images(tiny, tmp_path) -> None:
    trajs = await dumped_run(tiny, tmp_path, ["r", "b"], group_size=2)
    assert len(image_files(tmp_path)) == 2  # one per group (task)
    by_task = {}
    for record in read_dump(tmp_path):
        by_task.setdefault(record.task_id, []).append(record)
    assert len(by_task) == 2
    pixels = [recs[0].multi_modal_input["pixel_values"] for recs in by_task.values()]
    assert not torch.equal(pixels[0], pixels[1])  # a red and a blue image
    assert {t.batch_size for t in trajs} == {2}


def test_a_text_only_dump_writes_no_image_file(tmp_path) -> None:
    from rollout_trio.executor._dump import trajectory_dump

    from .test_dump import CharTok

    traj = Trajectory(
        input_ids=torch.tensor([[1, 2, 3]]),
        attention_mask=torch.ones(1, 3, dtype=torch.bool),
        loss_mask=torch.tensor([[0, 1, 1]]),
        rewards=torch.tensor([1.0]),
    )
    out = trajectory_dump(traj, task_id=1, tokenizer=CharTok(), version=0)
    assert out.image_name is None and out.image_bytes is None and "multi_modal_input" not in out.lines[0]


# ------------------------------------------------------------------- hostile image files


@pytest.fixture(scope="module")
def vision_dump(tiny, tmp_path_factory):
    import trio

    root = tmp_path_factory.mktemp("vision-dump")
    trio.run(dumped_run, tiny, root, ["g"], 2)
    return root


def copy_of(vision_dump: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    import shutil

    root = tmp_path / "d"
    shutil.copytree(vision_dump, root)
    (lines,) = root.rglob("*.jsonl")
    (images,) = root.rglob("*.safetensors")
    return root, lines, images


def rewrite(lines: Path, old: str, new: str) -> None:
    text = lines.read_text()
    assert old in text
    lines.write_text(text.replace(old, new))


def replace_content(lines: Path, images: Path, data: bytes) -> Path:
    """``images`` rewritten with ``data`` under the name of its digest, the line following:
    what gets past the digest check, so the checks after it are reached."""
    import hashlib

    task = images.name.partition(".mm-")[0]
    renamed = images.with_name(f"{task}.mm-{hashlib.sha256(data).hexdigest()[:16]}.safetensors")
    images.unlink()
    renamed.write_bytes(data)
    rewrite(lines, images.name, renamed.name)
    return renamed


def test_a_changed_byte_is_refused_by_the_digest_in_the_file_name(vision_dump, tmp_path) -> None:
    root, _, images = copy_of(vision_dump, tmp_path)
    data = bytearray(images.read_bytes())
    data[-1] ^= 1  # a pixel value's last byte: still a well-formed safetensors file
    images.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{images.name}: its content does not match the digest in its name .*tampered or truncated"):
        read_dump(root)


def test_a_line_naming_a_path_outside_its_directory_is_refused(vision_dump, tmp_path) -> None:
    root, lines, images = copy_of(vision_dump, tmp_path)
    rewrite(lines, images.name, "../../" + images.name)
    with pytest.raises(ValueError, match=r"multi_modal_input\.file: must be an image file name"):
        read_dump(root)


def test_a_symlinked_image_file_is_refused(vision_dump, tmp_path) -> None:
    root, lines, images = copy_of(vision_dump, tmp_path)
    elsewhere = tmp_path / "secret.safetensors"
    images.rename(elsewhere)
    os.symlink(elsewhere, images)
    with pytest.raises(ValueError, match="cannot open the image file"):
        read_dump(root)


def test_an_image_file_over_the_bound_is_refused_before_it_is_read(vision_dump, tmp_path) -> None:
    root, _, images = copy_of(vision_dump, tmp_path)
    size = images.stat().st_size
    with pytest.raises(ValueError, match=f"{size} bytes, more than max_image_bytes={size - 1}"):
        read_dump(root, max_image_bytes=size - 1)
    assert len(read_dump(root, max_image_bytes=size)) == 2


def test_garbage_a_missing_file_and_an_unknown_index_are_errors_naming_the_line(vision_dump, tmp_path) -> None:
    root, lines, images = copy_of(vision_dump, tmp_path)
    data = images.read_bytes()
    garbage = replace_content(lines, images, b"\xff" * 64)
    with pytest.raises(ValueError, match=r"\.jsonl:1: not a dump record: .*not a safetensors file"):
        read_dump(root)
    images = replace_content(lines, garbage, data)
    rewrite(lines, '"index": 0', '"index": 7')
    with pytest.raises(ValueError, match=r"multi_modal_input\.index: 7 is not in"):
        read_dump(root)
    rewrite(lines, '"index": 7', '"index": 0')
    images.unlink()
    with pytest.raises(ValueError, match="the image file a dump line names is missing"):
        read_dump(root)
    assert len(list(iter_dump(root, light=True))) == 2  # light reads never open image files


def test_tensors_that_do_not_match_the_rows_placeholders_are_refused(vision_dump, tmp_path) -> None:
    from safetensors.torch import load, save

    root, lines, images = copy_of(vision_dump, tmp_path)
    flat = load(images.read_bytes())
    flat["0/pixel_values"] = flat["0/pixel_values"][:-4]  # rows the grid does not make
    replace_content(lines, images, save(flat))
    with pytest.raises(ValueError, match="pixel_values has 12 rows"):
        read_dump(root)
