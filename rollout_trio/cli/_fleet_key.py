"""The fleet's api key: chosen, checked, written to a 0600 file, and given to sglang-router
without putting it on a command line other users can read (``/proc/PID/cmdline``).

Workers listen on 127.0.0.1, which every local user can reach: without a key any of them
could pause, relabel or reload the workers, or add and remove the router's workers. So the
fleet uses ``--api-key`` or ``ROLLOUT_TRIO_API_KEY``, else generates one when another user
could reach the workers (:func:`other_users`), unless told ``--no-api-key``; ``rollout-trio serve`` reads it from
``ROLLOUT_TRIO_API_KEY`` and the router from the same variable (this module, run as
``python -m rollout_trio.cli._fleet_key ROUTER-OPTIONS...``, adds it to sglang-router's own
arguments inside its process).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import stat
import sys
import tempfile

__all__ = ["ENV", "api_key", "default_key_file", "other_users", "router_key_options", "write_key_file"]

ENV = "ROLLOUT_TRIO_API_KEY"
#: Printable, no space, no ':' (sglang-router's control-plane key format splits on it).
_KEY = re.compile(r"[A-Za-z0-9._~+/=\-]{16,256}")


def api_key(text: str) -> str:
    """An api key given on the command line (argparse type)."""
    if not _KEY.fullmatch(text):
        raise argparse.ArgumentTypeError(
            "must be 16-256 characters of A-Z a-z 0-9 . _ ~ + / = - (no space, no ':'), "
            f"got {len(text)} characters"
        )
    return text


def other_users(passwd: str = "/etc/passwd", proc: str = "/proc") -> list[str]:
    """Who else could reach loopback ports here: another account that can log in (a login
    shell and a home directory that exists) or another user running a process (root is
    not counted: it can read the key file anyway). Empty when nobody but this user could.
    """
    me = os.getuid()
    found: set[str] = set()
    try:
        with open(passwd) as f:
            for line in f:
                parts = line.rstrip("\n").split(":")
                if len(parts) < 7 or not parts[2].isdigit():
                    continue
                uid, home, shell = int(parts[2]), parts[5], parts[6]
                if uid not in (0, me) and not shell.endswith(("nologin", "false")) and os.path.isdir(home):
                    found.add(parts[0])
    except OSError:
        found.add(f"(unknown: {passwd} unreadable)")
    try:
        for entry in os.listdir(proc):
            if entry.isdigit():
                try:
                    uid = os.stat(os.path.join(proc, entry)).st_uid
                except OSError:
                    continue
                if uid not in (0, me):
                    found.add(f"uid {uid}")
    except OSError:
        pass
    return sorted(found)


def default_key_file() -> str:
    """``$XDG_RUNTIME_DIR`` (this user's) or the temporary directory, named by our pid."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"rollout-trio-fleet-{os.getpid()}.key")


def write_key_file(path: str, key: str) -> None:
    """Write ``key`` to ``path``, readable by this user only.

    Never follows a symbolic link at ``path`` (another user could plant one in /tmp), and
    refuses a file owned by someone else.

    Raises:
        OSError: the file cannot be written, or belongs to another user.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{path}: not a regular file of this user; refusing to write the key there")
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)


def router_key_options(key: str) -> list[str]:
    """sglang-router's options for ``key``: used with the workers and required for its
    control plane (adding, removing, listing workers)."""
    return [f"--api-key={key}", f"--control-plane-api-keys=fleet:rollout-trio-fleet:admin:{key}"]


def _launch_router() -> None:
    """sglang-router with the key from the environment added to its arguments."""
    key = os.environ.pop(ENV, "")
    if key:
        sys.argv += router_key_options(key)
    importlib.import_module("sglang_router.launch_router").main()  # an optional dependency, untyped


if __name__ == "__main__":
    _launch_router()
