"""`rollout-trio replay` of a vision dump (issue 30): the rebuilt rows carry the dumped
``multi_modal_input`` tensors bit for bit, a changed image or reward is reported per row,
and a missing or tampered image file is one line naming it, exit 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_trio import GenerationConfig, Trajectory, VisionRLVRWorkflow, read_dump, run_group, workflow_context
from rollout_trio.cli import main
from rollout_trio.cli._replay import _rows_like_the_dumper, compare_row, replay_main
from rollout_trio.engines import ReplayEngine
from rollout_trio.models_vision import tiny_vlm_processor
from rollout_trio.workflow_context import StatsRecorder, WorkflowContext
from rollout_trio.workflows import colour_prompts, colour_reward

torch.set_num_threads(1)
GROUPS, G, NEW = 2, 3, 2


@pytest.fixture(scope="module")
def vision_dump(tmp_path_factory) -> Path:
    """What `rollout-trio run --task vision --groups 2 --group-size 3 --dump DIR` writes (in process)."""
    root = tmp_path_factory.mktemp("vision-run")
    argv = ["run", "--task", "vision", "--groups", str(GROUPS), "--group-size", str(G),
            "--max-new-tokens", str(NEW), "--dump", str(root), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    return root / "run" / "seed0"


def inverted_reward_workflow(tokenizer, processor):
    """A factory for --workflow: the vision main job's workflow with the reward turned over."""
    return VisionRLVRWorkflow(lambda *a, answer, **d: 1.0 - colour_reward(*a, answer=answer, **d), GenerationConfig(max_new_tokens=NEW), processor=processor)


def data_file(tmp_path: Path, changed_task: int | None = None) -> Path:
    """The main job's tasks as JSON lines, each image a PNG path (lossless: the same pixels);
    ``changed_task``'s image gets one pixel changed (same size, so the same prompt tokens)."""
    lines = []
    for k, item in enumerate(colour_prompts(GROUPS, seed=0)):
        img = item["images"][0].copy()
        if k == changed_task:
            img.putpixel((5, 5), (255, 255, 255))
        path = tmp_path / f"task{k}.png"
        img.save(path)
        lines.append(json.dumps({"messages": item["messages"], "images": [str(path)], "answer": item["answer"]}))
    out = tmp_path / "data.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.cpu().contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- the command


