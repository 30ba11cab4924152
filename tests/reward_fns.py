"""Reward functions the reward-worker processes import (kept free of heavy imports)."""

import ctypes
import os
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
