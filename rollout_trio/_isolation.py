"""Killable worker processes for rewards and subprocess agents, on trio-parallel.

trio-parallel owns the processes, the pipes and their framing, and kills a worker when
its call is cancelled (``kill_on_cancel``). On top of it this module adds what a hostile
or careless job needs: each worker leads its own session, so the whole process group is
killed with it (the job's children included); every reply carries the call's nonce, so a
message the job forged is refused (and its worker killed) instead of reaching another
call; any reply the channel cannot decode is a typed error; values and exceptions are
unpickled here, so one that does not unpickle is a typed error with the original
traceback text and the worker lives on. Workers start with multiprocessing's ``spawn``,
so functions defined in a script's ``__main__`` work as with the standard library's
process pools (the script must guard its entry point with ``if __name__ == "__main__"``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import trio
import trio_parallel  # type: ignore[import-untyped]

from . import _isolation_worker as worker

__all__ = ["IsolatedWorkers", "WorkerDied", "WorkerTimedOut", "unpickle_reply"]

logger = logging.getLogger("rollout_trio.isolation")

# The parent pickles worker functions under the name the worker loads them by (see BOOT).
sys.modules.setdefault(worker.NAME, worker)
for _fn in (worker.call, worker.call_with_env, worker.run_agent):
    _fn.__module__ = worker.NAME

# trio-parallel's `init`: load the worker module by path (never importing rollout_trio),
# then lead a new session. A partial of a builtin pickles without importing anything.
BOOT = functools.partial(
    exec,
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location({worker.NAME!r}, {worker.__file__!r})\n"
    "module = importlib.util.module_from_spec(spec)\n"
    f"sys.modules[{worker.NAME!r}] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.start_session()\n",
    {},
)
_ONE_JOB = functools.partial(bool, 1)  # trio-parallel's `retire`: after every job
_SPAWN_TIMEOUT = 60.0  # seconds a worker may take to start (outside the call's timeout)
_DEATH_TIMEOUT = 5.0  # seconds to wait for a killed worker to be gone
_GRACE = 5.0  # seconds idle workers get to exit at shutdown


class WorkerTimedOut(Exception):
    """No reply within the timeout; the worker and its process group were killed."""


class WorkerDied(Exception):
    """The worker died, or its reply could not be read or was not this call's."""


def _kill_group(pid: int | None) -> None:
    """SIGKILL the process group ``pid`` leads (the worker and everything it started)."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text())
    except (OSError, ValueError):
        return None  # the job never started: it has no children to kill


def _gone(pid: int) -> bool:
    """Dead (a zombie counts: its pipes are closed)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def unpickle_reply(status: str, body: bytes | None, text: str, where: str) -> Any:
    """The job's value, or raise its exception (with the remote traceback as a note).

    Raises:
        WorkerDied: the exception could not be pickled or unpickled, or the value could
            not be unpickled here (the message keeps the original traceback text).
    """
    try:
        obj = pickle.loads(body) if body is not None else None
    except Exception as exc:
        what = "the value" if status == "ok" else "the exception"
        raise WorkerDied(f"{what} from the {where} cannot be unpickled here ({exc!r}):\n{text}") from None
    if status == "ok":
        return obj
    if isinstance(obj, BaseException):
        obj.add_note(f"raised in the {where}:\n{text}")
        raise obj
    raise WorkerDied(f"the {where} failed:\n{text}")


