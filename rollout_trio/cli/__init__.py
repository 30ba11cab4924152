"""The ``rollout-trio`` command line."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
from collections.abc import Sequence

__all__ = ["COMMANDS", "console_main", "main"]

#: command -> (module, entry point ``f(argv) -> int``, one-line description)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("._run", "run_main", "grouped rollouts of toy arithmetic on the embedded engine; prints rewards and statistics"),
    "serve": ("._serve", "serve_main", "serve an embedded engine over SGLang's HTTP protocol"),
    "inspect": ("._inspect", "inspect_main", "summarize a trajectory dump (terminal, or one HTML page)"),
    "replay": ("._replay", "replay_main", "re-run dumped episodes on their recorded answers (no model); report rows that differ"),
    "fleet": ("._fleet", "fleet_main", "start N serve workers behind sglang-router on this machine; print the router's address"),
    "top": ("._top", "top_main", "a live terminal view of a run's metrics (run --metrics-port, serve) or of a dump being written"),
}

_PROG = "rollout-trio"


def _help() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {_PROG} [--help] [--version] COMMAND [options]",
        "",
        "Training-trajectory generation for LLM reinforcement learning, on Trio.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()),
        "",
        f"'{_PROG} COMMAND --help' describes a command's options.",
    ]
    return "\n".join(lines)


def _usage_error(message: str) -> int:
    print(f"{_PROG}: error: {message} (see {_PROG} --help)", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch a command; returns the exit status (2 for a usage error, 1 for a failure)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        return _usage_error(f"a command is required: {', '.join(COMMANDS)}")
    first, rest = args[0], args[1:]
    if first in ("-h", "--help"):
        print(_help())
        return 0
    if first == "--version":
        from .. import __version__

        print(f"{_PROG} {__version__}")
        return 0
    if first.startswith("-"):
        return _usage_error(f"unknown option {first!r} before the command")
    if first not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(first, COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the commands are {', '.join(COMMANDS)}"
        return _usage_error(f"unknown command {first!r}{hint}")
    module, function, _ = COMMANDS[first]
    try:  # the command's module is light: it imports torch only once its options parsed
        entry = getattr(importlib.import_module(module, __name__), function)
        return int(entry(rest))
    except KeyboardInterrupt:  # the command reports a Ctrl-C once it runs: this one came before
        print(f"{_PROG} {first}: interrupted while starting; nothing ran", file=sys.stderr)
        return 130  # _common.EXIT_INTERRUPTED; _common itself may be what was loading


#: Modules whose teardown at interpreter exit takes seconds (thousands of modules, torch's
#: C++ state): once one is loaded, the process leaves with ``os._exit`` after its own cleanup.
_HEAVY = ("torch", "transformers")


def console_main() -> None:
    """The ``rollout-trio`` console script and ``python -m rollout_trio``: :func:`main`, then exit.

    A process that loaded torch spends 2-4 s tearing its modules down after the command
    finished (measured: a Ctrl-C'd ``run`` printed its summary 0.05 s after the signal and
    exited 3-4 s later on a loaded machine). What Python's exit does that matters runs here
    first (atexit handlers, non-daemon threads joined, logging and the standard streams
    flushed); then ``os._exit`` skips the teardown.
    """
    status = main()
    if not any(name in sys.modules for name in _HEAVY):
        sys.exit(status)
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`), a closed stream: nothing more to say
            pass
    os._exit(status)
