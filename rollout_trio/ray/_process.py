"""The processes a Ray-placed fleet's actors own: one inference server, or the router.

Ray-free on purpose (the actors in ``_actors`` wrap it), so what it does can be read and
tested alone. Each process:

- dies with the actor that started it: it is launched through a two-line Python prelude
  that sets ``PR_SET_PDEATHSIG`` to SIGKILL and then ``exec``s the real command, so a Ray
  worker killed with SIGKILL (``ray.kill``, a lost node, an OOM kill) takes its server with
  it. The prelude checks that its parent is still the actor after setting the signal,
  closing the race where the actor died first;
- runs in a session of its own, so :meth:`OwnedProcess.stop` reaches its children too
  (SIGTERM to the group, SIGKILL after the timeout);
- writes its output to a file whose tail names the cause when it fails to start.

What this cannot catch: a grandchild that leaves the process group (``setsid``) and was
not given a death signal of its own survives a kill of the actor; the servers this fleet
starts (``rollout-trio serve``, SGLang, vLLM) do not do that.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

import httpx

__all__ = [
    "SERVER_KINDS",
    "OwnedProcess",
    "RayFleetError",
    "descends_from",
    "free_port",
    "missing_binary",
    "router_argv",
    "server_argv",
    "wait_healthy",
]

#: What a fleet server can be: ``rollout-trio serve``, SGLang's server, or vLLM's.
SERVER_KINDS = ("rollout-trio", "sglang", "vllm")

#: Sets the death signal, checks the parent is still the one that started us, then execs.
_PRELUDE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class RayFleetError(RuntimeError):
    """A Ray-placed fleet could not start or keep a server: the message names the server,
    the node and the cause (missing resources, a binary not installed, a failed start)."""


def descends_from(pid: int, ancestors: set[int]) -> bool:
    """Whether ``pid`` is one of ``ancestors`` or a descendant of one (Linux ``/proc``)."""
    while pid > 1:
        if pid in ancestors:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def free_port(host: str) -> int:
    """A port on ``host`` that nobody listens on now (the servers need one named up front)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def missing_binary(kind: str) -> str | None:
    """What ``kind`` needs that this node lacks, or None when it can start here."""
    if kind == "rollout-trio":
        return None if importlib.util.find_spec("rollout_trio") else "the rollout_trio package"
    if kind == "sglang":
        return None if importlib.util.find_spec("sglang") else "the sglang package (python -m sglang.launch_server)"
    if kind == "vllm":
        return None if shutil.which("vllm") else "the vllm command"
    raise ValueError(f"server kind: must be one of {', '.join(SERVER_KINDS)}, got {kind!r}")


def server_argv(kind: str, options: Sequence[str], host: str, port: int, api_key: str | None) -> list[str]:
    """The command line of one server of ``kind`` on ``host:port``.

    ``rollout-trio serve`` takes its key from the environment (see :func:`server_env`);
    SGLang and vLLM only take it on the command line.
    """
    where = ["--host", host, "--port", str(port)]
    if kind == "rollout-trio":
        return [sys.executable, "-m", "rollout_trio", "serve", *options, *where]
    key = [f"--api-key={api_key}"] if api_key else []  # one word: a key may start with "-"
    if kind == "sglang":
        return [sys.executable, "-m", "sglang.launch_server", *options, *where, *key]
    if kind == "vllm":
        return ["vllm", "serve", *options, *where, *key]
    raise ValueError(f"server kind: must be one of {', '.join(SERVER_KINDS)}, got {kind!r}")


def router_argv(
    options: Sequence[str], host: str, port: int, metrics_port: int, workers: Sequence[str], api_key: str | None
) -> list[str]:
    """sglang-router on ``host:port`` in front of ``workers``.

    With a key, the router uses it with its workers (``--api-key``) and requires it for its
    own control plane (``--control-plane-api-keys``): no other local user can add or remove
    workers.
    """
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    argv += ["--worker-urls", *workers, "--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    if api_key:
        # One word each: a generated key may start with "-", which a separate word would
        # make an option.
        argv += [f"--api-key={api_key}", f"--control-plane-api-keys=fleet:rollout-trio-fleet:admin:{api_key}"]
    return [*argv, *options]


def server_env(api_key: str | None) -> dict[str, str]:
    """The environment of a server process (the key, where ``rollout-trio serve`` reads it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if api_key:
        env["ROLLOUT_TRIO_API_KEY"] = api_key
    return env


class OwnedProcess:
    """A child process that dies with its owner and stops as a whole process group."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = list(argv)
        fd, self.log_path = tempfile.mkstemp(prefix="rollout-trio-ray-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _PRELUDE, str(os.getpid()), *self.argv],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, limit: int = 2000) -> str:
        """The last line of what the process printed (at most ``limit`` bytes read)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - limit))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def describe_exit(self) -> str:
        code = self.process.returncode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"status {code}"
        said = self.tail()
        return f"{self.name} exited with {how}" + (f": {said}" if said else "")

    def stop(self, timeout: float) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout`` seconds; then forget the log."""
        try:
            if self.alive():
                os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group is left
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


def wait_healthy(owned: OwnedProcess, url: str, timeout: float, where: str) -> None:
    """Poll ``GET url/health`` until it answers 200.

    Raises:
        RayFleetError: the process exited first, or ``timeout`` seconds passed; the message
            names ``where`` (the server and its node) and the process's last line.
    """
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if not owned.alive():
                raise RayFleetError(f"{where}: {owned.describe_exit()}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    said = owned.tail()
    raise RayFleetError(f"{where}: not healthy within {timeout:g} s" + (f" (last output: {said})" if said else ""))
