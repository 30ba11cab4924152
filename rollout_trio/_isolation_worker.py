"""The worker side of process isolation: runs inside trio-parallel's worker processes.

Standard library only, and loaded in the worker by file path under the top-level name
``_rollout_trio_isolation_worker`` (see ``_isolation.BOOT``), so a worker never imports
rollout_trio (torch, transformers) just to run a reward. Everything a job sends back is a
plain tuple of bytes and strings: ``(nonce, pid, status, body, text)``, where ``body`` is
the pickled value or exception (None when it cannot be pickled) and ``text`` the
formatted traceback. The parent unpickles ``body`` itself, so a value or exception that
does not unpickle there is a typed error and never breaks the worker.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import traceback
from typing import Any

NAME = "_rollout_trio_isolation_worker"

Reply = tuple[str, int, str, "bytes | None", str]


def start_session() -> None:
    """Lead a new session: whatever the job starts shares this process group, which the
    parent kills with the worker."""
    os.setsid()


def _resolve(fn: Any) -> Any:
    if not isinstance(fn, str):
        return fn
    module, _, name = fn.rpartition(".")
    return getattr(importlib.import_module(module), name)


def call(nonce: str, pid_file: str, payload: bytes) -> Reply:
    """Run the pickled ``(fn, args, kwargs)``; ``fn`` may be an import string."""
    pid = os.getpid()
    with open(pid_file, "w") as f:  # before the job can start anything: the group to kill
        f.write(str(pid))
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = _resolve(fn)(*args, **kwargs)
    except BaseException as exc:  # SystemExit too: the job failed, the worker did not
        text = "".join(traceback.format_exception(exc))
        try:
            body: bytes | None = pickle.dumps(exc)
        except Exception:
            body = None
        return (nonce, pid, "error", body, text)
    try:
        return (nonce, pid, "ok", pickle.dumps(value), "")
    except Exception as exc:
        return (nonce, pid, "error", None, f"the result cannot be pickled: {exc!r}")


def call_with_env(nonce: str, pid_file: str, env: dict[str, str], payload: bytes) -> Reply:
    """:func:`call` with ``env`` added to the environment (for a worker that serves one job)."""
    os.environ.update(env)
    return call(nonce, pid_file, payload)


def run_agent(agent: Any, data: Any, backend: str) -> Any:
    """``agent.run(data)`` on its own event loop (``backend``: ``"trio"`` or ``"asyncio"``)."""
    import anyio

    return anyio.run(functools.partial(agent.run, data), backend=backend)
