"""What every ``rollout-trio`` command shares: its manners.

- A usage error (a bad flag or value) is one line on stderr and exit status 2
  (:class:`Parser`, and the argument types below, which apply the library's own rules).
- A runtime failure (no GPU for ``--device cuda``, a missing ``--model`` directory, a port
  in use) is one line on stderr and exit status 1; ``--debug`` prints the full traceback
  first (:func:`run_command`).
- Ctrl-C stops new work, aborts what is in flight, lets the command print what finished,
  and exits with 130 (:func:`interruptible`, :func:`run_command`). Ctrl-C while a command
  starts (torch and transformers import, a model loads) is one line and 130 as well
  (:func:`starting`).
- ``--help`` and ``--version`` answer at once: a command's module imports torch and
  transformers inside the functions that run after its options parsed, never at the top.
- The library's warnings (a dump directory that already holds files) are one line each
  on stderr, ``PROG: warning: ...``, unless logging is configured (``serve --log-level``).
- Every option's help shows its default once, and help text is plain text (no ``rst`` markup).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import re
import signal
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NoReturn

import attrs
import trio

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "CommandError",
    "Interrupt",
    "InterruptedWhileStarting",
    "Parser",
    "UsageError",
    "describe_exception",
    "device",
    "import_name",
    "import_object",
    "interruptible",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "log_level",
    "non_negative_float",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
    "resolve_device",
    "run_command",
    "setup_logging",
    "starting",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_RST_LITERAL = re.compile(r"``(.+?)``")


class CommandError(Exception):
    """A runtime failure whose message is already written for the user (printed as is)."""


class UsageError(CommandError):
    """Options that parse one by one but not together (exit status 2, like a parse error)."""


class InterruptedWhileStarting(KeyboardInterrupt):
    """Ctrl-C before a command did any work (raised by :func:`starting`)."""

    def __init__(self) -> None:
        super().__init__("interrupted while starting; nothing ran")


# ---------------------------------------------------------------------------- parsing


#: Help text that already states its default ("(default: none)", "%(default)s").
_STATES_DEFAULT = re.compile(r"\bdefault:|%\(default\)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default once (unless its help already says "default: ...") in plain text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if _STATES_DEFAULT.search(text) or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return super()._get_help_string(action)

    def _format_text(self, text: str) -> str:
        return super()._format_text(_RST_LITERAL.sub(r"\1", text))

    def _expand_help(self, action: argparse.Action) -> str:
        return _RST_LITERAL.sub(r"\1", super()._expand_help(action))


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr and exit status 2.

    Every parser has ``--debug`` (print the traceback of a runtime failure).
    """

    def __init__(self, prog: str, description: str, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(prog=prog, description=description, **kwargs)
        self.add_argument("--debug", action="store_true", help="print the full traceback of a failure")

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _type(name: str, convert: Callable[[str], Any], check: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: ``convert`` then ``check``, else a usage error quoting ``rule``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = _type("positive_int", int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _type("non_negative_int", int, lambda v: v >= 0, "an integer >= 0")
positive_float = _type("positive_float", float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
non_negative_float = _type(
    "non_negative_float", float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"
)
port = _type("port", int, lambda v: 0 <= v <= 65535, "a port number 0-65535 (0 picks a free one)")
log_level = _type(
    "log_level", lambda s: s.upper() if s.upper() in LOG_LEVELS else None, bool, f"one of {', '.join(LOG_LEVELS)}"
)
import_name = _type(
    "import_name",
    lambda s: s if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", s) else None,
    bool,
    "MODULE:NAME (an importable module and an attribute of it)",
)


def import_object(spec: str) -> Any:
    """The object an :data:`import_name` names, looking in the current directory first.

    As ``python -m`` does: the console script's ``sys.path`` starts at its own directory,
    so without this a module next to the user (``--workflow my_workflow:run``) is not found.
    The directory stays on ``sys.path``, for the modules that one imports later.
    """
    module_name, _, attribute = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


_DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")
device = _type(
    "device", lambda s: s if _DEVICE.fullmatch(s) else None, bool, "cpu, cuda, cuda:N or mps"
)


# ---------------------------------------------------------------------------- devices and models


def resolve_device(requested: str | None) -> str:
    """The torch device to use: ``requested`` if this machine has it, else a :class:`CommandError`.

    None picks ``cuda`` when a GPU is present, else ``cpu`` (as ``LocalEngine.from_pretrained``).
    """
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CommandError(f"--device {requested}: CUDA is not available on this machine")
        index = int(requested.partition(":")[2] or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise CommandError(f"--device {requested}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif requested == "mps" and not torch.backends.mps.is_available():
        raise CommandError("--device mps: MPS is not available on this machine")
    return requested


def load_model_and_tokenizer(path: str | None, requested_device: str | None) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)`` for ``--model`` and ``--device``, the same way for every command.

    ``path`` None is the built-in tiny model (a fixed one: ``--seed`` seeds sampling, not weights).
    """
    from ..models import load_model, tiny_model

    _quiet_transformers()
    where = resolve_device(requested_device)
    if path is None:
        model, tokenizer = tiny_model(device=where)
        return model, tokenizer, "tiny"
    if not os.path.isdir(path):
        raise CommandError(f"--model {path}: no such checkpoint directory")
    try:
        model, tokenizer = load_model(path, device=where)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--model {path}: cannot load a model and tokenizer from it: {_one_line(str(exc))}") from exc
    return model, tokenizer, path


def load_tokenizer(path: str, flag: str = "--tokenizer") -> Any:
    """A tokenizer from a local directory, or a :class:`CommandError` naming ``flag``."""
    if not os.path.isdir(path):
        raise CommandError(f"{flag} {path}: no such tokenizer directory")
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CommandError(f"{flag} {path}: cannot load a tokenizer from it: {_one_line(str(exc))}") from exc


def _quiet_transformers() -> None:
    """No progress bars from transformers ("Loading weights ...") among a command's own lines."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def setup_logging(level: str) -> None:
    """Log records at ``level`` and above to stderr, one line each."""
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)


# ---------------------------------------------------------------------------- running


def _one_line(text: str) -> str:
    """``text`` on one line, control sequences from data shown as escapes (never obeyed)."""
    from .._terminal import terminal_safe

    return terminal_safe(" ".join(text.split()), max_chars=None)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def describe_exception(exc: BaseException) -> str:
    """One line for the user: the message (with its type unless it is a :class:`CommandError`)
    and notes such as the failing slot; an exception group as its count and first failure."""
    leaves = _leaves(exc)
    if len(leaves) > 1:
        return f"{len(leaves)} failures; the first: {describe_exception(leaves[0])}"
    leaf = leaves[0]
    text = _one_line(str(leaf))
    if not isinstance(leaf, CommandError):
        text = f"{type(leaf).__name__}: {text}" if text else type(leaf).__name__
    notes = [_one_line(n) for n in getattr(leaf, "__notes__", ())]
    return text + "".join(f" ({note})" for note in notes)


def run_command(prog: str, parser: Parser, argv: Sequence[str], body: Callable[[argparse.Namespace], int]) -> int:
    """Parse ``argv`` and run ``body``; returns the exit status, never raises.

    Usage errors give 2 (one line, from :class:`Parser`); an exception from ``body`` gives
    one line and 1 (with ``--debug``, its traceback first); Ctrl-C gives 130 (``body``
    prints what finished before; see :func:`interruptible`).
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted(prog, InterruptedWhileStarting())
    try:
        with _library_warnings(prog):
            return body(args)
    except UsageError as exc:
        print(f"{prog}: error: {_one_line(str(exc))} (see {prog} --help)", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:
        return _interrupted(prog, exc)
    except (Exception, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and (ctrl_c := exc.subgroup(KeyboardInterrupt)) is not None:
            return _interrupted(prog, ctrl_c)
        if getattr(args, "debug", False):
            traceback.print_exception(exc)
        print(f"{prog}: error: {describe_exception(exc)}", file=sys.stderr)
        return EXIT_FAILURE


class _WarningLines(logging.Handler):
    """The library's warnings as ``PROG: warning: message``, one line each, while logging is
    not configured (once it is, the root logger's handlers show them, in their format)."""

    def __init__(self, prog: str) -> None:
        super().__init__(logging.WARNING)
        self.prog = prog

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        print(f"{self.prog}: {record.levelname.lower()}: {_one_line(record.getMessage())}", file=sys.stderr, flush=True)


@contextmanager
def _library_warnings(prog: str) -> Iterator[None]:
    handler = _WarningLines(prog)
    library = logging.getLogger("rollout_trio")
    library.addHandler(handler)
    try:
        yield
    finally:
        library.removeHandler(handler)


def _interrupted(prog: str, exc: BaseException) -> int:
    if all(isinstance(leaf, InterruptedWhileStarting) for leaf in _leaves(exc)):
        print(f"{prog}: {InterruptedWhileStarting()}", file=sys.stderr)
    else:
        print(f"{prog}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


@contextmanager
def starting() -> Iterator[None]:
    """Wrap a command's start-up (importing torch, loading a model): Ctrl-C there ends the
    command with one line, "interrupted while starting; nothing ran", and exit status 130
    (:func:`run_command` prints it), where it would otherwise print a traceback."""
    try:
        yield
    except InterruptedWhileStarting:
        raise
    except KeyboardInterrupt:
        raise InterruptedWhileStarting() from None


@attrs.define
class Interrupt:
    """Whether Ctrl-C (SIGINT) arrived during an :func:`interruptible` block."""

    received: bool = False


@asynccontextmanager
async def interruptible(notice: str | None = None) -> AsyncIterator[Interrupt]:
    """Cancel the block's work on Ctrl-C instead of raising ``KeyboardInterrupt`` into it.

    The block ends as a cancelled block does (in-flight requests are aborted, finished
    results kept); the yielded :class:`Interrupt` tells whether that happened, so the command
    can print what finished and exit with :data:`EXIT_INTERRUPTED`. ``notice`` goes to stderr
    at once when Ctrl-C arrives. A Ctrl-C after the block ended raises ``KeyboardInterrupt``.
    """
    interrupt = Interrupt()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    interrupt.received = True
                    if notice is not None:
                        print(notice, file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            yield interrupt
            nursery.cancel_scope.cancel()
