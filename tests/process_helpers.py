"""Checks on processes the tests start (stdlib only)."""

import contextlib
import os

import trio


def dead(pid):
    """Gone, or a zombie nobody reaped yet (it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def wait_dead(pid, timeout=30):
    """Wait until ``pid`` is dead; kill it anyway (no leftovers) and fail if it is not within ``timeout`` s."""
    try:
        with trio.fail_after(timeout):
            while not dead(pid):
                await trio.sleep(0.01)
    finally:
        if not dead(pid):
            os.kill(pid, 9)


@contextlib.contextmanager
def reaped(proc):
    """``proc`` for the block; killed and reaped on the way out if it still runs (a failing
    test leaves no process behind)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:  # closed here, not by the collector in some later test
                pipe.close()
