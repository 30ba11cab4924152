"""Reading hostile dumps (issue 18 item 9): ``read_dump`` and ``rollout-trio inspect``.

Memory is bounded by the line limit, not by the line; a value of the wrong JSON type is an
error, never coerced; every malformed line is the documented ``ValueError`` naming the file
and the line; a FIFO or a directory where a dump file should be never blocks the reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from rollout_trio import Trajectory
from rollout_trio.cli._inspect import inspect_main
from rollout_trio.executor import read_dump
from rollout_trio.executor._dump import trajectory_lines


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def good_record() -> dict:
    t = Trajectory(
        input_ids=torch.tensor([[1, 2, 3, 4, 5]]),
        attention_mask=torch.ones(1, 5, dtype=torch.bool),
        loss_mask=torch.tensor([[0, 1, 0, 1, 1]]),
        logprobs=torch.tensor([[0.0, -0.5, 0.0, -0.25, -1.0]]),
        versions=torch.tensor([[-1, 2, -1, 2, 2]]),
        rewards=torch.tensor([0.5]),
        original_rewards=torch.tensor([1.0]),
        is_truncated=torch.tensor([False]),
    )
    _, (line,) = trajectory_lines(t, task_id=3, tokenizer=Tok(), accepted=True)
    return json.loads(line)


def dump_file(root: Path, content: bytes) -> Path:
    path = root / "e/t/rollout/2/3.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def test_a_good_record_reads_back(tmp_path):
    dump_file(tmp_path, json.dumps(good_record()).encode() + b"\n")
    (record,) = read_dump(tmp_path)
    assert record.accepted is True and record.tokens.input_ids == (1, 2, 3, 4, 5) and record.is_truncated is False


def _set(record: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    target = record
    for key in parents:
        target = target[key]
    target[last] = value
    return record


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("accepted", "false", "true or false"),  # was read as True
        ("accepted", 0, "true or false"),
        ("is_truncated", 1, "true or false"),
        ("tokens.input_ids", "123", "a list of integers"),  # was read as (1, 2, 3)
        ("tokens.input_ids", [1, 2.0, 3, 4, 5], "a list of integers"),
        ("tokens.loss_mask", [0, 1, 0, True, 1], "a list of integers"),
        ("tokens.versions", {"a": 1}, "a list of integers"),
        ("tokens.logprobs", ["-0.5"], "a list of numbers"),
        ("tokens", "abc", "an object"),
        ("task_id", "3", "an integer"),
        ("task_id", 3.0, "an integer"),
        ("seqlen", True, "an integer"),
        ("reward", "0.5", "a number"),
        ("reward", False, "a number"),
        ("original_reward", [1.0], "a number"),
        ("prompt", 5, "a string"),
        ("completion", None, "a string"),
        ("version_rle", "22", "a list of"),
        ("version_rle", [[2, "3"]], "an integer"),
        ("version_rle", [[2, 3, 4]], "a \\[version, count\\] pair"),
        ("segments", [{"role": "boss", "len": 1, "text": "x"}], "one of"),
        ("segments", [{"role": "gen", "len": "1", "text": "x"}], "an integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_an_error_naming_the_field(tmp_path, field, value, rule):
    path = dump_file(tmp_path, json.dumps(_set(good_record(), field, value)).encode() + b"\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: not a dump record: {field}.*: must be {rule}"):
        read_dump(tmp_path)


def test_a_missing_key_is_named(tmp_path):
    record = good_record()
    del record["reward"]
    path = dump_file(tmp_path, b"\n" + json.dumps(record).encode() + b"\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: not a dump record: reward: missing$"):
        read_dump(tmp_path)


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (b'{"task_id": 3, "sample_idx": 0, "seqlen": 1, "prompt_len": 0, "head_version": 0, "tail_version": 0, '
         b'"version_rle": [], "reward": 1' + b"0" * 400 + b', "prompt": "", "completion": ""}', "a float can hold"),
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
        (b'{"task_id": "\xff\xfe"}', "UnicodeDecodeError"),
        (b"{not json", "JSONDecodeError"),
        (b"[1, 2]", "the line: must be an object"),
    ],
)
def test_malformed_lines_are_the_documented_value_error(tmp_path, line, what):
    path = dump_file(tmp_path, json.dumps(good_record()).encode() + b"\n" + line + b"\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: not a dump record: .*{what}"):
        read_dump(tmp_path)


def test_a_directory_named_like_a_dump_file_is_a_value_error(tmp_path):
    bogus = tmp_path / "e/t/rollout/2/3.jsonl"
    bogus.mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"^{bogus}: not a regular file"):
        read_dump(tmp_path)


def test_a_line_over_the_limit_is_refused_without_being_read_whole(tmp_path):
    limit = 2**20
    good = json.dumps(good_record()).encode() + b"\n"
    path = dump_file(tmp_path, good + b'{"prompt": "' + b"x" * (16 * limit) + b'"}\n' + good)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"^{path}:2: line longer than {limit} bytes \(max_line_bytes\)"):
            read_dump(tmp_path, max_line_bytes=limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * limit  # the 16 MiB line was never held


def test_a_line_exactly_at_the_limit_is_read(tmp_path):
    good = json.dumps(good_record()).encode()
    dump_file(tmp_path, good + b"\n" + good)  # the last line has no newline
    assert len(read_dump(tmp_path, max_line_bytes=len(good))) == 2
    with pytest.raises(ValueError, match=":1: line longer than"):
        read_dump(tmp_path, max_line_bytes=len(good) - 1)


def test_max_line_bytes_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_line_bytes: must be an integer >= 1"):
        read_dump(tmp_path, max_line_bytes=0)


def test_inspect_refuses_a_fifo_in_the_dump_instead_of_hanging(tmp_path):
    fifo = tmp_path / "e/t/rollout/2/3.jsonl"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)  # nobody ever writes: opening it to read would wait forever
    # A subprocess, so a reader that blocks fails this test by its timeout instead of hanging the run.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_trio", "inspect", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    expected = f"rollout-trio inspect: error: {fifo}: not a regular file; a dump file is a regular .jsonl file"
    assert done.stderr.strip().splitlines() == [expected]


def test_inspect_refuses_a_fifo_given_as_the_dump(tmp_path, capsys):
    fifo = tmp_path / "dump.jsonl"
    os.mkfifo(fifo)
    assert inspect_main([str(fifo)]) == 1
    assert "not a regular file or a directory" in capsys.readouterr().err


def test_inspect_reports_a_bad_line_in_one_line(tmp_path, capsys):
    path = dump_file(tmp_path, json.dumps(_set(good_record(), "accepted", "false")).encode() + b"\n")
    assert inspect_main([str(tmp_path)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{path}:1: not a dump record: accepted: must be true or false, got 'false' (str)" in line


def test_inspect_max_line_bytes_option(tmp_path, capsys):
    line = json.dumps(good_record()).encode()
    dump_file(tmp_path, line + b"\n")
    assert inspect_main([str(tmp_path), "--max-line-bytes", str(len(line) - 1)]) == 1
    assert "line longer than" in capsys.readouterr().err
    assert inspect_main([str(tmp_path), "--max-line-bytes", str(len(line))]) == 0
