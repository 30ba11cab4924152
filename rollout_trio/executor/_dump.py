"""Trajectory dumps: one JSONL line per trajectory row, and the reader that loads them back.

Layout (DESIGN decision 9)::

    {fileroot}/{experiment_name}/{trial_name}/{rollout|eval-rollout}/{version}/{task_id}.jsonl

``version`` is the highest weight version in the trajectory. Each line holds the keys of
the reference's record, in its order (``task_id, sample_idx, seqlen, prompt_len,
head_version, tail_version, version_rle, reward, prompt, completion[, segments]
[, original_reward]``), then our extensions ``accepted`` and ``tokens`` (the row's
``input_ids``, ``loss_mask``, ``logprobs`` and ``versions`` over its ``seqlen``
positions) and, when the trajectory says so, ``is_truncated``.

Writing is safe for several processes appending to one directory: each line is one
``write`` on an ``O_APPEND`` descriptor, under a per-file lock (a thread lock within the
process, ``flock`` across processes), and a failed write is cut back off the file.

No write leaves ``fileroot``, whatever else changes the tree meanwhile: ``fileroot`` is
opened once, and every directory below it is opened (or made) relative to its parent's
descriptor with ``O_NOFOLLOW``, so a symlink planted or swapped in anywhere below the
root is refused, never followed, and nothing is created through it. The file itself must
be a regular file with one link. A refused dump is logged and counted like an I/O error.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
from collections.abc import Container, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import attrs
import trio

from .._limits import MAX_DUMP_LINE_BYTES
from .._trajectory import Trajectory

try:
    import fcntl
except ImportError:  # Windows: no flock; each line is still one O_APPEND write
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DumpRecord",
    "DumpSegment",
    "DumpStatistics",
    "DumpTokens",
    "TrajectoryDumper",
    "compute_output_versions",
    "iter_dump",
    "read_dump",
    "split_trajectory_for_dump",
]

logger = logging.getLogger("rollout_trio.dump")

#: What ``experiment_name`` and ``trial_name`` must match: no separators, no ``..``, no leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SCOPES = {"rollout": False, "eval-rollout": True}
_MISSING = "missing required tensor fields: input_ids, rewards, attention_mask, or loss_mask"


# ---------------------------------------------------------------------------- records


@attrs.frozen
class DumpSegment:
    """One run of equal ``loss_mask`` values in a multi-generation row."""

    role: Literal["prompt", "gen", "context"]
    len: int
    text: str


@attrs.frozen(kw_only=True)
class DumpTokens:
    """A row's attended positions (``seqlen`` of each); ``logprobs`` is None if the row had none."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    versions: tuple[int, ...]


