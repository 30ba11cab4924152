"""The worker side of process isolation: a supervisor process that forks one child per call.

Standard library only, and loaded by file path under the top-level name
``_rollout_trio_isolation_worker`` (see ``_isolation.BOOT``), so a worker never imports
rollout_trio (torch, transformers) just to run a reward.

The supervisor leads its own session and is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``):
whatever a job starts, even a ``setsid`` or double-forked daemon, stays a descendant of the
supervisor, found by walking ``/proc``. It imports the function once (at start, before the
first call), then per call forks a child that runs it and writes its reply on a pipe made for
that call alone. When the reply is in (or the child died), every descendant is killed before
the supervisor answers, so nothing a call started outlives it or sees the next call.
Everything crosses as length-prefixed JSON, never as a pickle (unless the caller trusts the
worker: ``trust``), with a size bound checked before a body is read.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import functools
import importlib
import json
import multiprocessing.process
import multiprocessing.spawn
import os
import pickle
import resource
import select
import signal
import struct
import sys
import time
import traceback
from typing import Any

NAME = "_rollout_trio_isolation_worker"
HEADER = struct.Struct(">I")
_PR_SET_CHILD_SUBREAPER = 36
_MAX_DEPTH = 64  # nesting of a JSON value
_TEXT = 64 * 1024  # bytes of message / traceback text kept
_LIMITS = {"address_space": resource.RLIMIT_AS, "cpu_seconds": resource.RLIMIT_CPU, "open_files": resource.RLIMIT_NOFILE}


def frame(obj: Any) -> bytes:
    data = json.dumps(obj, allow_nan=True, separators=(",", ":")).encode()
    return HEADER.pack(len(data)) + data


def descendants(root: int) -> list[int]:
    """The live (not zombie) descendants of ``root``, from ``/proc`` (empty without it)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    live = set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
        if fields[0] not in (b"Z", b"X"):
            live.add(int(name))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            stack.append(child)
            if child in live:
                out.append(child)
    return out


def kill_tree(root: int, group: int | None = None) -> bool:
    """SIGKILL every live descendant of ``root`` (not ``root``) until none is left; True when none is."""
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    for _ in range(2000):
        pids = descendants(root)
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.0005)  # killed processes take a moment to become zombies
    return False


def _plain(value: Any, depth: int = 0) -> None:
    """Raise TypeError unless ``value`` is JSON-like (None, bool, int, float, str, list, tuple, str-keyed dict)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if depth >= _MAX_DEPTH:
        raise TypeError(f"nested deeper than {_MAX_DEPTH}")
    if isinstance(value, (list, tuple)):
        for item in value:
            _plain(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"a dict key is {type(key).__name__}, not str")
            _plain(item, depth + 1)
    else:
        raise TypeError(f"{type(value).__module__}.{type(value).__qualname__} is not JSON-like")


def _error(exc: BaseException, trust: bool) -> dict[str, Any]:
    text = "".join(traceback.format_exception(exc))[-_TEXT:]
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:  # an event loop's wrapping
        exc = exc.exceptions[0]
    reply: dict[str, Any] = {
        "status": "error", "type": type(exc).__qualname__, "module": type(exc).__module__,
        "message": str(exc)[:_TEXT], "traceback": text,
        "base": not isinstance(exc, Exception),
    }  # fmt: skip
    if isinstance(exc, MemoryError):
        reply["resource"] = "address_space"
    elif isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        reply["resource"] = "open_files"
    if trust:
        try:
            reply["pickled"] = base64.b64encode(pickle.dumps(exc)).decode()
        except Exception:
            pass
    return reply


def _job(fn: Any, msg: dict[str, Any], boot: dict[str, Any], out: int) -> None:
    """In the forked child: run the call and write its reply frame on ``out``."""
    trust, max_reply = bool(boot.get("trust")), int(boot["max_reply"])
    try:
        for name, value in (boot.get("limits") or {}).items():
            soft = int(value)
            hard = soft + 1 if name == "cpu_seconds" else soft  # SIGXCPU first, SIGKILL a second later
            resource.setrlimit(_LIMITS[name], (soft, hard))
        os.environ.update(msg.get("env") or {})
        args, kwargs = pickle.loads(base64.b64decode(msg["payload"]))
        value = fn(*args, **kwargs)
        if trust:
            reply: dict[str, Any] = {"status": "ok", "pickled": base64.b64encode(pickle.dumps(value)).decode()}
        else:
            try:
                _plain(value)
            except TypeError as exc:
                reply = {"status": "bad_value", "why": f"the value is not JSON-like data ({exc})"}
            else:
                reply = {"status": "ok", "value": value}
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the call failed, not the run
        reply = _error(exc, trust)
    data = frame(reply)
    if len(data) - HEADER.size > max_reply:
        data = frame({"status": "bad_value", "why": f"the reply is {len(data)} bytes, over the limit of {max_reply}"})
    view = memoryview(data)
    while view:
        view = view[os.write(out, view) :]


class _Channel:
    """Length-prefixed JSON frames on one file descriptor, with a bound on a frame's size."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def fill(self) -> bool:
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)

    def take(self, limit: int) -> Any:
        """The next frame if it is whole (``...`` if not yet); ValueError when it is not a frame."""
        if len(self.buf) < HEADER.size:
            return ...
        (size,) = HEADER.unpack_from(self.buf)
        if size > limit:
            raise ValueError(f"a frame of {size} bytes announced, over the limit of {limit}")
        if len(self.buf) < HEADER.size + size:
            return ...
        body = bytes(self.buf[HEADER.size : HEADER.size + size])
        del self.buf[: HEADER.size + size]
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"not JSON ({type(exc).__name__})") from None


