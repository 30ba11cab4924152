"""Trajectory dumps: spec/executor.md §6 and its §15 cases, DESIGN decision 9, and I/O failures."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
import trio
import trio.testing

from rollout_trio import Trajectory, WorkflowContractError
from rollout_trio.executor import DumpRecord, TrajectoryDumper, read_dump
from rollout_trio.executor._dump import (
    compute_output_versions,
    iter_dump,
    split_trajectory_for_dump,
    trajectory_lines,
)


class FakeTok:
    """The spec's tokenizer: ``decode(ids) == f"[{len(ids)} tokens]"``."""

    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens is False  # dumps show the special tokens
        return f"[{len(ids)} tokens]"


class CharTok:
    """Decodes each id as one character, so texts show which tokens went where."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def traj(ids, mask, versions=None, rewards=None, attn=None, **more):
    t = lambda rows, dtype: torch.tensor(rows, dtype=dtype)  # noqa: E731
    return Trajectory(
        input_ids=t(ids, torch.int32),
        attention_mask=t(attn if attn is not None else [[1] * len(r) for r in ids], torch.bool),
        loss_mask=t(mask, torch.int32),
        versions=None if versions is None else t(versions, torch.int32),
        rewards=t(rewards if rewards is not None else [1.0] * len(ids), torch.float32),
        **more,
    )


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def dumper(tmp_path):
    return TrajectoryDumper(tmp_path, "e", "t", FakeTok())


# ---------------------------------------------------------------- §15 dump helpers (cases 1-15)


@pytest.mark.parametrize(
    ("ids", "mask", "prompt_end", "roles", "lens"),
    [
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 1, 1], 3, None, None),  # case 1
        (list(range(8)), [0, 0, 1, 1, 0, 0, 1, 1], 2, ["prompt", "gen", "context", "gen"], [2, 2, 2, 2]),  # case 2
        ([1, 2, 3], [0, 0, 0], 3, None, None),  # case 3
        ([10, 20, 30], [1, 1, 1], 0, None, None),  # case 4
        (list(range(12)), [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1], 2,
         ["prompt", "gen", "context", "gen", "context", "gen"], [2] * 6),  # case 5
        ([42], [1], 0, None, None),  # case 7
        (list("abcdefg"), [0, 0, 1, 1, 0, 1, 1], 2, ["prompt", "gen", "context", "gen"], [2, 2, 1, 2]),  # case 8
        # case 9, changed by DESIGN: a mask-0 run is "prompt" only at index 0, else "context".
        ([1, 2, 3, 4], [1, 1, 0, 1], 0, ["gen", "context", "gen"], [2, 1, 1]),
    ],
)
def test_split_trajectory_for_dump(ids, mask, prompt_end, roles, lens):
    split = split_trajectory_for_dump(ids, mask, FakeTok())
    assert split.prompt_end == prompt_end
    assert split.prompt_text == f"[{prompt_end} tokens]"
    assert split.completion_text == f"[{len(ids) - prompt_end} tokens]"
    if roles is None:
        assert split.segments is None
    else:
        assert [s.role for s in split.segments] == roles
        assert [s.len for s in split.segments] == lens
        assert [s.text for s in split.segments] == [f"[{n} tokens]" for n in lens]


def test_split_rejects_mismatched_lengths():  # case 6
    with pytest.raises(ValueError, match="ids length 2 != mask length 1"):
        split_trajectory_for_dump([1, 2], [0], FakeTok())


def test_split_segment_texts_are_the_runs_decoded():
    split = split_trajectory_for_dump([0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1, 1], CharTok())
    assert [s.text for s in split.segments] == ["ab", "cd", "e", "fg"]
    assert (split.prompt_text, split.completion_text) == ("ab", "cdefg")


@pytest.mark.parametrize(
    ("versions", "mask", "expected"),
    [
        ([-1, -1, 5, 5, 6], [0, 0, 1, 1, 1], (5, 6, [[5, 2], [6, 1]])),  # case 10
        ([-1, 3, 3, 3], [0, 1, 1, 1], (3, 3, [[3, 3]])),  # case 11
        ([-1, 2, 2, 3, 3, 4], [0, 1, 1, 1, 1, 1], (2, 4, [[2, 2], [3, 2], [4, 1]])),  # case 12
        ([1, 2, 3], [0, 0, 0], (-1, -1, [])),  # case 13
        ([-1, -1, 5, 5, -1, -1, 6, 6], [0, 0, 1, 1, 0, 0, 1, 1], (5, 6, [[5, 2], [6, 2]])),  # case 14
        ([-1, 6, 5, 6], [0, 1, 1, 1], (5, 6, [[6, 1], [5, 1], [6, 1]])),  # case 15
    ],
)
def test_compute_output_versions(versions, mask, expected):
    assert compute_output_versions(versions, mask) == expected


# ---------------------------------------------------------------- §6.6 worked examples


async def test_worked_example_single_turn_rlvr_row_is_the_exact_line(tmp_path, dumper):
    t = traj([[11, 12, 13, 21, 22]], [[0, 0, 0, 1, 1]], [[-1, -1, -1, 3, 4]], [1.0])
    async with dumper:
        assert await dumper.dump(t, task_id=42) is True
    path = tmp_path / "e" / "t" / "rollout" / "4" / "42.jsonl"
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 1
    # The reference's keys, order and json.dumps defaults, then the two extension keys.
    assert text.startswith(
        '{"task_id": 42, "sample_idx": 0, "seqlen": 5, "prompt_len": 3, "head_version": 3, '
        '"tail_version": 4, "version_rle": [[3, 1], [4, 1]], "reward": 1.0, '
        '"prompt": "[3 tokens]", "completion": "[2 tokens]", "accepted": true, "tokens": {'
    )
    record = json.loads(text)
    assert record["tokens"] == {
        "input_ids": [11, 12, 13, 21, 22],
        "loss_mask": [0, 0, 0, 1, 1],
        "logprobs": None,
        "versions": [-1, -1, -1, 3, 4],
    }
    assert "segments" not in record and "original_reward" not in record


async def test_worked_example_multi_turn_row(tmp_path):
    t = traj([[0, 1, 2, 3, 4, 5, 6]], [[0, 0, 1, 1, 0, 1, 1]], [[-1, -1, 5, 5, -1, 6, 6]])
    async with TrajectoryDumper(tmp_path, "e", "t", CharTok()) as dumper:
        await dumper.dump(t, task_id=1)
    (record,) = lines_of(tmp_path / "e/t/rollout/6/1.jsonl")
    assert record["prompt_len"] == 2 and record["completion"] == "cdefg"
    assert (record["head_version"], record["tail_version"], record["version_rle"]) == (5, 6, [[5, 2], [6, 2]])
    assert record["segments"] == [
        {"role": "prompt", "len": 2, "text": "ab"},
        {"role": "gen", "len": 2, "text": "cd"},
        {"role": "context", "len": 1, "text": "e"},
        {"role": "gen", "len": 2, "text": "fg"},
    ]


# ---------------------------------------------------------------- §15 dumping (cases 16-25)


async def test_case16_two_rows_in_the_highest_version_directory(tmp_path, dumper):
    t = traj(
        [[11, 12, 13, 21, 22], [11, 12, 13, 31, 0]],
        [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]],
        [[-1, -1, -1, 3, 4], [-1, -1, -1, 4, -1]],
        [1.0, 0.0],
        attn=[[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]],
    )
    async with dumper:
        assert await dumper.dump(t, task_id=42)
    rows = lines_of(tmp_path / "e/t/rollout/4/42.jsonl")
    picked = [{k: r[k] for k in ("sample_idx", "seqlen", "prompt_len", "head_version", "tail_version", "version_rle", "reward")} for r in rows]
    assert picked == [
        {"sample_idx": 0, "seqlen": 5, "prompt_len": 3, "head_version": 3, "tail_version": 4, "version_rle": [[3, 1], [4, 1]], "reward": 1.0},
        {"sample_idx": 1, "seqlen": 4, "prompt_len": 3, "head_version": 4, "tail_version": 4, "version_rle": [[4, 1]], "reward": 0.0},
    ]
    assert all("segments" not in r and "original_reward" not in r for r in rows)
    assert rows[1]["tokens"]["input_ids"] == [11, 12, 13, 31]  # the attended extent only


async def test_case17_row_whose_last_token_was_not_generated_is_skipped(tmp_path, dumper):
    t = traj(
        [[11, 12, 13, 21, 22], [11, 12, 13, 31, 0]],
        [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]],
        [[-1, -1, -1, 3, 4], [-1, -1, 4, -1, -1]],
        attn=[[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]],
    )
    async with dumper:
        await dumper.dump(t, task_id=42)
    assert [r["sample_idx"] for r in lines_of(tmp_path / "e/t/rollout/4/42.jsonl")] == [0]


def test_case18_row_with_no_attended_token_never_reaches_a_dump():
    """Spec case 18 skips a row with no attended token; our contract refuses such a row first.

    A 0-length sequence is no rollout (issue 11), so the trajectory cannot be built and
    nothing can be dumped for it.
    """
    with pytest.raises(WorkflowContractError, match="attention_mask.*at least one position"):
        traj([[5, 6, 7], [5, 0, 0]], [[0, 1, 1], [0, 0, 0]], [[-1, 2, 2], [-1, -1, -1]], attn=[[1, 1, 1], [0, 0, 0]])


async def test_case19_missing_versions_use_the_given_version_with_a_warning(tmp_path, dumper, caplog):
    t = traj([[1, 2, 3]], [[0, 1, 1]])
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with dumper:
            await dumper.dump(t, task_id=0, version=7)
    (record,) = lines_of(tmp_path / "e/t/rollout/7/0.jsonl")
    assert (record["head_version"], record["tail_version"], record["version_rle"]) == (7, 7, [[7, 2]])
    assert record["tokens"]["versions"] == [-1, 7, 7]
    assert "task 0: the trajectory has no 'versions'; dumped under version 7, given by the caller" in caplog.text


async def test_missing_versions_without_a_given_version_go_under_minus_one_unknown(tmp_path, dumper, caplog):
    """Issue 17 item 10: not under version 0 with a warning claiming the engine's version."""
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with dumper:
            assert await dumper.dump(traj([[1, 2, 3]], [[0, 1, 1]]), task_id=4)
    (record,) = lines_of(tmp_path / "e/t/rollout/-1/4.jsonl")
    assert (record["head_version"], record["tail_version"], record["version_rle"]) == (-1, -1, [[-1, 2]])
    assert record["tokens"]["versions"] == [-1, -1, -1]
    assert "task 4: the trajectory has no 'versions'; dumped under version -1 (unknown)" in caplog.text
    assert "engine" not in caplog.text
    assert [r.version for r in read_dump(tmp_path)] == [-1]


