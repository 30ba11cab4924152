"""What every ``rollout-trio`` command shares: its manners.

- A usage error (a bad flag or value) is one line on stderr and exit status 2
  (:class:`Parser`, and the argument types below, which apply the library's own rules).
- A runtime failure (no GPU for ``--device cuda``, a missing ``--model`` directory, a port
  in use) is one line on stderr and exit status 1; ``--debug`` prints the full traceback
  first (:func:`run_command`), and a failed episode's before its line.
- Ctrl-C stops new work, aborts what is in flight, lets the command print what finished,
  and exits with 130 (:func:`interruptible`, :func:`run_command`). Ctrl-C while a command
  starts (torch and transformers import, a model loads) is one line and 130 as well
  (:func:`starting`). SIGTERM does the same and exits with 143 (128 + SIGTERM); the two
  servers (``serve``, ``fleet``) exit 0 on SIGTERM, their ordinary way to stop.
- A missing ``--model`` directory and an unavailable ``--device`` are reported before torch
  is imported (``_checkpoint.check_model_dir``, ``_checkpoint.check_device``), so they answer at once.
- Error lines carry no ``FileNotFoundError:``-style prefix where the message is written for
  users (:func:`describe_exception`).
- ``--help`` and ``--version`` answer at once: a command's module imports torch and
  transformers inside the functions that run after its options parsed, never at the top.
- The library's warnings (a dump directory that already holds files) are one line each
  on stderr, ``PROG: warning: ...``, unless logging is configured (``serve --log-level``).
- Every option's help shows its default once, and help text is plain text (no ``rst`` markup).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import math
import os
import re
import signal
import sys
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import attrs

from .._util import LazyModule

if TYPE_CHECKING:
    import trio
else:  # a usage error or a missing path answers without importing trio (issue 31)
    trio = LazyModule("trio", globals())

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "CommandError",
    "Interrupt",
    "InterruptedWhileStarting",
    "Parser",
    "UsageError",
    "check_dump_path",
    "describe_exception",
    "import_name",
    "import_object",
    "interrupted_status",
    "interruptible",
    "log_level",
    "non_negative_float",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
    "run_command",
    "setup_logging",
    "starting",
    "stopped_by",
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM

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


def check_dump_path(path: str) -> None:
    """Refuse a dump path that does not exist, before the dump reader (and torch) load.

    Args:
        path: a dump directory or file.

    Raises:
        CommandError: nothing is at ``path``; worded as the reader's own error.
    """
    if not os.path.exists(path):
        raise CommandError(f"dump path {path!r} does not exist")


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


#: Built-in exceptions whose message alone means nothing ("'k'") or that mark a bug: their
#: type stays in the line.
_BUG_TYPES = (LookupError, AttributeError, AssertionError, NameError, ArithmeticError, RecursionError)
_ERRNO = re.compile(r"^\[Errno \d+\] ")


def _raised_in_library(exc: BaseException) -> bool:
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("rollout_trio.")


def _written_for_users(exc: BaseException) -> bool:
    """Whether ``exc``'s message says it all (its type name would only be noise)."""
    if isinstance(exc, CommandError):
        return True
    if not str(exc) or isinstance(exc, _BUG_TYPES):
        return False
    if isinstance(exc, OSError):  # "[Errno 2] No such file or directory: 'x'", "dump path 'x' does not exist"
        return True
    if type(exc).__module__.startswith("rollout_trio"):  # the library's typed errors name field and rule
        return True
    return isinstance(exc, ValueError) and _raised_in_library(exc)  # the library's input checks


def describe_exception(exc: BaseException) -> str:
    """One line for the user: the message and notes such as the failing slot; an exception
    group as its count and first failure.

    The type name leads the message only where the message is not written for users: not
    for a :class:`CommandError`, an ``OSError`` (its ``[Errno N]`` dropped too), the
    library's own exception types, or a ``ValueError`` the library raised on bad input; kept
    for anything else (``KeyError: 'k'``, a user's workflow raising ``ValueError``).

    Args:
        exc: the failure, an exception group included.

    Returns:
        One line, control characters shown as escapes.
    """
    leaves = _leaves(exc)
    if len(leaves) > 1:
        return f"{len(leaves)} failures; the first: {describe_exception(leaves[0])}"
    leaf = leaves[0]
    text = _one_line(str(leaf))
    if _written_for_users(leaf):
        text = _ERRNO.sub("", text)
    else:
        text = f"{type(leaf).__name__}: {text}" if text else type(leaf).__name__
    notes = [_one_line(n) for n in getattr(leaf, "__notes__", ())]
    return text + "".join(f" ({note})" for note in notes)


def run_command(prog: str, parser: Parser, argv: Sequence[str], body: Callable[[argparse.Namespace], int]) -> int:
    """Parse ``argv`` and run ``body``; returns the exit status, never raises.

    Usage errors give 2 (one line, from :class:`Parser`); an exception from ``body`` gives
    one line and 1 (with ``--debug``, its traceback first); Ctrl-C gives 130 and SIGTERM
    143 (``body`` prints what finished before; see :func:`interruptible`).

    Args:
        prog: the command's name, leading every line it prints.
        parser: the command's options.
        argv: the arguments after the command's name.
        body: runs the command on the parsed options; returns its exit status.

    Returns:
        The exit status.
    """
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted(prog, InterruptedWhileStarting())
    try:
        with _library_warnings(prog, debug=getattr(args, "debug", False)), _sigterm_as_ctrl_c():
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


