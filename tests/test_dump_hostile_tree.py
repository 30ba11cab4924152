"""Dumps stay inside fileroot whatever else changes the tree (issue 18 item 5).

A symlink planted at any level, a directory swapped with a symlink while dumps run, a FIFO
or a hard link where the dump file goes: nothing is written or created outside fileroot,
and each refused dump is logged and counted as ``dump_failed``, never raised.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import trio

from rollout_trio import Trajectory
from rollout_trio.executor import TrajectoryDumper


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def row(version: int = 0) -> Trajectory:
    return Trajectory(
        input_ids=torch.tensor([[1, 2]]),
        attention_mask=torch.ones(1, 2, dtype=torch.bool),
        loss_mask=torch.tensor([[0, 1]]),
        versions=torch.tensor([[-1, version]]),
        rewards=torch.tensor([1.0]),
    )


def everything_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("level", ["e", "e/t", "e/t/rollout", "e/t/rollout/0"])
async def test_a_symlink_planted_at_any_level_creates_and_writes_nothing_outside(tmp_path, level, caplog):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    async with TrajectoryDumper(root, "e", "t", Tok()) as dumper:
        (root / level).parent.mkdir(parents=True, exist_ok=True)
        (root / level).symlink_to(outside, target_is_directory=True)
        with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
            assert await dumper.dump(row(), task_id=3) is False
    assert everything_under(outside) == []  # no directory made through the link either
    assert (dumper.statistics().dumped, dumper.statistics().dump_failed) == (0, 1)
    assert f"{root / level}: a symbolic link; not followed" in caplog.text


async def test_a_hard_link_to_a_file_outside_is_refused(tmp_path, caplog):
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (root / "e/t/rollout/0").mkdir(parents=True)
    os.link(victim, root / "e/t/rollout/0/3.jsonl")
    with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
        async with TrajectoryDumper(root, "e", "t", Tok()) as dumper:
            assert await dumper.dump(row(), task_id=3) is False
    assert victim.read_text() == "keep me\n"
    assert dumper.statistics().dump_failed == 1 and "hard links; refused" in caplog.text


async def test_a_fifo_where_the_file_goes_is_refused_without_blocking(tmp_path, caplog):
    root = tmp_path / "root"
    (root / "e/t/rollout/0").mkdir(parents=True)
    fifo = root / "e/t/rollout/0/3.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with a reader, opening for writing succeeds
    try:
        with caplog.at_level(logging.WARNING, logger="rollout_trio.dump"):
            async with TrajectoryDumper(root, "e", "t", Tok()) as dumper:
                assert await dumper.dump(row(), task_id=3) is False
                assert os.read(reader, 4096) == b""  # nothing was written into the pipe
        assert "not a regular file; refused" in caplog.text
    finally:
        os.close(reader)
    # Without a reader an open for writing would block forever; O_NONBLOCK makes it an error.
    async with TrajectoryDumper(root, "e", "t", Tok()) as dumper:
        assert await dumper.dump(row(), task_id=3) is False
    assert dumper.statistics().dump_failed == 1


# A second process flips ``rollout/0`` between a real directory and a symlink out of the
# root, atomically (renameat2 RENAME_EXCHANGE), as fast as it can. A separate process so
# it never waits for our GIL; bounded by the dumps: it is killed when they are done.
_SWAPPER = textwrap.dedent(
    """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    a, b = (os.fsencode(p) for p in sys.argv[1:3])
    if libc.renameat2(-100, a, -100, b, 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
        print("unsupported", os.strerror(ctypes.get_errno()), flush=True)
        sys.exit(0)
    print("ready", flush=True)
    while True:
        libc.renameat2(-100, a, -100, b, 2)
    """
)

DUMPS = 1500


async def test_a_directory_swapped_with_a_symlink_during_dumps_never_lets_a_line_out(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    scope = root / "e/t/rollout"
    scope.mkdir(parents=True)
    (scope / "0").mkdir()
    (scope / "aside").symlink_to(outside, target_is_directory=True)
    args = [sys.executable, "-c", _SWAPPER, str(scope / "0"), str(scope / "aside")]
    with subprocess.Popen(args, stdout=subprocess.PIPE) as swapper:
        try:
            assert swapper.stdout is not None
            first = swapper.stdout.readline().decode()
            if first.startswith("unsupported"):
                pytest.skip(f"renameat2(RENAME_EXCHANGE) is not available here: {first.strip()}")
            assert first == "ready\n"
            with trio.fail_after(60):
                async with TrajectoryDumper(root, "e", "t", Tok(), max_threads=8) as dumper:
                    async with trio.open_nursery() as nursery:
                        for k in range(DUMPS):
                            nursery.start_soon(lambda k=k: dumper.dump(row(), task_id=k % 50))
        finally:
            swapper.kill()
    stats = dumper.statistics()
    assert everything_under(outside) == []
    assert stats.dumped + stats.dump_failed == DUMPS
    # Every line counted as written is inside the root (in "0" or in the swapped-aside directory).
    assert lines_inside(root) == stats.lines == stats.dumped


def lines_inside(root: Path) -> int:
    """Lines of the regular files under ``root``, never following a symlink."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                total += len(path.read_bytes().splitlines())
    return total