def _status(code: int) -> dict[str, Any]:
    return {"status": "died", "code": os.waitstatus_to_exitcode(code)}


class _Supervisor:
    def __init__(self, cmd: int, out: int) -> None:
        self.cmd, self.out = _Channel(cmd), out
        self.wake_r = -1
        try:  # orphans of a job (a setsid child whose parent exited) come back to us
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch_children(self) -> None:
        """Wake ``select`` on SIGCHLD (after boot: the script's import may run an event loop)."""
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def send(self, obj: Any) -> None:
        view = memoryview(frame(obj))
        while view:
            view = view[os.write(self.out, view) :]

    def receive(self) -> Any:
        """The trainer's next frame; None at end of file (the trainer is gone)."""
        while (msg := self.cmd.take(1 << 30)) is ...:
            if not self.cmd.fill():
                return None
        return msg

    def reap(self, child: int) -> int | None:
        """Reap every exited child; the wait status of ``child`` when it was among them."""
        found = None
        while True:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return found
            if pid == 0:
                return found
            if pid == child:
                found = code

    def _exit_status(self, child: int) -> int:
        try:
            return os.waitpid(child, 0)[1]
        except ChildProcessError:  # reaped by reap() in the meantime
            return 0

    def call(self, fn: Any, msg: dict[str, Any], boot: dict[str, Any]) -> dict[str, Any]:
        r, w = os.pipe()  # this call's own reply channel
        child = os.fork()
        if child == 0:
            try:
                os.setsid()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (r, self.cmd.fd, self.out, self.wake_r):
                    os.close(fd)
                _job(fn, msg, boot, w)
            finally:
                os._exit(0)
        os.close(w)
        reply = _Channel(r)
        code: int | None = None
        try:
            while True:
                try:
                    got = reply.take(int(boot["max_reply"]) + _TEXT * 4)
                except ValueError as exc:
                    return {"status": "bad", "why": str(exc)}
                if got is not ...:
                    return got if isinstance(got, dict) else {"status": "bad", "why": "not an object"}
                if code is not None:
                    return _status(code)
                ready, _, _ = select.select([r, self.wake_r, self.cmd.fd], [], [])
                if self.wake_r in ready:
                    while True:
                        try:
                            if not os.read(self.wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                    code = self.reap(child)
                    if code is not None:  # drain what it wrote before it exited
                        os.set_blocking(r, False)
                        try:
                            while reply.fill():
                                pass
                        except BlockingIOError:
                            pass
                if r in ready and code is None and not reply.fill():
                    kill_tree(os.getpid(), child)  # it closed its channel without a reply
                    code = self._exit_status(child)
                if self.cmd.fd in ready and not self.cmd.fill():
                    raise SystemExit(0)  # the trainer is gone
        finally:
            os.close(r)
            kill_tree(os.getpid(), child)
            self.reap(child)


def serve(cmd: int, out: int) -> None:
    """The supervisor's loop: boot, then one forked child per ``call`` frame, until end of file."""
    sup = _Supervisor(cmd, out)
    try:
        boot = sup.receive()
        if boot is None:
            return
        try:
            prep = pickle.loads(base64.b64decode(boot["prep"]))
            current = multiprocessing.process.current_process()
            current._inheriting = True  # type: ignore[attr-defined]
            try:
                multiprocessing.spawn.prepare(prep)
            finally:
                current._inheriting = False  # type: ignore[attr-defined]
            fn = pickle.loads(base64.b64decode(boot["fn"]))
            if isinstance(fn, str):  # an import string: import it now, before the first call
                module, _, name = fn.rpartition(".")
                fn = getattr(importlib.import_module(module), name)
        except BaseException as exc:
            sup.send({"op": "boot_error", "text": "".join(traceback.format_exception(exc))[-_TEXT:]})
            return
        sup.watch_children()
        sup.send({"op": "ready", "pid": os.getpid()})
        while (msg := sup.receive()) is not None:
            reply = sup.call(fn, msg, boot)
            sup.send({"op": "reply", "token": msg.get("token"), "reply": reply})
    finally:
        kill_tree(os.getpid())


def run_agent(agent: Any, data: Any, backend: str) -> Any:
    """``agent.run(data)`` on its own event loop (``backend``: ``"trio"`` or ``"asyncio"``)."""
    import anyio

    return anyio.run(functools.partial(agent.run, data), backend=backend)


if __name__ == "__main__":  # pragma: no cover - started by _isolation.BOOT
    serve(int(sys.argv[1]), int(sys.argv[2]))