def test_the_vision_main_jobs_dump_reproduces(vision_dump, capsys) -> None:
    assert replay_main([str(vision_dump), "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[:GROUPS]] == [["task", str(k)] for k in range(GROUPS)], out
    assert all(line.endswith(f"{G} rows reproduce") for line in out[:GROUPS])
    assert out[-1] == f"{GROUPS} tasks replayed: {GROUPS} reproduce, 0 differ"


def test_data_with_image_paths_reproduces_and_a_changed_image_is_reported_per_row(vision_dump, tmp_path, capsys) -> None:
    assert replay_main([str(vision_dump), "--data", str(data_file(tmp_path))]) == 0
    capsys.readouterr()
    assert replay_main([str(vision_dump), "--data", str(data_file(tmp_path, changed_task=0))]) == 1
    out = capsys.readouterr().out
    assert "task 0" in out and "DIFFERS" in out
    for row in range(G):  # the same tokens, so the engine answers; the tensors tell
        assert f"row #{row}: multi_modal_input.pixel_values differ in " in out, out
    assert "image_grid_thw" not in out and "reward" not in out  # only what changed is named
    assert out.splitlines()[-1] == f"{GROUPS} tasks replayed: 1 reproduce, 1 differ"


def test_a_changed_reward_is_reported_per_row(vision_dump, capsys) -> None:
    records = read_dump(vision_dump)
    argv = [str(vision_dump), "--workflow", "tests.test_replay_vision:inverted_reward_workflow"]
    assert replay_main(argv) == 1
    out = capsys.readouterr().out
    for r in records:
        assert f"row #{r.sample_idx}: reward {1.0 - r.raw_reward:.6g} vs dumped {r.raw_reward:.6g}" in out
    assert "multi_modal_input" not in out
    assert out.splitlines()[-1] == f"{GROUPS} tasks replayed: 0 reproduce, {GROUPS} differ"


# ---------------------------------------------------------------- hostile image files


def copy_of(vision_dump: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "d"
    shutil.copytree(vision_dump, root)
    return root, sorted(root.rglob("0.mm-*.safetensors"))[0]


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout-trio replay: error: "), captured.err
    assert "tasks replayed" not in captured.out  # nothing replayed from a dump that does not read
    return lines[0]


def test_a_missing_image_file_is_one_line_naming_it(vision_dump, tmp_path, capsys) -> None:
    root, images = copy_of(vision_dump, tmp_path)
    images.unlink()
    assert replay_main([str(root)]) == 1
    line = one_line_error(capsys)
    assert str(images) in line and "the image file a dump line names is missing" in line


@pytest.mark.parametrize("where", ["header", "values"])
def test_a_tampered_image_file_is_one_line_naming_it(vision_dump, tmp_path, capsys, where) -> None:
    root, images = copy_of(vision_dump, tmp_path)
    data = bytearray(images.read_bytes())
    at = 12 if where == "header" else len(data) - 1  # a value's last byte: still a valid safetensors file
    data[at] ^= 0x01
    images.write_bytes(bytes(data))
    assert replay_main([str(root)]) == 1
    line = one_line_error(capsys)
    assert str(images) in line, line
    if where == "values":
        assert "does not match the digest in its name" in line


# ---------------------------------------------------------------- the engine (the API path)


@pytest.mark.parametrize("task_id", range(GROUPS))
async def test_a_vision_group_on_the_replay_engine_rebuilds_the_dumped_rows(vision_dump, task_id) -> None:
    """A trainer-side re-run: run_group against the dump gives its rows back, tensors included."""
    records = sorted((r for r in read_dump(vision_dump) if r.task_id == task_id), key=lambda r: r.sample_idx)
    processor = tiny_vlm_processor()
    workflow = VisionRLVRWorkflow(colour_reward, GenerationConfig(max_new_tokens=NEW), processor=processor)
    async with ReplayEngine(records, tokenizer=processor.tokenizer) as engine:
        with workflow_context.use(WorkflowContext(task_id=task_id)):
            result = await run_group(workflow, engine, colour_prompts(GROUPS, seed=0)[task_id], G, stats=StatsRecorder())
    traj = result if isinstance(result, Trajectory) else Trajectory.from_dict(result)
    assert traj is not None and engine.remaining() == 0
    rows = _rows_like_the_dumper(traj)
    assert len(rows) == G
    # The group's slots ask with one prompt: which slot got which recording is the scheduler's.
    # Two slots may sample the same tokens, their logprobs then differing in the last bits (the
    # recording's batch): a row matches one of the recordings of its tokens, each used once.
    by_tokens: dict[tuple[int, ...], list[Any]] = {}
    for r in records:
        by_tokens.setdefault(tuple(r.tokens.input_ids), []).append(r)
    for row in rows:
        candidates = by_tokens[tuple(row["input_ids"])]
        matching = [r for r in candidates if compare_row(row, r) == []]
        assert matching, [compare_row(row, r) for r in candidates]
        record = matching[0]
        candidates.remove(record)
        assert record.multi_modal_input is not None and set(row["multi_modal_input"]) == set(record.multi_modal_input) == {"pixel_values", "image_grid_thw"}
        for key, dumped in record.multi_modal_input.items():
            assert same_bits(row["multi_modal_input"][key], dumped), key
        assert row["mm_token_type_ids"] == list(record.tokens.mm_token_type_ids)
        assert row["reward"] == record.raw_reward


def test_compare_row_names_each_tensor_that_differs(vision_dump) -> None:
    (record, *_) = read_dump(vision_dump)
    mm = record.multi_modal_input
    assert mm is not None and record.tokens is not None
    base = {"input_ids": list(record.tokens.input_ids), "loss_mask": list(record.tokens.loss_mask),
            "logprobs": list(record.tokens.logprobs), "versions": list(record.tokens.versions),
            "reward": record.raw_reward, "is_truncated": record.is_truncated,
            "mm_token_type_ids": list(record.tokens.mm_token_type_ids)}  # fmt: skip
    where = f"row #{record.sample_idx}"
    assert compare_row(dict(base, multi_modal_input=dict(mm)), record) == []
    assert compare_row(dict(base, multi_modal_input=None), record) == [
        f"{where}: multi_modal_input: the workflow's row has none; the dump has image_grid_thw, pixel_values"
    ]
    wider = dict(mm, pixel_values=mm["pixel_values"].double())
    assert compare_row(dict(base, multi_modal_input=wider), record) == [
        f"{where}: multi_modal_input.pixel_values: dtype torch.float64 vs dumped torch.float32"
    ]
    shorter = dict(mm, pixel_values=mm["pixel_values"][:-4])
    n, d = mm["pixel_values"].shape
    assert compare_row(dict(base, multi_modal_input=shorter), record) == [
        f"{where}: multi_modal_input.pixel_values: shape [{n - 4}, {d}] vs dumped [{n}, {d}]"
    ]
    grid = dict(mm, image_grid_thw=mm["image_grid_thw"] * 2)
    (problem,) = compare_row(dict(base, multi_modal_input=grid), record)
    assert problem.startswith(f"{where}: multi_modal_input.image_grid_thw differ in 3 of 3 values (first at [0, 0]: 2 vs dumped 1)")
    extra = dict(mm, video_grid_thw=torch.zeros(1, 3))
    missing = {"pixel_values": mm["pixel_values"]}
    assert compare_row(dict(base, multi_modal_input=extra), record) == [f"{where}: multi_modal_input.video_grid_thw: not in the dump"]
    assert compare_row(dict(base, multi_modal_input=missing), record) == [f"{where}: multi_modal_input.image_grid_thw: the workflow's row has none"]
    types = list(base["mm_token_type_ids"])
    types[-1] = 1
    assert compare_row(dict(base, mm_token_type_ids=types, multi_modal_input=mm), record) == [
        f"{where}: mm_token_type_ids differ at token {len(types) - 1}: 1 vs dumped 0"
    ]