async def test_case20_eval_rollouts_go_to_eval_rollout(tmp_path, dumper):
    async with dumper:
        await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 3]]), task_id=5, is_eval=True)
    assert lines_of(tmp_path / "e/t/eval-rollout/3/5.jsonl")[0]["task_id"] == 5
    assert not (tmp_path / "e/t/rollout").exists()


async def test_case21_original_reward_is_recorded_after_completion(tmp_path, dumper):
    t = traj([[1, 2]], [[0, 1]], [[-1, 0]], [0.25], original_rewards=torch.tensor([0.5]))
    async with dumper:
        await dumper.dump(t, task_id=0)
    (record,) = lines_of(tmp_path / "e/t/rollout/0/0.jsonl")
    assert record["original_reward"] == 0.5 and record["reward"] == 0.25
    keys = list(record)
    assert keys.index("original_reward") == keys.index("completion") + 1


async def test_case22_dumps_of_one_task_and_version_append(tmp_path, dumper):
    t = traj([[1, 2]], [[0, 1]], [[-1, 0]])
    async with dumper:
        await dumper.dump(t, task_id=9)
        await dumper.dump(t, task_id=9, accepted=False)
    assert [r["accepted"] for r in lines_of(tmp_path / "e/t/rollout/0/9.jsonl")] == [True, False]