class IsolatedWorkers:
    """Up to ``max_workers`` worker processes; ``async with`` owns them all.

    ``one_job=True`` retires each worker after one job (a fresh process per call).
    """

    def __init__(self, max_workers: int, *, one_job: bool = False, what: str = "worker process") -> None:
        self.max_workers = max_workers
        self.what = what
        self._one_job = one_job
        self._limiter = trio.CapacityLimiter(max_workers)  # held outside the call's timeout
        self._inner = trio.CapacityLimiter(max_workers)  # trio-parallel's own (never contended)
        self._pids: set[int] = set()
        self._ctx: trio_parallel.WorkerContext | None = None
        self._stack: AsyncExitStack | None = None
        self._dir: Path | None = None
        self._closed = False

    @property
    def pids(self) -> set[int]:
        """The process ids of the live workers."""
        return set(self._pids)

    async def __aenter__(self) -> IsolatedWorkers:
        if self._stack is not None or self._closed:
            raise RuntimeError(f"a pool of {self.what}es can be entered once")
        stack = AsyncExitStack()
        self._ctx = await stack.enter_async_context(
            trio_parallel.open_worker_context(
                idle_timeout=math.inf, init=BOOT, retire=_ONE_JOB if self._one_job else bool, grace_period=_GRACE
            )
        )
        self._stack = stack
        # Each call's worker writes its pid here (tmpfs when there is one: it is per call).
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._dir = Path(tempfile.mkdtemp(prefix="rollout-trio-workers-", dir=shm))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closed = True
        assert self._stack is not None and self._dir is not None
        try:
            with trio.CancelScope(shield=True):
                await self._stack.aclose()
        except trio_parallel.BrokenWorkerError as err:  # workers we killed on purpose
            logger.debug("%s pool shut down: %s", self.what, err)
        finally:
            for pid in self._pids:  # anything a finished job left behind in its group
                _kill_group(pid)
            self._pids.clear()
            shutil.rmtree(self._dir, ignore_errors=True)

    def _check_open(self) -> trio_parallel.WorkerContext:
        if self._closed:
            raise RuntimeError(f"the {self.what} pool has been shut down (its `async with` block ended)")
        if self._ctx is None:
            raise RuntimeError(f"the {self.what} pool is not running: use it inside `async with`")
        return self._ctx

    async def _warm(self, ctx: trio_parallel.WorkerContext) -> None:
        """Start a worker outside the call's timeout when none is idle."""
        if self._one_job or ctx.statistics().idle_workers:
            return
        try:
            with trio.fail_after(_SPAWN_TIMEOUT):
                self._pids.add(await ctx.run_sync(os.getpid, kill_on_cancel=True, limiter=self._inner))
        except trio.TooSlowError:
            raise WorkerDied(f"a {self.what} did not start within {_SPAWN_TIMEOUT} s") from None
        except trio_parallel.BrokenWorkerError as exc:
            raise WorkerDied(self._death(exc, None)) from None

    def _forget(self, pid: int | None) -> None:
        _kill_group(pid)
        if pid is not None:
            self._pids.discard(pid)

    async def run(
        self, payload: bytes, timeout: float = math.inf, env: dict[str, str] | None = None
    ) -> tuple[str, bytes | None, str]:
        """Run the pickled ``(fn, args, kwargs)`` in a worker; ``(status, body, text)``.

        Raises:
            WorkerTimedOut: no reply within ``timeout`` s.
            WorkerDied: the worker died, or its reply was unreadable or not this call's.
        """
        ctx = self._check_open()
        async with self._limiter:
            ctx = self._check_open()
            await self._warm(ctx)
            assert self._dir is not None
            nonce = secrets.token_hex(16)
            pid_file = self._dir / nonce
            pid: int | None = None
            try:
                with trio.move_on_after(timeout) as scope:
                    try:
                        if env is None:
                            reply = await ctx.run_sync(
                                worker.call, nonce, str(pid_file), payload, kill_on_cancel=True, limiter=self._inner
                            )
                        else:
                            reply = await ctx.run_sync(
                                worker.call_with_env, nonce, str(pid_file), env, payload,
                                kill_on_cancel=True, limiter=self._inner,
                            )  # fmt: skip
                    except BaseException:  # cancelled, timed out, died, garbage: the group goes too
                        self._forget(_read_pid(pid_file))
                        raise
                if scope.cancelled_caught:
                    raise WorkerTimedOut(f"no reply within {timeout} s; {self.what} {_read_pid(pid_file)} was killed")
            except trio_parallel.BrokenWorkerError as exc:
                raise WorkerDied(self._death(exc, _read_pid(pid_file))) from None
            except (trio.Cancelled, WorkerTimedOut):
                raise
            except Exception as exc:  # the channel carried something trio-parallel could not decode
                raise WorkerDied(f"the {self.what}'s reply could not be read ({type(exc).__name__}: {exc}); it was killed") from None
            finally:
                pid = _read_pid(pid_file)  # written by the worker itself, before the job ran
                pid_file.unlink(missing_ok=True)
            return await self._accept(reply, nonce, pid)

    async def _accept(self, reply: Any, nonce: str, pid: int | None) -> tuple[str, bytes | None, str]:
        if isinstance(reply, tuple) and len(reply) == 5 and reply[0] == nonce and reply[1] == pid:
            _, _, status, body, text = reply
            if pid is not None and not self._one_job:
                self._pids.add(pid)
            return status, body, text
        # Forged by the job: kill the worker, so its real reply dies with it instead of
        # reaching the next call (trio-parallel then replaces the dead worker).
        if pid is not None:
            self._forget(pid)
            with trio.move_on_after(_DEATH_TIMEOUT):
                while not _gone(pid):
                    await trio.sleep(0.005)
        raise WorkerDied(f"the {self.what} sent a reply that is not this call's; it was killed")

    def _death(self, exc: BaseException, pid: int | None) -> str:
        if pid is not None:
            self._pids.discard(pid)
        proc = exc.args[-1] if exc.args else None
        code = getattr(proc, "exitcode", None)
        how = f"exited with status {code}"
        if code is not None and code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        if pid is not None:
            return f"{self.what} {pid} {how} without a result"
        return (
            f"{self.what} {getattr(proc, 'pid', '?')} {how} before its job started (its stderr says why; "
            "a script that uses worker processes must guard its entry point with `if __name__ == '__main__':`, "
            "as with multiprocessing)"
        )