@attrs.frozen(kw_only=True)
class DumpRecord:
    """One dumped row, as :func:`read_dump` loads it.

    The fields are the JSONL keys, plus ``version`` and ``is_eval`` taken from the
    file's path. ``tokens`` is None for dumps written without it (e.g. by AReaL), and
    ``is_truncated`` is None when the trajectory did not say.
    """

    task_id: int
    sample_idx: int
    seqlen: int
    prompt_len: int
    head_version: int
    tail_version: int
    version_rle: tuple[tuple[int, int], ...]
    reward: float
    prompt: str
    completion: str
    segments: tuple[DumpSegment, ...] | None = None
    original_reward: float | None = None
    accepted: bool = True
    tokens: DumpTokens | None = None
    is_truncated: bool | None = None
    version: int
    is_eval: bool

    @property
    def raw_reward(self) -> float:
        """The reward before normalization (``original_reward`` if recorded, else ``reward``)."""
        return self.reward if self.original_reward is None else self.original_reward

    def to_trajectory(self) -> Trajectory:
        """This row as a one-row :class:`Trajectory`, e.g. to re-run a trainer step on a dump."""
        import torch

        if self.tokens is None:
            raise ValueError(f"task {self.task_id} sample {self.sample_idx}: the record has no 'tokens'; cannot rebuild it")
        t = self.tokens

        def row(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([list(values)], dtype=dtype)

        n = len(t.input_ids)
        return Trajectory(
            input_ids=row(t.input_ids, torch.int64),
            attention_mask=torch.ones(1, n, dtype=torch.bool),
            loss_mask=row(t.loss_mask, torch.int64),
            logprobs=None if t.logprobs is None else row(t.logprobs, torch.float32),
            versions=row(t.versions, torch.int64),
            rewards=torch.tensor([self.reward], dtype=torch.float32),
            original_rewards=None if self.original_reward is None else torch.tensor([self.original_reward], dtype=torch.float32),
            is_truncated=None if self.is_truncated is None else torch.tensor([self.is_truncated]),
        )


# ---------------------------------------------------------------------------- pure helpers


def compute_output_versions(versions: Sequence[int], mask: Sequence[int]) -> tuple[int, int, list[list[int]]]:
    """``(head, tail, rle)`` of the versions at ``mask == 1`` positions, in token order.

    ``head``/``tail`` are the min/max (-1 when no position is masked in); ``rle`` merges
    adjacent equal versions into ``[version, count]`` runs.
    """
    out = [v for v, m in zip(versions, mask, strict=True) if m == 1]
    if not out:
        return -1, -1, []
    rle: list[list[int]] = []
    for v in out:
        if rle and rle[-1][0] == v:
            rle[-1][1] += 1
        else:
            rle.append([v, 1])
    return min(out), max(out), rle


def _runs(mask: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of equal values: ``(value, start, end)``."""
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            yield mask[start], start, i
            start = i


@attrs.frozen
class DumpSplit:
    """What :func:`split_trajectory_for_dump` returns."""

    prompt_end: int
    prompt_text: str
    completion_text: str
    segments: list[DumpSegment] | None


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=False))


def split_trajectory_for_dump(ids: Sequence[int], mask: Sequence[int], tokenizer: Any) -> DumpSplit:
    """Split a row at its first generated token, and into segments if it has several generations.

    Segments (only with two or more ``mask == 1`` runs) are ``gen`` for generated runs,
    ``prompt`` for a non-generated run starting at index 0 and ``context`` for every
    other non-generated run (DESIGN: unlike the reference, a run between generations is
    never called the prompt).
    """
    if len(ids) != len(mask):
        raise ValueError(f"ids length {len(ids)} != mask length {len(mask)}")
    prompt_end = next((i for i, m in enumerate(mask) if m == 1), len(ids))
    runs = list(_runs(mask))
    segments = None
    if sum(1 for value, _, _ in runs if value == 1) > 1:
        segments = [
            DumpSegment("gen" if value == 1 else ("prompt" if start == 0 else "context"), end - start, _decode(tokenizer, ids[start:end]))
            for value, start, end in runs
        ]
    return DumpSplit(prompt_end, _decode(tokenizer, ids[:prompt_end]), _decode(tokenizer, ids[prompt_end:]), segments)


def _as_trajectory(traj: Trajectory | Mapping[str, Any]) -> Trajectory:
    return traj if isinstance(traj, Trajectory) else Trajectory.from_dict(traj)


def trajectory_lines(
    traj: Trajectory | Mapping[str, Any],
    *,
    task_id: int,
    tokenizer: Any,
    accepted: bool = True,
    version: int | None = None,
) -> tuple[int, list[str]]:
    """The version directory and the JSONL lines (each ending in a newline) of one trajectory.

    Rows with no attended token, or whose last attended token was not generated, are
    skipped (their ``sample_idx`` leaves a gap). Raises ``ValueError`` when a required
    tensor is missing.

    A trajectory without ``versions`` says nothing about the weights that generated it:
    its generated tokens and its directory get ``version`` when the caller gives one (the
    reference passes the engine's version at dump time), else -1, "unknown". Either way a
    warning says which it was, and that it was not read from the trajectory.
    """
    t = _as_trajectory(traj)
    if t.rewards is None or t.loss_mask is None:
        raise ValueError(_MISSING)
    attn = t.attention_mask.sum(dim=1).tolist()
    ids_rows = t.input_ids.tolist()
    mask_rows = t.loss_mask.tolist()
    rewards = t.rewards.tolist()
    originals = None if t.original_rewards is None else t.original_rewards.tolist()
    truncated = None if t.is_truncated is None else t.is_truncated.tolist()
    logprob_rows = None if t.logprobs is None else t.logprobs.tolist()
    if t.versions is not None:
        version_rows = t.versions.tolist()
        global_tail = int(t.versions.max())
    else:
        if version is None:
            logger.warning(
                "task %d: the trajectory has no 'versions'; dumped under version -1 (unknown); pass dump(version=...) "
                "to record one",
                task_id,
            )
        else:
            logger.warning(
                "task %d: the trajectory has no 'versions'; dumped under version %d, given by the caller (not read "
                "from the trajectory)",
                task_id,
                version,
            )
        fallback = -1 if version is None else int(version)
        version_rows = [[fallback if m == 1 else -1 for m in row] for row in mask_rows]
        global_tail = fallback
    lines = []
    for i, seqlen in enumerate(attn):
        if seqlen == 0:
            continue
        ids, mask = ids_rows[i][:seqlen], mask_rows[i][:seqlen]
        if mask[-1] != 1:
            continue
        versions = version_rows[i][:seqlen]
        head, tail, rle = compute_output_versions(versions, mask)
        split = split_trajectory_for_dump(ids, mask, tokenizer)
        record: dict[str, Any] = {
            "task_id": task_id,
            "sample_idx": i,
            "seqlen": seqlen,
            "prompt_len": split.prompt_end,
            "head_version": head,
            "tail_version": tail,
            "version_rle": rle,
            "reward": rewards[i],
            "prompt": split.prompt_text,
            "completion": split.completion_text,
        }
        if split.segments is not None:
            record["segments"] = [{"role": s.role, "len": s.len, "text": s.text} for s in split.segments]
        if originals is not None:
            record["original_reward"] = originals[i]
        record["accepted"] = accepted
        record["tokens"] = {
            "input_ids": ids,
            "loss_mask": mask,
            "logprobs": None if logprob_rows is None else logprob_rows[i][:seqlen],
            "versions": versions,
        }
        if truncated is not None:
            record["is_truncated"] = truncated[i]
        lines.append(json.dumps(record) + "\n")
    return global_tail, lines


def validate_name(field: str, value: Any) -> str:
    """``value`` if it is a safe single path component, else ``ValueError`` naming ``field``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: required for dumps; expected a non-empty name, got {value!r}")
    if NAME_PATTERN.fullmatch(value) is None:
        raise ValueError(
            f"{field}: must match {NAME_PATTERN.pattern} (a single path component, no separators or "
            f"leading dot), got {value!r}"
        )
    return value


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# ---------------------------------------------------------------------------- writing


@attrs.frozen
class DumpStatistics:
    """Counters of a :class:`TrajectoryDumper`.

    Attributes:
        dumped: trajectories written (or with no row to write).
        dump_failed: trajectories not (fully) written: an I/O error or a bad trajectory.
        lines: lines written.
        in_flight: dumps running now.
    """

    dumped: int
    dump_failed: int
    lines: int
    in_flight: int


# Each directory below fileroot: opened relative to its parent, never through a symlink.
# (getattr: these are POSIX flags; the dumper refuses to start where openat is missing.)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
# The dump file: O_NONBLOCK so a planted FIFO cannot block the open (fstat refuses it after).
_FILE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)


class DumpPathRefused(PermissionError):
    """A path below fileroot that a dump will not use (a symlink, a non-regular file)."""


def _refusal(parent: int, name: str, where: str, exc: OSError) -> OSError:
    """``exc``, or a :class:`DumpPathRefused` naming ``where`` when ``name`` is a symlink."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW's answers for a symlink
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            return DumpPathRefused(f"{where}: a symbolic link; not followed, so the dump stays inside fileroot")
    return exc


def _open_dir(parent: int, name: str, where: str) -> int:
    """The directory ``name`` under the descriptor ``parent``, made if missing; never a symlink."""
    try:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:  # made meanwhile; the open below judges what it is
                pass
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise _refusal(parent, name, where, exc) from None


def _open_file(parent: int, name: str, where: str) -> int:
    """``name`` under ``parent`` for appending, made if missing: a regular file with one link only."""
    try:
        fd = os.open(name, _FILE_FLAGS, 0o644, dir_fd=parent)
    except OSError as exc:
        raise _refusal(parent, name, where, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpPathRefused(f"{where}: not a regular file; refused")
        if st.st_nlink > 1:  # a hard link would carry the lines to a file elsewhere
            raise DumpPathRefused(f"{where}: has {st.st_nlink} hard links; refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


# Per-file locks by striping: the same file always maps to the same lock, and the
# number of locks stays fixed however many task files a long run creates.
_STRIPES = 64


class TrajectoryDumper:
    """Writes trajectories as JSONL lines under ``{fileroot}/{experiment_name}/{trial_name}``.

    Use it as ``async with dumper:``; ``await dumper.dump(traj, task_id=...)`` decodes and
    writes in a worker thread and returns whether everything was written. A failure (disk
    full, permission, a file where a directory should be) is logged and counted in
    :meth:`statistics`, never raised: the trajectory itself is never lost to a dump.

    Entering a dumper whose directory already holds dumped files logs a warning naming
    the directory and how many files are there: the new lines are appended to that dump
    (on purpose, when a run resumes; by mistake, when two runs share a trial name).

    Args:
        fileroot: the directory every dump lies under.
        experiment_name, trial_name: single path components matching :data:`NAME_PATTERN`.
        tokenizer: anything with ``decode(ids, skip_special_tokens=False)``, or a local
            tokenizer directory (loaded once, in a worker thread, at the first dump).
        max_threads: worker threads decoding and writing at once.

    Raises:
        ValueError: naming the field, for a missing or unsafe piece.
    """

    def __init__(
        self,
        fileroot: str | os.PathLike[str],
        experiment_name: str,
        trial_name: str,
        tokenizer: Any,
        *,
        max_threads: int = 2,
    ) -> None:
        if fileroot is None or not os.fspath(fileroot):
            raise ValueError(f"fileroot: required for dumps; expected a directory, got {fileroot!r}")
        validate_name("experiment_name", experiment_name)
        validate_name("trial_name", trial_name)
        if isinstance(tokenizer, (str, os.PathLike)):
            if not os.path.isdir(tokenizer):
                raise ValueError(f"tokenizer: expected a tokenizer directory, got {os.fspath(tokenizer)!r} (not a directory)")
        elif tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer: required for dumps; expected an object with decode() or a directory, got {tokenizer!r}")
        if max_threads < 1:
            raise ValueError(f"max_threads: must be >= 1, got {max_threads!r}")
        if os.open not in os.supports_dir_fd or not _NOFOLLOW:
            raise NotImplementedError("trajectory dumps need openat() and O_NOFOLLOW (a POSIX system)")
        self._root = os.path.realpath(os.fspath(fileroot))
        self.directory = Path(self._root, experiment_name, trial_name)
        if not _is_under(os.path.realpath(self.directory), self._root):
            raise ValueError(f"experiment_name/trial_name: {self.directory} resolves outside fileroot {self._root}")
        self._names = (experiment_name, trial_name)
        self._root_fd: int | None = None  # opened at the first dump, closed when the last one ends
        self._root_lock = threading.Lock()
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(max_threads)
        self._locks = [threading.Lock() for _ in range(_STRIPES)]
        self._dumped = self._failed = self._lines = self._in_flight = 0
        self._idle = trio.Event()
        self._idle.set()
        self._state: Literal["new", "open", "closed"] = "new"

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded from its directory on first use when given as a path)."""
        with self._tokenizer_lock:
            if isinstance(self._tokenizer, (str, os.PathLike)):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(os.fspath(self._tokenizer), local_files_only=True)
            return self._tokenizer

    async def __aenter__(self) -> TrajectoryDumper:
        if self._state != "new":
            raise RuntimeError("a TrajectoryDumper can be entered once")
        self._state = "open"
        existing = await trio.to_thread.run_sync(_count_dump_files, self.directory)
        if existing:
            files = "1 dumped file" if existing == 1 else f"{existing}{'+' if existing >= _COUNT_AT_MOST else ''} dumped files"
            logger.warning("trajectory dump directory %s already holds %s; new lines are appended", self.directory, files)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._state = "closed"
        # Dumps still in flight in other tasks finish their lines; wait for them, bounded.
        with trio.CancelScope(shield=True), trio.move_on_after(60) as scope:
            await self._idle.wait()
        if scope.cancelled_caught:
            logger.warning("trajectory dumps still running after 60 s at close: %d", self._in_flight)
        else:  # else the last dump to end closes it: a thread may still be writing below it
            self._close_root_once_closed()

    def _close_root_once_closed(self) -> None:
        with self._root_lock:
            if self._state == "closed" and self._root_fd is not None:
                os.close(self._root_fd)
                self._root_fd = None

    def path_for(self, *, task_id: int, version: int, is_eval: bool = False) -> Path:
        """Where the lines of ``task_id`` at ``version`` go."""
        if type(task_id) is not int:
            raise TypeError(f"task_id: must be an int, got {task_id!r}")
        return self.directory / ("eval-rollout" if is_eval else "rollout") / str(int(version)) / f"{task_id}.jsonl"

    def statistics(self) -> DumpStatistics:
        """The counters so far."""
        return DumpStatistics(self._dumped, self._failed, self._lines, self._in_flight)

    async def dump(
        self,
        traj: Trajectory | Mapping[str, Any] | None,
        *,
        task_id: int,
        is_eval: bool = False,
        accepted: bool = True,
        version: int | None = None,
    ) -> bool:
        """Write ``traj``'s rows; True when every line was written.

        ``accepted`` is False for a trajectory the acceptance filter rejected.
        ``version`` is recorded for a trajectory without ``versions`` (e.g. the engine's
        version now, as the reference does); without it such rows go under version -1.
        A ``None`` trajectory writes nothing and returns False.
        """
        if self._state != "open":
            raise trio.ClosedResourceError("the TrajectoryDumper is not open (use `async with dumper:`)")
        if type(task_id) is not int:
            raise TypeError(f"task_id: must be an int, got {task_id!r}")
        if traj is None:
            await trio.lowlevel.checkpoint()
            return False
        self._in_flight += 1
        self._idle = trio.Event() if self._in_flight == 1 else self._idle
        try:
            ok, lines = await trio.to_thread.run_sync(
                self._dump_sync, traj, task_id, is_eval, accepted, version, limiter=self._limiter
            )
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
                self._close_root_once_closed()
        self._lines += lines
        if ok:
            self._dumped += 1
        else:
            self._failed += 1
        return ok

    def _dump_sync(
        self, traj: Trajectory | Mapping[str, Any], task_id: int, is_eval: bool, accepted: bool, version: int | None
    ) -> tuple[bool, int]:
        try:
            tail, lines = trajectory_lines(traj, task_id=task_id, tokenizer=self.tokenizer, accepted=accepted, version=version)
        except Exception as exc:  # a bad trajectory must not take the run down with it
            logger.warning("trajectory dump of task %d failed: %s", task_id, exc)
            return False, 0
        if not lines:
            return True, 0
        path = self.path_for(task_id=task_id, version=tail, is_eval=is_eval)
        scope = "eval-rollout" if is_eval else "rollout"
        written, error = self._append((*self._names, scope, str(tail)), f"{task_id}.jsonl", lines)
        if error is not None:
            logger.warning("trajectory dump of task %d to %s failed: %s", task_id, path, error)
        return error is None, written

    def _root_descriptor(self) -> int:
        """fileroot's descriptor, opened (and fileroot made) once; fileroot itself is trusted."""
        with self._root_lock:
            if self._root_fd is None:
                os.makedirs(self._root, exist_ok=True)
                self._root_fd = os.open(self._root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
            return self._root_fd

    def _append(self, directories: tuple[str, ...], name: str, lines: list[str]) -> tuple[int, OSError | None]:
        """Lines written to ``name`` under ``directories``, and the error that stopped the rest."""
        written = 0
        opened: list[int] = []
        try:
            parent = self._root_descriptor()
            where = self._root
            for part in directories:
                where = os.path.join(where, part)
                parent = _open_dir(parent, part, where)
                opened.append(parent)
            fd = _open_file(parent, name, os.path.join(where, name))
            try:
                with self._locks[hash((directories, name)) % _STRIPES]:
                    if fcntl is not None:
                        fcntl.flock(fd, fcntl.LOCK_EX)
                    try:
                        for line in lines:
                            _write_line(fd, line.encode())
                            written += 1
                    finally:
                        if fcntl is not None:
                            fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        except OSError as exc:
            return written, exc
        finally:
            for directory in opened:
                os.close(directory)
        return written, None


_COUNT_AT_MOST = 1000  # entering a dumper never walks a whole large dump to count it


def _count_dump_files(directory: Path) -> int:
    """The ``.jsonl`` files under ``directory``, up to :data:`_COUNT_AT_MOST` (symlinks not
    followed; none if it does not exist)."""
    found = 0
    for _, _, names in os.walk(directory):
        found += sum(name.endswith(".jsonl") for name in names)
        if found >= _COUNT_AT_MOST:
            return _COUNT_AT_MOST
    return found


def _write_line(fd: int, data: bytes) -> None:
    """One ``write`` (a regular file takes it whole); on failure, cut any partial line back off."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = os.write(fd, data)
        while written < len(data):  # only on a filling disk; the next write reports the error
            written += os.write(fd, data[written:])
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------------------- reading

#: The longest dump line :func:`read_dump` reads, in bytes (about 1M tokens with their texts).
#: A line is parsed whole, so this bounds the memory one record may take.
MAX_LINE_BYTES = MAX_DUMP_LINE_BYTES

_ROLES = ("prompt", "gen", "context")


class _Rule(ValueError):
    """A field of a dump line that breaks its rule: ``field: rule, got value``."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _broken(field: str, rule: str, value: Any) -> _Rule:
    return _Rule(f"{field}: must be {rule}, got {_shown(value)} ({type(value).__name__})")


def _get(obj: Mapping[str, Any], field: str) -> Any:
    if field not in obj:
        raise _Rule(f"{field}: missing")
    return obj[field]


def _int(value: Any, field: str) -> int:
    if type(value) is not int:  # JSON has no other integers; never a bool, a float or a string
        raise _broken(field, "an integer", value)
    return value


def _float(value: Any, field: str) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            raise _Rule(f"{field}: must be a number a float can hold, got an integer of {value.bit_length()} bits") from None
    raise _broken(field, "a number", value)


def _str(value: Any, field: str) -> str:
    if type(value) is not str:
        raise _broken(field, "a string", value)
    return value


def _bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise _broken(field, "true or false", value)
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise _broken(field, "an object", value)
    return value


def _ints(value: Any, field: str) -> tuple[int, ...]:
    if type(value) is not list or not set(map(type, value)) <= {int}:
        raise _broken(field, "a list of integers", value)
    return tuple(value)


def _floats(value: Any, field: str) -> tuple[float, ...]:
    if type(value) is not list or not set(map(type, value)) <= {float, int}:
        raise _broken(field, "a list of numbers", value)
    return tuple(_float(v, f"{field}[{i}]") for i, v in enumerate(value))


def _rle(value: Any) -> tuple[tuple[int, int], ...]:
    if type(value) is not list:
        raise _broken("version_rle", "a list of [version, count] pairs", value)
    runs = []
    for i, run in enumerate(value):
        if type(run) is not list or len(run) != 2:
            raise _broken(f"version_rle[{i}]", "a [version, count] pair", run)
        runs.append((_int(run[0], f"version_rle[{i}][0]"), _int(run[1], f"version_rle[{i}][1]")))
    return tuple(runs)


def _segments(value: Any) -> tuple[DumpSegment, ...] | None:
    if value is None:
        return None
    if type(value) is not list:
        raise _broken("segments", "a list of objects", value)
    segments = []
    for i, item in enumerate(value):
        seg = _object(item, f"segments[{i}]")
        role = _get(seg, "role")
        if role not in _ROLES:
            raise _broken(f"segments[{i}].role", f"one of {list(_ROLES)}", role)
        segments.append(
            DumpSegment(role, _int(_get(seg, "len"), f"segments[{i}].len"), _str(_get(seg, "text"), f"segments[{i}].text"))
        )
    return tuple(segments)


def _tokens(value: Any) -> DumpTokens | None:
    if value is None:
        return None
    tokens = _object(value, "tokens")
    logprobs = tokens.get("logprobs")
    return DumpTokens(
        input_ids=_ints(_get(tokens, "input_ids"), "tokens.input_ids"),
        loss_mask=_ints(_get(tokens, "loss_mask"), "tokens.loss_mask"),
        logprobs=None if logprobs is None else _floats(logprobs, "tokens.logprobs"),
        versions=_ints(_get(tokens, "versions"), "tokens.versions"),
    )


def _record(obj: Any, version: int, is_eval: bool) -> DumpRecord:
    """``obj`` (a parsed line) as a record; every value must have its field's JSON type."""
    obj = _object(obj, "the line")
    truncated = obj.get("is_truncated")
    original = obj.get("original_reward")
    return DumpRecord(
        task_id=_int(_get(obj, "task_id"), "task_id"),
        sample_idx=_int(_get(obj, "sample_idx"), "sample_idx"),
        seqlen=_int(_get(obj, "seqlen"), "seqlen"),
        prompt_len=_int(_get(obj, "prompt_len"), "prompt_len"),
        head_version=_int(_get(obj, "head_version"), "head_version"),
        tail_version=_int(_get(obj, "tail_version"), "tail_version"),
        version_rle=_rle(_get(obj, "version_rle")),
        reward=_float(_get(obj, "reward"), "reward"),
        prompt=_str(_get(obj, "prompt"), "prompt"),
        completion=_str(_get(obj, "completion"), "completion"),
        segments=_segments(obj.get("segments")),
        original_reward=None if original is None else _float(original, "original_reward"),
        accepted=_bool(obj.get("accepted", True), "accepted"),
        tokens=_tokens(obj.get("tokens")),
        is_truncated=None if truncated is None else _bool(truncated, "is_truncated"),
        version=version,
        is_eval=is_eval,
    )


def _dump_file_key(path: Path) -> tuple[bool, int, int] | None:
    """``(is_eval, version, task_id)`` from ``…/{scope}/{version}/{task_id}.jsonl``, or None."""
    scope, version, task = path.parent.parent.name, path.parent.name, path.stem
    if scope not in SCOPES or not re.fullmatch(r"-?\d+", version) or not re.fullmatch(r"-?\d+", task):
        return None
    return SCOPES[scope], int(version), int(task)


def read_dump(path: str | os.PathLike[str], *, max_line_bytes: int = MAX_LINE_BYTES) -> list[DumpRecord]:
    """Load a dump (a directory at any level of the layout, or one ``.jsonl`` file) into records.

    Records come ordered by scope (training first), version, task id, then line order.
    Every value must have its field's JSON type (``"accepted": "false"`` is an error, not
    True); a line longer than ``max_line_bytes`` is an error, found without reading it whole.

    Args:
        path: a dump directory (any level of the layout) or one ``.jsonl`` file.
        max_line_bytes: the longest line accepted, in bytes.

    Returns:
        The records, as :class:`DumpRecord` objects.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming the file and line, for a line that is not a dump record; naming
            the file, for a dump file that is not a regular file (a FIFO, a directory).
    """
    return list(iter_dump(path, max_line_bytes=max_line_bytes))


def iter_dump(
    path: str | os.PathLike[str],
    *,
    light: bool = False,
    only: Container[int] | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Iterator[DumpRecord]:
    """:func:`read_dump`, one record at a time, for dumps too big to hold.

    ``light`` drops ``tokens``, ``segments`` and the texts (the bulk of a line) unchecked;
    ``only`` parses just the records at these positions (in read order) and skips the
    other lines unparsed.
    """
    if type(max_line_bytes) is not int or max_line_bytes < 1:
        raise ValueError(f"max_line_bytes: must be an integer >= 1, got {max_line_bytes!r}")
    root = Path(path)
    try:
        mode = root.stat().st_mode  # stat, not open: a FIFO given here must not block
    except FileNotFoundError:
        raise FileNotFoundError(f"dump path {str(root)!r} does not exist") from None
    if stat.S_ISREG(mode):
        key = _dump_file_key(root.absolute())
        if key is None:
            raise ValueError(f"{root}: not a dump file; expected …/rollout|eval-rollout/<version>/<task_id>.jsonl")
        keyed = [(key, root)]
    elif stat.S_ISDIR(mode):  # other JSON-lines files beside a dump (a trainer's logs) are not dump files: skip them
        found = ((_dump_file_key(f.absolute()), f) for f in root.rglob("*.jsonl"))
        keyed = sorted((key, f) for key, f in found if key is not None)
    else:
        raise ValueError(f"{root}: not a regular file or a directory; expected a dump directory or a .jsonl file")
    return _iter_records(keyed, light, only, max_line_bytes)


def _open_regular(file: Path) -> Any:
    """``file`` opened for binary reading, if it is a regular file (checked on the open descriptor)."""
    # O_NONBLOCK: opening a FIFO for reading would wait for a writer.
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{file}: not a regular file; a dump file is a regular .jsonl file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _iter_records(
    keyed: list[tuple[tuple[bool, int, int], Path]], light: bool, only: Container[int] | None, max_line_bytes: int
) -> Iterator[DumpRecord]:
    index = -1
    for (is_eval, version, _), file in keyed:
        with _open_regular(file) as fh:
            lineno = 0
            while line := fh.readline(max_line_bytes + 1):  # never more than the bound in memory
                lineno += 1
                if len(line.rstrip(b"\n")) > max_line_bytes:
                    raise ValueError(
                        f"{file}:{lineno}: line longer than {max_line_bytes} bytes (max_line_bytes); not read"
                    )
                if not line.strip():
                    continue
                index += 1
                if only is not None and index not in only:
                    continue
                try:
                    obj = json.loads(line)
                    if light and isinstance(obj, dict):
                        obj.update(prompt="", completion="", tokens=None, segments=None)
                    record = _record(obj, version, is_eval)
                except (ValueError, RecursionError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
                    detail = str(exc) if isinstance(exc, _Rule) else f"{type(exc).__name__}: {exc}"
                    raise ValueError(f"{file}:{lineno}: not a dump record: {detail}") from None
                yield record