async def test_a_second_dump_into_one_directory_warns_and_appends(tmp_path, caplog):
    t = traj([[1, 2]], [[0, 1]], [[-1, 0]])
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with TrajectoryDumper(tmp_path, "e", "t", FakeTok()) as first:
            await first.dump(t, task_id=1)
            await first.dump(t, task_id=2)
        assert caplog.records == []  # a new directory: nothing to say
        async with TrajectoryDumper(tmp_path, "e", "t", FakeTok()) as second:
            await second.dump(t, task_id=1)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"trajectory dump directory {tmp_path.resolve() / 'e' / 't'} already holds 2 dumped files; new lines are appended"
    )
    assert len(lines_of(tmp_path / "e/t/rollout/0/1.jsonl")) == 2  # appended, not refused


async def test_entering_a_dumper_counts_a_large_dump_only_up_to_a_cap(tmp_path, caplog, monkeypatch):
    """The warning's count stops at the cap (shown as N+): entering a dumper never walks a
    whole large dump."""
    from rollout_trio.executor import _dump_writer as _dump

    monkeypatch.setattr(_dump, "_COUNT_AT_MOST", 5)
    for version in range(3):
        folder = tmp_path / "e" / "t" / "rollout" / str(version)
        folder.mkdir(parents=True)
        for task in range(4):
            (folder / f"{task}.jsonl").write_text("")
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with TrajectoryDumper(tmp_path, "e", "t", FakeTok()):
            pass
    [record] = caplog.records
    assert "already holds 5+ dumped files" in record.getMessage()


