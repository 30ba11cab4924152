"""Waits with a deadline of their own, kept out of pytest's hang report.

pytest's ``faulthandler_timeout`` dumps every thread's stack when a test runs past it, so
that a hang shows where it is. A server start or a cluster scenario can run past it on a
loaded machine without hanging: each has its own deadline, which names what it waits for
when it expires. Their stacks in the log would read as a hang, so the dump is suspended
while they wait and re-armed (for the full timeout) once they return.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def own_deadline(config: pytest.Config) -> Iterator[None]:
    """Suspend the ``faulthandler_timeout`` dump for the ``with`` block (a wait whose own
    deadline reports it), and re-arm it afterwards."""
    timeout = float(config.getini("faulthandler_timeout") or 0)
    faulthandler.cancel_dump_traceback_later()
    try:
        yield
    finally:
        if timeout > 0:
            faulthandler.dump_traceback_later(timeout, file=sys.__stderr__)
