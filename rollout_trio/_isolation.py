"""Killable worker processes for rewards and subprocess agents: our own pool over pipes.

Each worker is a supervisor process (``_isolation_worker``) that imports the function once at
start, then forks a fresh child per call; the child's reply comes back on a pipe made for that
call, and the supervisor kills every descendant (``setsid`` and double-forked ones too: it is a
Linux child subreaper) before it answers. Between this process and a worker only
length-prefixed JSON crosses, bounded before it is read, and each answer carries the call's
random token, which no earlier call's code can know (it is dead before the token exists). A
value or exception is unpickled here only when the caller trusts the worker
(``trust_pickles=True``). The deadline is enforced here, not by the worker: at the timeout (or a
cancellation) this process itself kills every descendant of the supervisor, found in ``/proc``,
whatever they do with their pipes. Workers start before the first call (``start`` or
``async with``; lazily on the first call otherwise), and a call's timeout counts from its start
on a ready worker.
"""

from __future__ import annotations

import base64
import builtins
import logging
import math
import multiprocessing.process
import multiprocessing.spawn
import os
import pickle
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import trio

from . import _isolation_worker as worker

__all__ = ["IsolatedWorkers", "WorkerDied", "WorkerResourceError", "WorkerTimedOut"]

logger = logging.getLogger("rollout_trio.isolation")

# The parent pickles worker functions under the name the worker loads them by (see BOOT).
sys.modules.setdefault(worker.NAME, worker)
worker.run_agent.__module__ = worker.NAME

# Load the worker module by path (never importing rollout_trio, nor shadowing the standard
# library with this package's own modules), then serve on the two descriptors in argv.
BOOT = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location({worker.NAME!r}, {worker.__file__!r})\n"
    "module = importlib.util.module_from_spec(spec)\n"
    f"sys.modules[{worker.NAME!r}] = module\n"
    "spec.loader.exec_module(module)\n"
    "module.serve(int(sys.argv[1]), int(sys.argv[2]))\n"
)
_SPAWN_TIMEOUT = 60.0  # seconds a worker may take to start (outside any call's timeout)
_DRAIN_TIMEOUT = 30.0  # seconds a worker may take to report a call killed at its timeout
_DEATH_TIMEOUT = 5.0  # seconds to wait for a killed worker to be gone
LIMITS = ("address_space", "cpu_seconds", "open_files")
_GUARD = (
    "a script that uses worker processes must guard its entry point with `if __name__ == '__main__':`, "
    "as with multiprocessing"
)


class WorkerTimedOut(Exception):
    """No reply within the timeout; the call's processes were killed."""


class WorkerDied(Exception):
    """The call's process died, or its reply could not be read, was refused or was not this call's."""


class WorkerResourceError(WorkerDied):
    """The call ran out of one of its resource limits (address space, CPU seconds, open files)."""