async def test_case23_what_is_not_dumped_returns_false_and_is_counted(tmp_path, dumper, caplog):
    ok = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 1]]), "loss_mask": torch.tensor([[0, 1]])}
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with dumper:
            assert await dumper.dump(None, task_id=0) is False
            assert await dumper.dump(ok, task_id=1) is False  # no rewards
            assert await dumper.dump({**ok, "rewards": torch.tensor(1.0)}, task_id=2) is False  # 0-dim rewards
            assert await dumper.dump({**ok, "rewards": torch.tensor([1.0])}, task_id=3) is True
    assert "missing required tensor fields: input_ids, rewards, attention_mask, or loss_mask" in caplog.text
    stats = dumper.statistics()
    assert (stats.dumped, stats.dump_failed, stats.lines) == (1, 2, 1)
    assert [p.name for p in (tmp_path / "e/t").rglob("*.jsonl")] == ["3.jsonl"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fileroot": None}, "fileroot"),
        ({"fileroot": ""}, "fileroot"),
        ({"tokenizer": None}, "tokenizer"),
        ({"experiment_name": ""}, "experiment_name"),
        ({"trial_name": None}, "trial_name"),
    ],
)
def test_case23_missing_pieces_are_value_errors_at_construction(tmp_path, kwargs, field):
    args = {"fileroot": tmp_path, "experiment_name": "e", "trial_name": "t", "tokenizer": FakeTok(), **kwargs}
    with pytest.raises(ValueError, match=f"^{field}: "):
        TrajectoryDumper(**args)


async def test_case24_multi_turn_record_has_segments_and_prompt_len(tmp_path, dumper):
    async with dumper:
        await dumper.dump(traj([[1, 2, 3, 4, 5, 6, 7]], [[0, 0, 1, 1, 0, 1, 1]], [[-1, -1, 1, 1, -1, 1, 1]]), task_id=0)
    (record,) = lines_of(tmp_path / "e/t/rollout/1/0.jsonl")
    assert len(record["segments"]) == 4 and record["prompt_len"] == 2


async def test_case25_key_order(tmp_path, dumper):
    t = traj([[1, 2, 3, 4, 5]], [[0, 1, 0, 1, 1]], [[-1, 1, -1, 1, 1]], original_rewards=torch.tensor([2.0]),
             is_truncated=torch.tensor([True]))
    async with dumper:
        await dumper.dump(t, task_id=0)
    (record,) = lines_of(tmp_path / "e/t/rollout/1/0.jsonl")
    assert list(record) == [
        "task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version", "version_rle",
        "reward", "prompt", "completion", "segments", "original_reward", "accepted", "tokens", "is_truncated",
    ]


def test_non_ascii_text_is_escaped_as_json_defaults_do():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "é</script>\x00"

    _, (line,) = trajectory_lines(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=0, tokenizer=Tok())
    assert "\\u00e9" in line and "\\u0000" in line and line.isascii()
    assert json.loads(line)["completion"] == "é</script>\x00"


# ---------------------------------------------------------------- names and paths (DESIGN 9)


@pytest.mark.parametrize("field", ["experiment_name", "trial_name"])
@pytest.mark.parametrize("name", ["../../x", "..", ".", ".hidden", "/abs/path", "a/b", "a\\b", "a b", "x\x00", "-x", "é"])
def test_hostile_names_are_value_errors_naming_the_field(tmp_path, field, name):
    args = {"experiment_name": "e", "trial_name": "t", field: name}
    with pytest.raises(ValueError, match=f"^{field}: must match"):
        TrajectoryDumper(tmp_path / "root", tokenizer=FakeTok(), **args)
    assert list(tmp_path.iterdir()) == []  # nothing created anywhere


