"""Reward functions the reward-worker processes import (kept free of heavy imports)."""

import ctypes
import fcntl
import gc
import multiprocessing.connection
import os
import pickle
import stat
import struct
import subprocess
import time
from pathlib import Path


def add(a, b):
    return a + b


def pid(*args):
    return os.getpid()


def hang(pid_file):
    Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


def add_or_hang(a, b, pid_file=None):
    """``a + b``, or never returns when ``pid_file`` is given (after writing its pid there)."""
    if pid_file is not None:
        hang(pid_file)
    return a + b


def hard_exit(*args):
    os._exit(7)


def segfault(*args):
    ctypes.string_at(0)


def fail(*args):
    raise ValueError("intentional error from reward fn")


def exit_once(marker):
    """Dies the first time (leaving ``marker``), succeeds afterwards."""
    if not Path(marker).exists():
        Path(marker).write_text("x")
        os._exit(1)
    return 1.0


class Unpicklable(Exception):
    def __init__(self, a, b):  # two required args: pickling round-trips fail
        super().__init__(f"{a}/{b}")
        self.lock = __import__("threading").Lock()


def raise_unpicklable(*args):
    raise Unpicklable(1, 2)


def spawn_sleeper_and_hang(pid_file):
    """Starts a ``sleep 1000`` child, writes the child's pid, then never returns."""
    child = subprocess.Popen(["sleep", "1000"])
    Path(pid_file).write_text(str(child.pid))
    while True:
        time.sleep(3600)


def _reply_channels():
    """The worker's reply channel(s) and the framing its parent reads: a trio-parallel worker's
    multiprocessing connection (4-byte length), else the old hand-made worker's pipe above
    stderr (8-byte length)."""
    conns = [o for o in gc.get_objects() if isinstance(o, multiprocessing.connection.Connection)]
    fds = [c.fileno() for c in conns if not c.closed and c.writable]
    if fds:
        return [(fd, struct.Struct("!i")) for fd in fds]
    found = []
    for fd in range(3, 64):
        try:
            mode, flags = os.fstat(fd).st_mode, fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue
        if stat.S_ISFIFO(mode) and flags & os.O_ACCMODE == os.O_WRONLY:
            found.append((fd, struct.Struct(">Q")))
    return found


def forge_reply(value, forge=True):
    """Writes a well-framed reply of its own (``value``) onto the reply channel, then returns
    1.0; returns 2.0 and writes nothing when ``forge`` is false."""
    if not forge:
        return 2.0
    for fd, header in _reply_channels():
        if header.format == "!i":
            import outcome

            data = pickle.dumps(outcome.Value(value))
        else:
            data = pickle.dumps(("ok", value))
        os.write(fd, header.pack(len(data)) + data)
    return 1.0


def write_garbage(kind):
    """Writes garbage (``"junk"``) or a huge length header (``"huge"``) onto the reply channel."""
    data = b"\x00" * 7 + b"\x05junk!" if kind == "junk" else b"\xff\xff\xff\xff" + b"\x7f" * 8
    for fd, _ in _reply_channels():
        os.write(fd, data)
    return 1.0


class Unloadable(Exception):
    """Pickles (as ``Unloadable("1/2")``) but cannot be unpickled: ``__init__`` wants two arguments."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def raise_unloadable(*args):
    raise Unloadable(1, 2)


def areal_length_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """AReaL's reward signature: 1.0 for an even number of completion tokens (a worker process runs it)."""
    return float(len(completion_ids) % 2 == 0)


def areal_zero_reward(prompt, completions, prompt_ids, completion_ids, **data):
    """Always wrong: AReaL's multi-turn workflow then asks again (its turn 2 is exercised)."""
    return 0.0


def alarm_reward(*args, **kwargs):
    """Uses ``signal.alarm`` as ``math_verify`` does: only a worker process's main thread may."""
    import signal

    signal.alarm(5)
    signal.alarm(0)
    return 1.0