#: Whether the Ctrl-C being handled came from a SIGTERM (:func:`_sigterm_as_ctrl_c`).
_TERMINATED = [False]


def _forward_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM, outside a block that receives it itself, becomes Ctrl-C (which Trio delivers
    safely, at a checkpoint of unprotected code), remembered as a SIGTERM."""
    _TERMINATED[0] = True
    signal.raise_signal(signal.SIGINT)


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    _TERMINATED[0] = False
    try:
        previous = signal.signal(signal.SIGTERM, _forward_sigterm)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    # A command started with Ctrl-C ignored (`cmd &` in a script: the shell ignores SIGINT
    # for it) would ignore the Ctrl-C its SIGTERM becomes, and a `kill` would do nothing.
    # It takes Ctrl-C back, as Python gives it to a program started normally.
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous_int)


def stopped_by() -> tuple[str, int]:
    """For a command that caught the ``KeyboardInterrupt`` of Ctrl-C or SIGTERM itself (to
    say what finished): ``("interrupted", 130)`` or ``("terminated", 143)``.

    Returns:
        The word for its last line and its exit status.
    """
    return ("terminated", EXIT_TERMINATED) if _TERMINATED[0] else ("interrupted", EXIT_INTERRUPTED)


def interrupted_status(interrupt: Interrupt) -> int:
    """The exit status of a command that :func:`interruptible` stopped: 130 for Ctrl-C,
    143 for SIGTERM (0 if neither came).

    Args:
        interrupt: what :func:`interruptible` yielded.

    Returns:
        The exit status.
    """
    if interrupt.signum is None:
        return 0
    return EXIT_TERMINATED if interrupt.signum == signal.SIGTERM else EXIT_INTERRUPTED


class _WarningLines(logging.Handler):
    """The library's warnings as ``PROG: warning: message``, one line each, while logging is
    not configured (once it is, the root logger's handlers show them, in their format); a
    record with an exception ends with its one-line description (a failed episode's cause),
    after its traceback with ``--debug``."""

    def __init__(self, prog: str, debug: bool) -> None:
        super().__init__(logging.WARNING)
        self.prog, self.debug = prog, debug

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        line = _one_line(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:  # the cause, on the same line
            line = f"{line.rstrip('.')}: {describe_exception(record.exc_info[1])}"
            if self.debug:  # --debug: the traceback too, before its line (as a failure's)
                traceback.print_exception(record.exc_info[1])
        print(f"{self.prog}: {record.levelname.lower()}: {line}", file=sys.stderr, flush=True)


@contextmanager
def _library_warnings(prog: str, debug: bool) -> Iterator[None]:
    handler = _WarningLines(prog, debug)
    library = logging.getLogger("rollout_trio")
    library.addHandler(handler)
    try:
        yield
    finally:
        library.removeHandler(handler)


def _interrupted(prog: str, exc: BaseException) -> int:
    how = "terminated" if _TERMINATED[0] else "interrupted"
    if all(isinstance(leaf, InterruptedWhileStarting) for leaf in _leaves(exc)):
        print(f"{prog}: {how} while starting; nothing ran", file=sys.stderr)
    else:
        print(f"{prog}: {how}", file=sys.stderr)
    return EXIT_TERMINATED if _TERMINATED[0] else EXIT_INTERRUPTED


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


T = TypeVar("T")


def run_trio(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``trio.run(fn, *args)``, with trio's import counted as start-up: the command modules
    load trio lazily (a usage error needs none of it), so a Ctrl-C while it loads is
    "interrupted while starting", as one during torch's is."""
    with starting():
        import trio
    return trio.run(fn, *args)


@attrs.define
class Interrupt:
    """Whether Ctrl-C (SIGINT) or SIGTERM arrived during an :func:`interruptible` block."""

    #: The signal that stopped the block, or None.
    signum: int | None = None

    @property
    def received(self) -> bool:
        """Whether a signal stopped the block."""
        return self.signum is not None

    @property
    def how(self) -> str:
        """"interrupted" (Ctrl-C) or "terminated" (SIGTERM), for the command's last line."""
        return "terminated" if self.signum == signal.SIGTERM else "interrupted"


@asynccontextmanager
async def interruptible(notice: str | None = None) -> AsyncIterator[Interrupt]:
    """Cancel the block's work on Ctrl-C or SIGTERM instead of raising ``KeyboardInterrupt``
    into it (or being killed).

    The block ends as a cancelled block does (in-flight requests are aborted, finished
    results kept); the yielded :class:`Interrupt` tells whether that happened and which
    signal it was, so the command can print what finished and exit with
    :func:`interrupted_status`. ``notice`` goes to stderr at once when the signal arrives,
    after "interrupted: " or "terminated: ". A Ctrl-C after the block ended raises
    ``KeyboardInterrupt``.

    Args:
        notice: what the command does now ("stopping new work"), or None to say nothing.

    Yields:
        The :class:`Interrupt`, filled in when a signal arrives.
    """
    interrupt = Interrupt()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    # a SIGTERM forwarded as Ctrl-C (it came before this block) is still a SIGTERM
                    interrupt.signum = signal.SIGTERM if _TERMINATED[0] else signum
                    if notice is not None:
                        print(f"{interrupt.how}: {notice}", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            yield interrupt
            nursery.cancel_scope.cancel()