def test_a_name_that_is_a_symlink_out_of_fileroot_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "root" / "e").symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match="resolves outside fileroot"):
        TrajectoryDumper(tmp_path / "root", "e", "t", FakeTok())


async def test_a_symlink_planted_later_is_not_followed(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    async with TrajectoryDumper(tmp_path / "root", "e", "t", FakeTok()) as dumper:
        (tmp_path / "root/e/t/rollout").mkdir(parents=True)
        (tmp_path / "root/e/t/rollout/0").symlink_to(outside)  # a directory link
        (tmp_path / "root/e/t/rollout/1").mkdir()
        (tmp_path / "root/e/t/rollout/1/7.jsonl").symlink_to(outside / "victim")  # a file link
        with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
            assert await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=7) is False
            assert await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 1]]), task_id=7) is False
    assert list(outside.iterdir()) == []
    assert dumper.statistics().dump_failed == 2
    assert caplog.text.count("a symbolic link; not followed, so the dump stays inside fileroot") == 2


# ---------------------------------------------------------------- I/O errors: logged, counted, never raised


async def test_a_file_where_a_directory_should_be_is_counted_not_raised(tmp_path, dumper, caplog):
    (tmp_path / "e/t").mkdir(parents=True)
    (tmp_path / "e/t/rollout").write_text("in the way")
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with dumper:
            assert await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=1) is False
            assert await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=2, is_eval=True) is True
    assert dumper.statistics().dump_failed == 1 and dumper.statistics().dumped == 1
    assert "task 1" in caplog.text


