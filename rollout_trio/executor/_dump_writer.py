"""The dump writer: :class:`TrajectoryDumper` appends a trajectory's lines under fileroot
without ever leaving it (see :mod:`rollout_trio.executor._dump` for the layout and the rules).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import attrs
import trio

from .._trajectory import Trajectory
from ._dump_records import trajectory_dump, validate_name

try:
    import fcntl
except ImportError:  # Windows: no flock; each line is still one O_APPEND write
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("rollout_trio.dump")


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
            out = trajectory_dump(traj, task_id=task_id, tokenizer=self.tokenizer, accepted=accepted, version=version)
        except Exception as exc:  # a bad trajectory must not take the run down with it
            logger.warning("trajectory dump of task %d failed: %s", task_id, exc)
            return False, 0
        tail, lines = out.tail, out.lines
        if not lines:
            return True, 0
        path = self.path_for(task_id=task_id, version=tail, is_eval=is_eval)
        scope = "eval-rollout" if is_eval else "rollout"
        directories = (*self._names, scope, str(tail))
        if out.image_name is not None and out.image_bytes is not None:
            # The image file first: a line never names a file that is not (yet) there.
            error = self._write_whole(directories, out.image_name, out.image_bytes)
            if error is not None:
                logger.warning("trajectory dump of task %d: image file %s failed: %s", task_id, out.image_name, error)
                return False, 0
        written, error = self._append(directories, f"{task_id}.jsonl", lines)
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

    def _open_parents(self, directories: tuple[str, ...], opened: list[int]) -> tuple[int, str]:
        parent = self._root_descriptor()
        where = self._root
        for part in directories:
            where = os.path.join(where, part)
            parent = _open_dir(parent, part, where)
            opened.append(parent)
        return parent, where

    def _write_whole(self, directories: tuple[str, ...], name: str, data: bytes) -> OSError | None:
        """``data`` as the file ``name`` under ``directories``, made whole or not at all
        (a temporary file renamed into place); a file of that name already there is kept:
        names are content digests."""
        opened: list[int] = []
        try:
            parent, where = self._open_parents(directories, opened)
            try:
                os.stat(name, dir_fd=parent, follow_symlinks=False)
                return None
            except FileNotFoundError:
                pass
            tmp = f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=parent)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                os.close(fd)
                os.unlink(tmp, dir_fd=parent)
                raise
            os.close(fd)
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as exc:
            return exc
        finally:
            for directory in opened:
                os.close(directory)
        return None

    def _append(self, directories: tuple[str, ...], name: str, lines: list[str]) -> tuple[int, OSError | None]:
        """Lines written to ``name`` under ``directories``, and the error that stopped the rest."""
        written = 0
        opened: list[int] = []
        try:
            parent, where = self._open_parents(directories, opened)
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

