"""The ``rollout-trio`` command line."""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = "usage: rollout-trio {run,serve,inspect,replay} [options]   (rollout-trio COMMAND --help for details)"


def main(argv: list[str] | None = None) -> int:
    """Dispatch a subcommand; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        from ._run import run_main

        return run_main(rest)
    if command == "serve":
        from ._serve import serve_main

        return serve_main(rest)
    if command == "inspect":
        from ._inspect import inspect_main

        return inspect_main(rest)
    if command == "replay":
        from ._replay import replay_main

        return replay_main(rest)
    print(f"rollout-trio: unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return 2