@contextlib.contextmanager
def refusing_writes(directory: Path) -> Iterator[None]:
    """``directory`` where the OS refuses new files: mode 0o500 for a user; for root, whom
    modes do not stop, a read-only tmpfs mounted over it."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(directory)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"root ignores modes and cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


async def test_a_directory_refusing_writes_is_counted_not_raised(tmp_path, dumper):
    (tmp_path / "e/t").mkdir(parents=True)
    with refusing_writes(tmp_path / "e/t"):
        async with dumper:
            assert await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=1) is False
    assert dumper.statistics().dump_failed == 1


async def test_permission_error_from_open_is_counted_not_raised(tmp_path, dumper, monkeypatch):
    real_open = os.open

    def deny(path, *args, **kwargs):
        if str(path).endswith(".jsonl"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    async with dumper:
        assert await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=1) is False
    assert dumper.statistics().dump_failed == 1


async def test_a_write_failing_midway_leaves_no_torn_line(tmp_path, dumper, monkeypatch):
    t = traj([[1, 2], [1, 3]], [[0, 1], [0, 1]], [[-1, 0], [-1, 0]])
    async with dumper:
        assert await dumper.dump(t, task_id=1)
        real_write = os.write
        calls = []

        def fill_disk(fd, data):
            calls.append(len(data))
            if len(calls) == 2:  # the second line: part of it lands, then the disk is full
                real_write(fd, data[:10])
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", fill_disk)
        assert await dumper.dump(t, task_id=1) is False
    records = read_dump(tmp_path)  # every line still parses
    assert len(records) == 3  # the first dump's two lines and the second dump's first line
    assert (dumper.statistics().dump_failed, dumper.statistics().lines) == (1, 3)


async def test_disk_full_on_a_small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        big = traj([list(range(500))], [[0] * 100 + [1] * 400], [[-1] * 100 + [0] * 400])
        async with TrajectoryDumper(mnt, "e", "t", FakeTok()) as dumper:
            results = [await dumper.dump(big, task_id=k) for k in range(20)]
        stats = dumper.statistics()
        assert results[0] is True and results[-1] is False
        assert stats.dumped + stats.dump_failed == 20 and stats.dump_failed >= 1
        assert len(read_dump(mnt)) == stats.dumped  # only whole lines are left
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ---------------------------------------------------------------- concurrency


async def test_concurrent_dumps_in_one_process_write_whole_lines(tmp_path, dumper):
    long = traj([list(range(3000))], [[0] * 10 + [1] * 2990], [[-1] * 10 + [2] * 2990])
    async with dumper, trio.open_nursery() as nursery:
        for _ in range(40):
            nursery.start_soon(lambda: dumper.dump(long, task_id=0))
    records = read_dump(tmp_path)
    assert len(records) == 40 and all(r.seqlen == 3000 for r in records)


_WRITER = textwrap.dedent(
    """
    import sys, torch, trio
    from rollout_trio import Trajectory
    from rollout_trio.executor import TrajectoryDumper

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    root, worker = sys.argv[1], int(sys.argv[2])
    n = 3000 + worker  # lines of different lengths (~20 kB), far above PIPE_BUF
    row = Trajectory(
        input_ids=torch.full((1, n), worker), attention_mask=torch.ones(1, n, dtype=torch.bool),
        loss_mask=torch.tensor([[0] + [1] * (n - 1)]), versions=torch.tensor([[-1] + [3] * (n - 1)]),
        rewards=torch.tensor([float(worker)]),
    )

    async def main():
        async with TrajectoryDumper(root, "e", "t", Tok()) as dumper:
            for _ in range(20):
                assert await dumper.dump(row, task_id=0)

    trio.run(main)
    """
)


def test_several_processes_append_whole_lines_to_one_file(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "root"), str(w)], env=env) for w in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    records = read_dump(tmp_path / "root")
    assert len(records) == 60
    for r in records:
        worker = int(r.reward)
        assert r.seqlen == 3000 + worker and set(r.tokens.input_ids) == {worker}
    assert sorted(int(r.reward) for r in records) == sorted(list(range(3)) * 20)


# ---------------------------------------------------------------- lifecycle and statistics


async def test_dump_outside_async_with_is_refused(tmp_path, dumper):
    with pytest.raises(trio.ClosedResourceError):
        await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=0)
    async with dumper:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=0)


async def test_task_id_must_be_an_int(dumper):
    async with dumper:
        with pytest.raises(TypeError, match="task_id"):
            await dumper.dump(traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id="0")  # type: ignore[arg-type]


async def test_leaving_waits_for_dumps_in_flight(tmp_path):
    import threading

    release = threading.Event()

    class SlowTok(FakeTok):
        def decode(self, ids, skip_special_tokens=True):
            assert release.wait(10)
            return super().decode(ids, skip_special_tokens)

    async def release_when_all_blocked():
        await trio.testing.wait_all_tasks_blocked()
        release.set()

    dumper = TrajectoryDumper(tmp_path, "e", "t", SlowTok())
    async with trio.open_nursery() as nursery:
        async with dumper:
            nursery.start_soon(functools.partial(dumper.dump, traj([[1, 2]], [[0, 1]], [[-1, 0]]), task_id=0))
            await trio.testing.wait_all_tasks_blocked()  # the dump's thread is running
            assert dumper.statistics().in_flight == 1
            nursery.start_soon(release_when_all_blocked)
        # __aexit__ returned only once the dump started inside had written its line.
        assert dumper.statistics().in_flight == 0
        assert dumper.statistics().lines == 1


# ---------------------------------------------------------------- reading back


async def test_read_dump_round_trips_records(tmp_path):
    t = traj(
        [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 0, 0]],
        [[0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0]],
        [[-1, -1, 5, 5, -1, 6, 6], [-1, -1, 6, 6, 6, -1, -1]],
        [0.5, -0.5],
        attn=[[1] * 7, [1] * 5 + [0, 0]],
        logprobs=torch.tensor([[0, 0, -0.5, -0.25, 0, -1.0, -2.0], [0, 0, -0.125, -1.5, -3.0, 0, 0]]),
        original_rewards=torch.tensor([1.0, 0.0]),
        is_truncated=torch.tensor([False, True]),
    )
    async with TrajectoryDumper(tmp_path, "e", "t", CharTok()) as dumper:
        await dumper.dump(t, task_id=3, accepted=False)
        await dumper.dump(t, task_id=1, is_eval=True)
    records = read_dump(tmp_path / "e")
    assert [(r.is_eval, r.task_id, r.sample_idx) for r in records] == [(False, 3, 0), (False, 3, 1), (True, 1, 0), (True, 1, 1)]
    r0 = records[0]
    assert isinstance(r0, DumpRecord)
    assert (r0.version, r0.accepted, r0.is_truncated, r0.raw_reward, r0.reward) == (6, False, False, 1.0, 0.5)
    assert [s.role for s in r0.segments] == ["prompt", "gen", "context", "gen"]
    assert r0.version_rle == ((5, 2), (6, 2))
    # The row rebuilt from the record is the dumped row.
    rebuilt = records[1].to_trajectory()
    assert rebuilt.input_ids.tolist() == [[0, 1, 2, 3, 4]]
    assert rebuilt.loss_mask.tolist() == [[0, 0, 1, 1, 1]]
    assert rebuilt.logprobs.tolist() == [[0, 0, -0.125, -1.5, -3.0]]
    assert rebuilt.versions.tolist() == [[-1, -1, 6, 6, 6]]
    assert rebuilt.rewards.tolist() == [-0.5] and rebuilt.original_rewards.tolist() == [0.0]
    assert rebuilt.is_truncated.tolist() == [True]
    # Any level of the layout reads the same records (a single file too).
    assert read_dump(tmp_path / "e/t/eval-rollout/6/1.jsonl") == records[2:]


def test_read_dump_names_the_file_and_line_of_a_bad_record(tmp_path):
    d = tmp_path / "rollout" / "0"
    d.mkdir(parents=True)
    (d / "4.jsonl").write_text('{"task_id": 4}\n')
    with pytest.raises(ValueError, match=r"4\.jsonl:1: not a dump record"):
        read_dump(tmp_path)
    (d / "4.jsonl").write_text("")
    (d / "notes.jsonl").write_text("{}\n")  # a file beside the dump that is not one of its files
    assert read_dump(tmp_path) == []
    with pytest.raises(ValueError, match="not a dump file"):
        read_dump(d / "notes.jsonl")
    with pytest.raises(FileNotFoundError):
        read_dump(tmp_path / "missing")


async def test_iter_dump_streams_light_records_and_parses_only_what_is_asked(tmp_path):
    t = traj([[1, 2, 3], [1, 2, 4]], [[0, 1, 1], [0, 0, 1]], [[-1, 1, 2], [-1, -1, 2]], [0.5, 1.5])
    async with TrajectoryDumper(tmp_path, "e", "t", CharTok()) as dumper:
        for task in range(3):
            await dumper.dump(t, task_id=task)
    full = read_dump(tmp_path)
    light = list(iter_dump(tmp_path, light=True))
    assert len(light) == len(full) == 6
    assert all(r.tokens is None and r.prompt == r.completion == "" and r.segments is None for r in light)
    assert [attrs.evolve(r, tokens=None, prompt="", completion="", segments=None) for r in full] == light
    assert list(iter_dump(tmp_path, only={1, 4})) == [full[1], full[4]]
    (tmp_path / "e/t/rollout/2/1.jsonl").write_text("not json\n")
    assert len(list(iter_dump(tmp_path, only={0}))) == 1  # unparsed lines may be anything
    with pytest.raises(ValueError, match=r"1\.jsonl:1: not a dump record"):
        list(iter_dump(tmp_path))


async def test_a_tokenizer_directory_is_loaded_at_the_first_dump(tmp_path):
    from rollout_trio.models import byte_tokenizer

    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    with pytest.raises(ValueError, match="^tokenizer: expected a tokenizer directory"):
        TrajectoryDumper(tmp_path / "root", "e", "t", str(tmp_path / "nothing-here"))
    ids = tok.encode("7+1=8", add_special_tokens=False)
    t = traj([ids], [[0, 0, 0, 0, 1]], [[-1, -1, -1, -1, 0]])
    async with TrajectoryDumper(tmp_path / "root", "e", "t", tmp_path / "tok") as dumper:
        assert await dumper.dump(t, task_id=0)
    (record,) = read_dump(tmp_path / "root")
    assert (record.prompt, record.completion) == ("7+1=", "8")


async def test_the_version_directory_is_the_trajectorys_highest_version(tmp_path, dumper):
    t = traj([[1, 2, 3], [1, 2, 3]], [[0, 1, 1], [0, 1, 1]], [[-1, 2, 3], [-1, 5, 4]])
    async with dumper:
        await dumper.dump(t, task_id=8)
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.jsonl")] == ["e/t/rollout/5/8.jsonl"]
    rows = lines_of(tmp_path / "e/t/rollout/5/8.jsonl")
    assert [(r["head_version"], r["tail_version"]) for r in rows] == [(2, 3), (4, 5)]  # a row may be older
