"""Hostile reward behaviours (issue 34 item 1), run in reward worker processes.

``hostile(value, behaviour, arg)`` does ``behaviour`` and, where the behaviour lets it,
returns ``value`` (the honest answer). Standard library only, so a worker imports it fast.
"""

import gc
import os
import pickle
import stat
import subprocess
import sys
import threading
import time


def _pipe_fds(writable):
    """The process's pipe descriptors above stderr that are open for writing (or reading)."""
    found = []
    for fd in range(3, 256):
        try:
            st = os.fstat(fd)
            import fcntl

            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue
        if not stat.S_ISFIFO(st.st_mode):
            continue
        mode = flags & os.O_ACCMODE
        if (mode == os.O_WRONLY) == writable or mode == os.O_RDWR:
            found.append(fd)
    return found


def _connections():
    import multiprocessing.connection

    return [o for o in gc.get_objects() if isinstance(o, multiprocessing.connection.Connection) and not o.closed]


class Exec:
    """Unpickling this runs ``code`` (its ``__reduce__`` is ``exec``)."""

    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def _write_everywhere(data_for_conn, raw):
    for conn in _connections():
        if conn.writable:
            try:
                conn.send_bytes(data_for_conn)
            except OSError:
                pass
    for fd in _pipe_fds(writable=True):
        try:
            os.write(fd, raw)
        except OSError:
            pass


def _forger(value):
    """A thread that reads every command it can and answers each with ``value``."""

    def steal_conn(conn):
        import outcome

        while True:
            try:
                conn.recv_bytes()
                # trio-parallel's worker reply channel is the writable connection
                for c in _connections():
                    if c.writable:
                        c.send_bytes(pickle.dumps(outcome.Value(value)))
            except Exception:
                return

    def steal_fd(fd):
        worker = sys.modules.get("_rollout_trio_isolation_worker")
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                return
            if not data:
                return
            if worker is not None:  # answer in our own protocol, with whatever token it saw
                for out in _pipe_fds(writable=True):
                    try:
                        os.write(out, worker.frame({"status": "ok", "value": value}))
                    except OSError:
                        pass

    for conn in _connections():
        if conn.readable:
            threading.Thread(target=steal_conn, args=(conn,), daemon=True).start()
    for fd in _pipe_fds(writable=False):
        threading.Thread(target=steal_fd, args=(fd,), daemon=True).start()


def hostile(value, behaviour, arg=None):
    """Behave as ``behaviour`` says; return ``value`` when the behaviour lets the call finish."""
    if behaviour == "honest":
        return value
    if behaviour == "fork_holding_pipes":  # a child that keeps every descriptor for ``arg`` s
        if os.fork() == 0:
            time.sleep(arg)
            os._exit(0)
        return value
    if behaviour == "fork_holding_pipes_and_hang":  # a child in its own session keeps the pipes; we hang
        if os.fork() == 0:
            os.setsid()
            time.sleep(arg)
            os._exit(0)
        while True:
            time.sleep(3600)
    if behaviour == "setsid_child":  # a child in its own session; its pid goes to the file ``arg``
        child = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        with open(arg, "a") as f:
            f.write(f"{child.pid}\n")
        return value
    if behaviour == "daemon":  # double fork + setsid: the grandchild's parent exits at once
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                time.sleep(1000)
                os._exit(0)
            os.write(w, str(grandchild).encode())
            os._exit(0)
        os.close(w)
        pid = os.read(r, 64).decode()
        with open(arg, "a") as f:
            f.write(pid + "\n")
        return value
    if behaviour == "pickled_none":  # trio-parallel's exit marker, and junk for any other framing
        data = pickle.dumps(None)
        _write_everywhere(data, len(data).to_bytes(4, "big") + data)
        return value
    if behaviour == "pickle_exec":  # return a value whose unpickling writes the file ``arg``
        return Exec(f"__import__('pathlib').Path({arg!r}).write_text('pwned')")
    if behaviour == "write_pickle_exec":
        data = pickle.dumps(Exec(f"__import__('pathlib').Path({arg!r}).write_text('pwned')"))
        _write_everywhere(data, len(data).to_bytes(4, "big") + data)
        return value
    if behaviour == "forger_thread":
        _forger(666.0)
        time.sleep(0.05)
        return value
    if behaviour == "sys_exit":
        sys.exit(3)
    if behaviour == "keyboard_interrupt":
        raise KeyboardInterrupt
    if behaviour == "os_exit":
        os._exit(3)
    if behaviour == "sleep":
        time.sleep(arg)
        return value
    if behaviour == "huge":
        return "x" * arg
    if behaviour == "not_json":
        return {1, 2, 3}
    raise AssertionError(behaviour)


def greedy(resource_name):
    """Exceed a resource: 2 GiB of memory, CPU forever, or 4096 open files."""
    if resource_name == "address_space":
        return len(bytearray(2 << 30))
    if resource_name == "cpu_seconds":
        while True:
            pass
    files = [open(os.devnull) for _ in range(4096)]
    return len(files)
