"""`python -m rollout_trio ...` processes forked from one that has already imported torch,
transformers and the CLI, for the tests that start the commands many times.

A fresh `rollout-trio run` or `serve` spends about 3 of its 3.5 CPU seconds importing torch
and transformers; the suite starts dozens of them on 2 cores. Each worker of the suite starts
one *zygote* (this module run as a program) that imports them once. `WarmPopen` is a
`subprocess.Popen` whose child is forked from it: a process of its own, with its own pid,
argv, environment, working directory, standard streams and session, that receives signals
and exits with a status like any other. Only its imports are shared, so the tests that check
what a command imports, or what it does while importing, start a fresh interpreter instead.

The zygote forks a *keeper* per request (it reports the child's pid and then its exit status
over the request's socket, since only a parent can wait for a process), and the keeper forks
the child.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STARTUP_TIMEOUT = 120


# ------------------------------------------------------------------ the zygote (its own process)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


#: The zygote's sys.path without its own first entry and PYTHONPATH: what every child's ends with.
_BASE_PATH: list[str] = []


def _preload() -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import transformers.models.llama.modeling_llama  # noqa: F401  # the tiny model's

    import rollout_trio.cli._run  # noqa: F401
    import rollout_trio.cli._serve  # noqa: F401
    import rollout_trio.models  # noqa: F401

    # No tensor is made here: a fork after torch started its thread pools could hang in them.


def _stream(fd: int, *, err: bool) -> io.TextIOWrapper:
    """A standard stream as a fresh interpreter would open it on ``fd``."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace" if err else "strict",
        line_buffering=err or raw.isatty(), write_through=unbuffered or err,
    )


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m MODULE ARGS`` (``-c CODE ARGS``, ``SCRIPT ARGS``) and never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request["new_session"]:
            os.setsid()
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        sigint = request["sigint"]
        signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignore" else signal.default_int_handler)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
        sys.stdout, sys.stderr = _stream(1, err=False), _stream(2, err=True)
        sys.path[:] = [request["cwd"], *_pythonpath(), *_BASE_PATH]  # path[0] as for -m; -c and a script below
        import runpy

        try:
            if request["script"] is not None:  # python PATH ARGS
                sys.argv = [request["script"], *request["args"]]
                sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
                runpy.run_path(request["script"], run_name="__main__")
            elif request["code"] is not None:  # python -c CODE ARGS
                sys.argv = ["-c", *request["args"]]
                sys.path[0] = ""
                main = sys.modules["__main__"] = types.ModuleType("__main__")  # the zygote's is not the program's
                exec(compile(request["code"], "<string>", "exec"), main.__dict__)
            else:
                sys.argv = [request["module"], *request["args"]]
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit waits for
        atexit._run_exitfuncs()
        # CPython 3.11 leaves stdout's buffer unwritten when a Ctrl-C ends it (tests/test_warm_cli.py)
        for stream in (sys.stderr,) if code == -signal.SIGINT else (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    finally:
        if code == -signal.SIGINT:  # an uncaught Ctrl-C ends the process by SIGINT, as CPython does
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _keep(conn: socket.socket) -> None:
    """In the keeper: fork the child, report its pid, wait for it, report its status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _run_child(request)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())


def _zygote(path: str) -> None:
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in _pythonpath()]
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the keepers are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the suite is for its tests' processes
    print("ready", flush=True)
    try:
        while True:
            ready, _, _ = select.select([listener, sys.stdin], [], [])
            if sys.stdin in ready:  # the worker that started us is done or gone
                return
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                try:
                    _keep(conn)
                finally:
                    os._exit(0)
            conn.close()
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


# ------------------------------------------------------------------ the tests' side

_lock = threading.Lock()
_started: tuple[subprocess.Popen[str], str] | None = None


def _zygote_path() -> str:
    """The running zygote's socket, started on first use (one per suite worker)."""
    global _started
    with _lock:
        if _started is None or _started[0].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="warm-cli-"), "zygote")
            env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.warm_cli", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                cwd=ROOT, env=env, text=True,
            )
            ready, _, _ = select.select([proc.stdout], [], [], _STARTUP_TIMEOUT)
            line = proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
            if line.strip() != "ready":
                proc.kill()
                raise RuntimeError(f"the warm CLI zygote did not start within {_STARTUP_TIMEOUT} s: {line!r}")
            atexit.register(_stop, proc)
            _started = (proc, path)
        return _started[1]


def _stop(proc: subprocess.Popen[str]) -> None:
    """At the worker's exit: the zygote leaves when its stdin closes (the children it forked run on)."""
    proc.stdin.close()  # type: ignore[union-attr]
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()  # type: ignore[union-attr]


class WarmPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen(args, ...)`` for ``args = [sys.executable, "-m", MODULE, *ARGS]`` (or
    ``"-c", CODE`` or ``SCRIPT.py``), forked from the zygote. Pipes, ``text``, ``env``, ``cwd``, ``start_new_session``,
    ``wait``, ``poll``, ``communicate`` and the signal methods behave as Popen's do."""

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any, cwd: Any,
                       env: Any, startupinfo: Any, creationflags: Any, shell: Any, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int, *rest: Any) -> None:
        start_new_session = rest[5]
        script = len(args) >= 2 and os.fspath(args[1]).endswith(".py")
        if shell or preexec_fn is not None or pass_fds or not (script or len(args) >= 3 and args[1] in ("-m", "-c")):
            raise ValueError(f"WarmPopen runs [python, '-m' module | '-c' code | script.py, ...] only, not {args!r}")
        request = {
            "script": os.fspath(args[1]) if script else None,
            "module": args[2] if args[1] == "-m" else None, "code": args[2] if args[1] == "-c" else None,
            "args": [os.fspath(a) for a in args[2 if script else 3:]], "cwd": os.path.abspath(cwd or os.getcwd()),
            "env": dict(os.environ if env is None else env), "new_session": bool(start_new_session),
            # CPython installs its Ctrl-C handler unless SIGINT was ignored when it started
            "sigint": "ignore" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "default",
        }
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(_zygote_path())
            socket.send_fds(conn, [json.dumps(request).encode()], fds)
            ready, _, _ = select.select([conn], [], [], 30)
            reply = json.loads(conn.recv(4096)) if ready else {}
            if "pid" not in reply:
                raise RuntimeError(f"the warm CLI zygote did not start {args!r}")
        except BaseException:
            conn.close()
            raise
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self.pid = reply["pid"]
        self._conn = conn
        self._child_created = True

    def _read_status(self, timeout: float | None) -> bool:
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return False
        data = self._conn.recv(4096)
        self._conn.close()
        # a keeper that died without a word (killed with the zygote) leaves the child's fate unknown
        self.returncode = json.loads(data)["status"] if data else -signal.SIGKILL
        return True

    def _internal_poll(self, *args: Any, **kwargs: Any) -> int | None:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self.returncode  # type: ignore[return-value]


def run(args: list[str], *, input: str | None = None, timeout: float | None = None, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` with a `WarmPopen` (``capture_output`` included)."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with WarmPopen(args, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _zygote(sys.argv[1])
