"""A reward worker process (started as a script, so it does not import rollout_trio).

Messages both ways are 8-byte big-endian lengths followed by a pickle. The parent sends
``sys.path`` first; the worker answers ``("ready", pid)``, then serves calls
``(fn, args, kwargs)`` (``fn`` may be an import string) with ``("ok", value)`` or
``("error", exception_or_None, traceback_text)`` until its stdin closes.
"""

import importlib
import os
import pickle
import struct
import sys
import traceback
from typing import IO, Any

_HEADER = struct.Struct(">Q")


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _read(stream: IO[bytes]) -> bytes | None:
    head = _read_exact(stream, _HEADER.size)
    if head is None:
        return None
    return _read_exact(stream, _HEADER.unpack(head)[0])


def _send(out: IO[bytes], obj: Any) -> None:
    try:
        data = pickle.dumps(obj)
    except Exception as exc:
        data = pickle.dumps(("error", None, f"the reward's result cannot be pickled: {exc!r}"))
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def _resolve(fn: Any, cache: dict[str, Any]) -> Any:
    if not isinstance(fn, str):
        return fn
    if fn not in cache:
        module, _, name = fn.rpartition(".")
        cache[fn] = getattr(importlib.import_module(module), name)
    return cache[fn]


def main() -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints of the reward function go to stderr, not into the replies
    inp = sys.stdin.buffer
    first = _read(inp)
    if first is None:
        return 0
    sys.path[:0] = [p for p in pickle.loads(first) if p not in sys.path]
    _send(out, ("ready", os.getpid()))
    cache: dict[str, Any] = {}
    while True:
        msg = _read(inp)
        if msg is None:
            return 0
        reply: tuple[Any, ...]
        try:
            fn, args, kwargs = pickle.loads(msg)
            reply = ("ok", _resolve(fn, cache)(*args, **kwargs))
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            try:
                pickle.dumps(exc)
                reply = ("error", exc, text)
            except Exception:
                reply = ("error", None, text)
        _send(out, reply)


if __name__ == "__main__":
    sys.exit(main())