def _how(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class _Worker:
    """One supervisor process and our ends of its two pipes."""

    def __init__(self, proc: trio.Process, send: int, recv: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.send = trio.lowlevel.FdStream(send)
        self.recv = trio.lowlevel.FdStream(recv)
        self.buf = worker._Channel(-1)
        self.pending: str | None = None  # the token of a call whose answer was not read

    async def put(self, obj: Any) -> None:
        await self.send.send_all(worker.frame(obj))

    async def get(self, limit: int) -> Any:
        """The next frame. Raises WorkerDied at end of file or on a malformed frame."""
        while True:
            try:
                msg = self.buf.take(limit)
            except ValueError as exc:
                raise WorkerDied(f"its reply could not be read ({exc})") from None
            if msg is not ...:
                return msg
            data = await self.recv.receive_some(1 << 16)
            if not data:
                raise WorkerDied("the worker process exited")
            self.buf.buf += data

    def kill_job(self) -> None:
        """Kill everything the worker started (the call's child and anything it left), not the worker."""
        worker.kill_tree(self.pid)

    def kill(self) -> None:
        worker.kill_tree(self.pid)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def close_fds(self) -> None:
        await self.send.aclose()
        await self.recv.aclose()


class _Run:
    """The pool's state in one Trio run (Trio objects cannot outlive their run)."""

    def __init__(self, size: int) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.idle_send, self.idle_recv = trio.open_memory_channel[_Worker | None](size)
        self.workers: set[_Worker] = set()
        self.started = trio.Event()
        self.error: BaseException | None = None


class IsolatedWorkers:
    """``max_workers`` supervisor processes running ``fn`` (see the module docstring).

    Nothing of Trio is created here: the workers start at ``start()`` / ``async with``, or at
    the first ``run`` when neither was used; a pool used from a new Trio run starts afresh.

    Args:
        fn: the function each call runs (picklable: the workers load it once, at start).
        max_workers: concurrent calls.
        what: how errors name a worker ("reward worker process").
        trust_pickles: values and exceptions cross as pickles and are unpickled here
            (only for a worker you trust: unpickling runs code). Default: JSON-like data only.
        limits: per-call resource limits, by name in :data:`LIMITS` (bytes, seconds, count).
        max_reply_bytes: the largest encoded value a call may return.
    """

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        max_workers: int,
        *,
        what: str = "worker process",
        trust_pickles: bool = False,
        limits: Mapping[str, int] | None = None,
        max_reply_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.max_workers = max_workers
        self.what = what
        self.trust_pickles = trust_pickles
        self.limits = dict(limits or {})
        self.max_reply_bytes = max_reply_bytes
        self._fn = pickle.dumps(fn)
        self._run: _Run | None = None
        self._closed = False

    @property
    def pids(self) -> set[int]:
        """The process ids of the live workers (their supervisors)."""
        return {w.pid for w in self._run.workers} if self._run is not None else set()

    async def __aenter__(self) -> IsolatedWorkers:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the workers (if not already) and wait until each is ready.

        Raises:
            RuntimeError: the pool was closed, or this runs while a worker imports the script.
            WorkerDied: a worker could not start (its message says why).
        """
        if self._closed:
            raise RuntimeError(f"the {self.what} pool has been shut down (it was closed or its `async with` block ended)")
        if getattr(multiprocessing.process.current_process(), "_inheriting", False):
            raise RuntimeError(f"a {self.what} pool was started while a worker imported the script: {_GUARD}")
        run = self._run
        if run is not None and run.token is not trio.lowlevel.current_trio_token():
            self._forget_run()  # left by an earlier Trio run
            run = None
        if run is not None:
            await run.started.wait()
            if run.error is not None:
                raise WorkerDied(str(run.error))
            return
        run = self._run = _Run(self.max_workers)
        # A pool started by a call (no `async with`) closes when its Trio run ends.
        trio.lowlevel.spawn_system_task(self._close_at_run_end, run, name=f"close the {self.what} pool")
        try:
            try:
                async with trio.open_nursery() as nursery:
                    for _ in range(self.max_workers):
                        nursery.start_soon(self._start_one, run)
            except BaseExceptionGroup as group:  # the first worker's error says why
                first: BaseException = group
                while isinstance(first, BaseExceptionGroup):
                    first = first.exceptions[0]
                raise first from None
        except BaseException as exc:
            run.error = exc
            self._forget_run()
            raise
        finally:
            run.started.set()

    async def _start_one(self, run: _Run) -> None:
        run.idle_send.send_nowait(await self._spawn(run))

    async def _spawn(self, run: _Run) -> _Worker:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        try:
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-c", BOOT, str(to_r), str(from_w)],
                stdin=subprocess.DEVNULL, pass_fds=(to_r, from_w), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            for fd in (to_w, from_r):
                os.close(fd)
            raise
        finally:
            os.close(to_r)
            os.close(from_w)
        w = _Worker(proc, to_w, from_r)
        run.workers.add(w)
        try:
            with trio.fail_after(_SPAWN_TIMEOUT):
                prep = multiprocessing.spawn.get_preparation_data("rollout-trio-worker")
                prep.pop("authkey", None)  # the workers use no multiprocessing connection
                await w.put({
                    "op": "boot", "prep": base64.b64encode(pickle.dumps(prep)).decode(),
                    "fn": base64.b64encode(self._fn).decode(), "limits": self.limits,
                    "trust": self.trust_pickles, "max_reply": self.max_reply_bytes,
                })  # fmt: skip
                msg = await w.get(1 << 20)
        except trio.TooSlowError:
            self._drop(run, w)
            raise WorkerDied(f"a {self.what} did not start within {_SPAWN_TIMEOUT} s") from None
        except BaseException:
            self._drop(run, w)
            raise
        if not (isinstance(msg, dict) and msg.get("op") == "ready"):
            self._drop(run, w)
            text = msg.get("text", "") if isinstance(msg, dict) else ""
            raise WorkerDied(f"a {self.what} failed to start (when it imports a script, {_GUARD}):\n{text}")
        return w

    def _drop(self, run: _Run, w: _Worker) -> None:
        w.kill()  # its pipes close when the streams are collected
        run.workers.discard(w)

    def _forget_run(self) -> None:
        """Kill the workers synchronously (their Trio objects may belong to another run)."""
        run, self._run = self._run, None
        if run is not None:
            for w in list(run.workers):
                self._drop(run, w)

    async def _close_at_run_end(self, run: _Run) -> None:
        try:
            await trio.sleep_forever()
        finally:
            if self._run is run:
                self._run = None
            await self._shutdown(run)

    async def aclose(self) -> None:
        """Kill every worker and everything it started; later calls raise RuntimeError."""
        self._closed = True
        run, self._run = self._run, None
        if run is not None:
            await self._shutdown(run)

    async def _shutdown(self, run: _Run) -> None:
        with trio.CancelScope(shield=True):
            for w in list(run.workers):
                w.kill()
            with trio.move_on_after(_DEATH_TIMEOUT):
                for w in list(run.workers):
                    await w.proc.wait()
            for w in list(run.workers):
                await w.close_fds()
            run.workers.clear()

    async def _ready(self, run: _Run, w: _Worker | None) -> _Worker:
        """``w``, once it has answered any call killed earlier; a fresh worker if it is gone."""
        if w is not None and w.pending is not None:
            try:
                with trio.fail_after(_DRAIN_TIMEOUT):
                    while True:
                        msg = await w.get(self.max_reply_bytes + (1 << 20))
                        if isinstance(msg, dict) and msg.get("token") == w.pending:
                            w.pending = None
                            break
            except (trio.TooSlowError, WorkerDied):
                self._drop(run, w)
                w = None
        if w is not None and w.proc.returncode is not None:
            self._drop(run, w)
            w = None
        return w if w is not None else await self._spawn(run)

    async def run(self, payload: bytes, timeout: float = math.inf, env: dict[str, str] | None = None) -> Any:
        """Call ``fn(*args, **kwargs)`` in a worker, ``payload`` being the pickled ``(args, kwargs)``.

        Returns:
            The call's value (JSON-like data unless ``trust_pickles``).

        Raises:
            RuntimeError: the pool was shut down.
            WorkerTimedOut: no reply within ``timeout`` s (counted once a worker is ready).
            WorkerResourceError: the call exceeded a resource limit.
            WorkerDied: the call's process died, its reply was unreadable, too large, not
                JSON-like or not this call's, or it raised a BaseException or an exception
                that cannot be rebuilt here (the message keeps its traceback).
            Exception: a built-in exception the call raised (its traceback as a note).
        """
        await self.start()
        run = self._run
        assert run is not None
        w: _Worker | None = await run.idle_recv.receive()
        try:
            w = await self._ready(run, w)
            token = secrets.token_hex(16)
            w.pending = token
            with trio.move_on_after(timeout) as scope:
                try:
                    await w.put({"op": "call", "token": token, "payload": base64.b64encode(payload).decode(), "env": env})
                    msg = await w.get(self.max_reply_bytes + (1 << 20))
                except BaseException:  # cancelled, or the worker died: nothing it started lives on
                    w.kill_job()
                    raise
            if scope.cancelled_caught:
                w.kill_job()
                raise WorkerTimedOut(f"no reply within {timeout} s; the {self.what}'s call was killed")
            if not (isinstance(msg, dict) and msg.get("token") == token):
                self._drop(run, w)
                w = None
                raise WorkerDied(f"the {self.what} sent a reply that is not this call's; it was killed")
            w.pending = None
            return self._decode(msg.get("reply"))
        except WorkerDied as exc:
            if w is not None and w.pending is not None:
                self._drop(run, w)
                w = None
            if str(exc).startswith("its reply"):
                raise WorkerDied(f"the {self.what}'s {str(exc)[4:]}; it was killed") from None
            raise
        finally:
            if self._run is run:
                run.idle_send.send_nowait(w)

    def _decode(self, reply: Any) -> Any:
        if not isinstance(reply, dict):
            raise WorkerDied(f"the {self.what}'s reply could not be read (not an object)")
        status = reply.get("status")
        if status == "ok":
            if "pickled" not in reply:
                return reply.get("value")
            if not self.trust_pickles:
                raise WorkerDied(f"the {self.what} sent a pickle, refused (trust_pickles is False)")
            try:
                return pickle.loads(base64.b64decode(str(reply["pickled"])))
            except Exception as exc:
                raise WorkerDied(f"the value from the {self.what} cannot be unpickled here ({exc!r})") from None
        if status == "error":
            raise self._exception(reply)
        if status == "died":
            code = reply.get("code")
            code = code if isinstance(code, int) else 0
            if code == -signal.SIGXCPU and "cpu_seconds" in self.limits:
                raise WorkerResourceError(f"the {self.what}'s call exceeded its cpu_seconds limit ({self.limits['cpu_seconds']} s)")
            raise WorkerDied(f"the {self.what}'s call {_how(code)} without a result")
        if status == "bad_value":
            raise WorkerDied(f"the {self.what}'s call returned no usable value: {str(reply.get('why'))[:1000]}")
        raise WorkerDied(f"the {self.what}'s reply could not be read ({str(reply.get('why'))[:1000]}); it was killed")

    def _exception(self, reply: dict[str, Any]) -> BaseException:
        name, module = str(reply.get("type")), str(reply.get("module"))
        message, text = str(reply.get("message"))[:4096], str(reply.get("traceback"))
        resource = reply.get("resource")
        if resource in LIMITS and resource in self.limits:
            return WorkerResourceError(f"the {self.what}'s call exceeded its {resource} limit: {name}: {message}")
        if reply.get("base") is True:
            return WorkerDied(f"the {self.what}'s call raised {name}({message}); the call fails, the run goes on:\n{text}")
        exc: BaseException | None = None
        if self.trust_pickles and isinstance(reply.get("pickled"), str):
            try:
                exc = pickle.loads(base64.b64decode(reply["pickled"]))
            except Exception as err:
                return WorkerDied(f"the exception from the {self.what} cannot be unpickled here ({err!r}):\n{text}")
        elif module == "builtins":
            cls = getattr(builtins, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    exc = cls(message)
                except Exception:
                    exc = None
        if not isinstance(exc, Exception):
            return WorkerDied(f"the {self.what}'s call raised {module}.{name}: {message}\n{text}")
        exc.add_note(f"raised in the {self.what}:\n{text}")
        return exc
