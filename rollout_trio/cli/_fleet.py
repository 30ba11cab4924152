"""``rollout-trio fleet``: N ``rollout-trio serve`` workers behind sglang-router, on this machine.

Starts the workers (each on a free loopback port, every ``serve`` option passed through),
then sglang-router in front of them, and waits until the router reports every worker
healthy (``--startup-timeout``). It then prints one line per worker and one for the router
on stdout::

    worker 0: http://127.0.0.1:41234 (pid 1201)
    worker 1: http://127.0.0.1:41235 (pid 1202)
    router: http://127.0.0.1:30000 (pid 1203, 2 workers, metrics http://127.0.0.1:41236/metrics, api key in /run/user/1000/rollout-trio-fleet-1200.key)

Every worker and the router require an api key (``--api-key``, else ``ROLLOUT_TRIO_API_KEY``,
else one generated when another user could reach the workers, or when ``--key-file`` is
given), written to ``--key-file`` (mode 0600) and named on the router's line;
``--no-api-key`` runs them without. Point
``RemoteEngine(router=..., api_key=...)`` at the router's address. Ctrl-C stops the router, then the workers
(SIGTERM, SIGKILL after ``--stop-timeout``), says what it stopped and exits 130; SIGTERM
does the same and exits 0. The children run in their own session, so a terminal's Ctrl-C
reaches only this command, which stops them in order. A worker that exits is reported and
the others keep serving (the router stops sending it requests once its health check
fails); the router exiting, or every worker, is a failure (exit 1).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .._bounded import aread_response, loads_json
from .._util import LazyModule
from . import _fleet_key
from ._checkpoint import check_device, check_model_dir, device
from ._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Parser,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    run_command,
    run_trio,
)

if TYPE_CHECKING:
    import httpx
    import trio
else:  # a usage error answers without importing them (issue 31)
    httpx = LazyModule("httpx", globals())
    trio = LazyModule("trio", globals())

__all__ = ["fleet_main", "plain_line"]

_PROG = "rollout-trio fleet"
#: sglang-router's routing policies (``--policy``); "manual" and "bucket" need request keys.
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ROUTER_LOG_LEVELS = ("debug", "info", "warn", "error")
#: ``serve`` options the fleet sets itself for every worker.
_OWNED = ("--host", "--port", "--port-file", "--api-key", "--allow-unauthenticated")
_LISTENING = re.compile(r"listening on (http://\S+)(?: \(model .*?, (\S+ on \S+),)?")
#: The most a router's answer may hold, raw and decoded (rollout_trio._bounded).
MAX_ANSWER_BYTES = 16 * 2**20


class _FleetParser(Parser):
    """Parses the fleet's options; the rest, checked by serve's parser, become ``worker_options``."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, rest = self.parse_known_args(args, namespace)
        for option in _OWNED:
            if any(arg == option or arg.startswith(option + "=") for arg in rest):
                self.error(f"{option}: the fleet sets it for every worker (workers listen on 127.0.0.1)")
        from ._serve import _parser as serve_parser

        serve = serve_parser()
        serve.prog = self.prog  # its usage errors are this command's: one line, exit 2
        parsed.worker_args = serve.parse_args(rest)
        if parsed.devices is not None and parsed.worker_args.device is not None:
            self.error("--devices: give it or --device, not both (--device puts every worker on one device)")
        if parsed.devices is not None and parsed.ray is not None:
            self.error("--devices: Ray places the workers on its GPUs (--ray-num-gpus), not --devices")
        if parsed.worker_args.threads is None:  # N workers share the cores, not each all of them
            share = parsed.ray_num_cpus if parsed.ray is not None else (os.cpu_count() or 1) // parsed.workers
            rest = [*rest, "--threads", str(max(1, int(share)))]
        if parsed.debug:  # a worker's failure comes with its traceback too
            rest = [*rest, "--debug"]
        parsed.worker_options = rest
        return parsed


def _parser() -> Parser:
    """Every option of ``rollout-trio fleet`` (any other option goes to each worker)."""
    p = _FleetParser(
        _PROG,
        __doc__.split("\n\n")[0]
        + " Any option not listed here is passed to every worker and must be a"
        " 'rollout-trio serve' option (--model, --device, --seed, --step-delay, ...).",
        allow_abbrev=False,  # a prefix of a serve option must not be taken for a fleet one
    )
    p.add_argument("--workers", type=positive_int, default=2, help="rollout-trio serve processes to start")
    p.add_argument("--port", type=port, default=30000, help="the router's loopback port; 0 picks a free one")
    p.add_argument(
        "--devices",
        type=_devices,
        default=None,
        help="one device per worker, comma-separated (cuda:0,cuda:1): worker i gets the i-th, round robin "
        "(default: every worker on --device)",
    )
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="sglang-router's routing policy")
    p.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=300.0,
        help="seconds for every worker to listen and the router to report them all healthy",
    )
    p.add_argument(
        "--stop-timeout",
        type=positive_float,
        default=15.0,
        help="seconds a stopping process may take after SIGTERM before it is killed",
    )
    p.add_argument(
        "--health-interval",
        type=positive_int,
        default=2,
        help="seconds between the router's health checks of each worker (whole seconds)",
    )
    p.add_argument(
        "--router-log-level", choices=ROUTER_LOG_LEVELS, default="error", help="sglang-router's logging level"
    )
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        type=_fleet_key.api_key,
        default=None,
        help="the key every worker and the router require (default: $ROLLOUT_TRIO_API_KEY, else one generated when "
        "another user could reach the workers); prefer the variable: a command line is visible to other users",
    )
    key.add_argument(
        "--no-api-key",
        action="store_true",
        help="run the workers and the router without a key (any local user can then pause, relabel or reload them)",
    )
    p.add_argument(
        "--key-file",
        type=_key_file,
        default=None,
        help="where the fleet's api key is written, mode 0600 (default: a file in $XDG_RUNTIME_DIR or /tmp)",
    )
    ray = p.add_argument_group("on a Ray cluster (pip install -e '.[ray]')")
    ray.add_argument(
        "--ray",
        metavar="ADDRESS",
        type=_ray_address,
        default=None,
        help="place the workers on this Ray cluster ('auto', 'ray://HOST:PORT' or HOST:PORT) instead of this machine",
    )
    ray.add_argument("--ray-num-cpus", type=non_negative_float, default=1.0, help="CPUs Ray reserves for each worker")
    ray.add_argument("--ray-num-gpus", type=non_negative_float, default=0.0, help="GPUs Ray reserves for each worker")
    return p


def _devices(text: str) -> tuple[str, ...]:
    """A comma-separated list of devices, each as ``--device`` takes it."""
    return tuple(device(part.strip()) for part in text.split(","))


def _ray_address(text: str) -> str:
    """A Ray address: 'auto', 'ray://HOST:PORT' or HOST:PORT."""
    if text == "auto" or re.fullmatch(r"(ray://)?[A-Za-z0-9_.\-\[\]:]+:\d{1,5}", text):
        return text
    raise argparse.ArgumentTypeError(f"must be 'auto', 'ray://HOST:PORT' or HOST:PORT, got {text!r}")


def _key_file(text: str) -> str:
    """A file to create, in a directory that exists."""
    where = os.path.dirname(os.path.abspath(text))
    if not text or os.path.isdir(text) or not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"must be a file path in an existing directory, got {text!r}")
    return text


def _free_port() -> int:
    """A loopback port nobody listens on now (sglang-router cannot bind port 0 itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.define(eq=False)
class Child:
    """One process of the fleet: its name, command line, and what it said."""

    name: str
    argv: list[str]
    process: trio.Process | None = None
    url: str | None = None
    #: "bfloat16 on cuda:1", from the worker's own listening line ("" if it did not say)
    placement: str = ""
    last_error: str = ""
    listening: trio.Event = attrs.field(factory=lambda: trio.Event())  # trio loads when a fleet starts
    exited: trio.Event = attrs.field(factory=lambda: trio.Event())
    stopping: bool = False

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def describe(self) -> str:
        where = f" at {self.url}" if self.url else " (still starting)"
        return f"{self.name}{where}"

    def status(self) -> str:
        code = self.process.returncode if self.process is not None else None
        if code is not None and code < 0:
            return f"signal {signal.Signals(-code).name}"
        return f"status {code}"


#: SGR sequences (colours, bold): ``ESC [ ... m``.
_SGR = re.compile(r"\x1b\[[0-9;:]*m")
#: Every other escape sequence a terminal obeys (cursor moves, screen clears, OSC titles).
_CSI_OR_OSC = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?)")


def plain_line(line: str, *, colour: bool = False) -> str:
    """A child's log line as we print it: no escape sequence but, when ``colour``, its
    colours; any other control character shown as an escape (:func:`terminal_safe`).

    Args:
        line: one line a child wrote.
        colour: keep its SGR colour sequences (our stderr is a terminal).

    Returns:
        The line, safe to print.
    """
    from .._terminal import terminal_safe

    kept: list[str] = []
    pos = 0
    for match in _SGR.finditer(line):
        kept.append(terminal_safe(_CSI_OR_OSC.sub("", line[pos : match.start()]), max_chars=None))
        if colour:
            kept.append(match.group())
        pos = match.end()
    kept.append(terminal_safe(_CSI_OR_OSC.sub("", line[pos:]), max_chars=None))
    return "".join(kept)


async def _lines(stream: trio.abc.ReceiveStream) -> Any:
    """The stream's lines, decoded, without their line ends."""
    buffer = b""
    while chunk := await stream.receive_some(65536):
        buffer += chunk
        *whole, buffer = buffer.split(b"\n")
        for line in whole:
            yield line.decode(errors="replace").rstrip("\r")
    if buffer:
        yield buffer.decode(errors="replace")


class Fleet:
    """The running processes; :meth:`run` starts them, :meth:`stop` stops them in order."""

    def __init__(self, args: argparse.Namespace, worker_options: list[str]) -> None:
        self.args = args
        self.key: str | None = args.key
        serve = [sys.executable, "-m", "rollout_trio", "serve", *worker_options, "--host", "127.0.0.1", "--port", "0"]
        devices = args.devices or ()
        self.workers = [
            Child(f"worker {i}", [*serve, *(("--device", devices[i % len(devices)]) if devices else ())])
            for i in range(args.workers)
        ]
        self.router: Child | None = None
        self.metrics_url = ""
        self.ready = False
        self._held: collections.deque[str] = collections.deque(maxlen=200)
        #: The children's colours reach our stderr only when it is a terminal (and NO_COLOR is unset).
        self.colour = sys.stderr.isatty() and not os.environ.get("NO_COLOR")

    @property
    def children(self) -> list[Child]:
        return [*self.workers, *([self.router] if self.router else [])]

    async def _spawn(self, child: Child, nursery: trio.Nursery) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not self.colour:  # sglang-router (its Python launcher and its Rust logger) colours its lines
            env.update(NO_COLOR="1", RUST_LOG_STYLE="never")
        env.pop(_fleet_key.ENV, None)
        if self.key is not None:  # in the environment, never on a command line
            env[_fleet_key.ENV] = self.key
        child.process = await trio.lowlevel.open_process(
            child.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in a terminal reaches us only; we stop them in order
            env=env,
        )
        nursery.start_soon(self._read_stdout, child)
        nursery.start_soon(self._read_stderr, child)
        nursery.start_soon(self._watch_exit, child)

    async def _read_stdout(self, child: Child) -> None:
        assert child.process is not None and child.process.stdout is not None
        async for line in _lines(child.process.stdout):
            found = _LISTENING.search(line)
            if found and not child.listening.is_set():
                child.url, child.placement = found.group(1), found.group(2) or ""
                child.listening.set()
            elif line.strip():
                self._relay(child, line)

    async def _read_stderr(self, child: Child) -> None:
        assert child.process is not None and child.process.stderr is not None
        async for line in _lines(child.process.stderr):
            if line.strip():
                child.last_error = line.strip()
                self._relay(child, line)

    def _relay(self, child: Child, line: str) -> None:
        """A child's line to our stderr, prefixed; held back until ready (a failed start is one line).

        The line is shown, never obeyed (:func:`plain_line`): colours only on a terminal."""
        text = f"[{child.name}] {plain_line(line, colour=self.colour)}"
        if self.ready or self.args.debug:
            print(text, file=sys.stderr, flush=True)
        else:
            self._held.append(text)

    async def _watch_exit(self, child: Child) -> None:
        assert child.process is not None
        await child.process.wait()
        child.exited.set()
        if child.stopping:
            return
        # A child that exited on its own may have said why on its last line; a signal's
        # victim did not (that line is whatever it logged last, unrelated).
        killed = child.process.returncode is not None and child.process.returncode < 0
        said = f": {child.last_error}" if child.last_error and not killed else ""
        if child is self.router:
            raise CommandError(f"sglang-router exited with {child.status()}{said}")
        if not self.ready:
            raise CommandError(f"{child.name} exited with {child.status()} before it was ready{said}")
        alive = [w for w in self.workers if not w.exited.is_set()]
        if not alive:
            raise CommandError(f"every worker has exited; the last, {child.name}, with {child.status()}{said}")
        print(
            f"{_PROG}: {child.describe()} (pid {child.pid}) exited with {child.status()}{said}; "
            f"{len(alive)} of {len(self.workers)} workers left (the router skips it once its health check fails)",
            file=sys.stderr,
            flush=True,
        )

    async def run(self, nursery: trio.Nursery) -> None:
        """Start everything, print the addresses, and serve until cancelled (or a failure)."""
        with trio.move_on_after(self.args.startup_timeout) as startup:
            for worker in self.workers:
                await self._spawn(worker, nursery)
            for worker in self.workers:
                await worker.listening.wait()
            for i, worker in enumerate(self.workers):
                on = f", {worker.placement}" if worker.placement else ""
                print(f"worker {i}: {worker.url} (pid {worker.pid}{on})", flush=True)
            router_url = await self._start_router(nursery)
            await self._wait_router_healthy(router_url)
        if startup.cancelled_caught:
            raise CommandError(f"not ready within --startup-timeout {self.args.startup_timeout:g} s: {self._not_ready()}")
        self.ready = True
        while self._held:
            print(self._held.popleft(), file=sys.stderr, flush=True)
        assert self.router is not None
        where = f", api key in {self.args.key_file}" if self.key is not None else ", no api key"
        print(
            f"router: {router_url} (pid {self.router.pid}, {len(self.workers)} workers, metrics {self.metrics_url}"
            f"{where})",
            flush=True,
        )
        print(f"{_PROG}: ready; Ctrl-C stops the router and the workers", file=sys.stderr, flush=True)
        await trio.sleep_forever()

    def _not_ready(self) -> str:
        starting = [w.name for w in self.workers if not w.listening.is_set()]
        if starting:
            return f"{', '.join(starting)} still loading (not listening yet)"
        if self.router is None:
            return "sglang-router not started"
        return f"sglang-router has not reported {len(self.workers)} healthy workers ({self._last_report})"

    _last_report = "no answer yet"

    async def _start_router(self, nursery: trio.Nursery) -> str:
        if importlib.util.find_spec("sglang_router") is None:
            raise CommandError(
                "sglang-router is not installed: pip install -e '.[fleet]' from a rollout_trio checkout "
                "(or pip install sglang-router==0.3.2)"
            )
        router_port = self.args.port or _free_port()
        metrics_port = _free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        remaining = max(1, int(trio.current_effective_deadline() - trio.current_time()))
        argv = [
            sys.executable,
            "-m",
            "rollout_trio.cli._fleet_key",  # sglang-router, with the key from the environment
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
            "--worker-urls",
            *(w.url or "" for w in self.workers),
            "--policy",
            self.args.policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            self.args.router_log_level,
            "--health-check-interval-secs",
            str(self.args.health_interval),
            "--worker-startup-check-interval",
            "1",
            "--worker-startup-timeout-secs",
            str(remaining),
            "--shutdown-grace-period-secs",
            str(max(1, int(self.args.stop_timeout) - 1)),
        ]
        self.router = Child("router", argv, url=f"http://127.0.0.1:{router_port}")
        await self._spawn(self.router, nursery)
        return self.router.url or ""

    async def _wait_router_healthy(self, router_url: str) -> None:
        """Poll the router's ``GET /workers`` until it lists every worker healthy."""
        wanted = {w.url for w in self.workers}
        headers = {"Authorization": f"Bearer {self.key}"} if self.key is not None else {}
        async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
            while True:
                try:
                    async with client.stream("GET", router_url + "/workers") as response:
                        answer = loads_json(await aread_response(response, MAX_ANSWER_BYTES, what="GET /workers"))
                    healthy = {w.get("url") for w in answer.get("workers", []) if w.get("is_healthy")}
                    self._last_report = f"{len(healthy & wanted)} of {len(wanted)} healthy"
                    if wanted <= healthy:
                        return
                except (httpx.HTTPError, ValueError, AttributeError, TypeError) as exc:
                    self._last_report = f"last answer: {type(exc).__name__}: {exc}"
                await trio.sleep(0.05)

    async def stop(self) -> list[Child]:
        """Stop the router, then every worker (SIGTERM, then SIGKILL); returns what was running."""
        running = [c for c in self.children[::-1] if c.process is not None and not c.exited.is_set()]
        if self.router in running:
            await self._stop_one(self.router)
        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                if worker in running:
                    nursery.start_soon(self._stop_one, worker)
        return running

    async def _stop_one(self, child: Child | None) -> None:
        if child is None or child.process is None:
            return
        child.stopping = True
        process = child.process
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(self.args.stop_timeout):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                await stream.aclose()


def _summary(stopped: list[Child]) -> str:
    if not stopped:
        return "nothing was running"
    return "stopped " + ", ".join(f"{c.describe()} (pid {c.pid})" for c in stopped)


async def _serve_fleet(args: argparse.Namespace, worker_options: list[str]) -> int:
    fleet = Fleet(args, worker_options)
    received: list[int] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with trio.open_nursery() as nursery:

                async def on_signal() -> None:
                    async for signum in signals:
                        received.append(signum)
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(on_signal)
                await fleet.run(nursery)
        finally:
            with trio.CancelScope(shield=True):
                stopped = await fleet.stop()
            if received:
                how = "interrupted" if received == [signal.SIGINT] else "terminated"
                print(f"{_PROG}: {how}; {_summary(stopped)}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED if received == [signal.SIGINT] else 0


def _choose_key(args: argparse.Namespace) -> None:
    """``args.key`` (None: none) and ``args.key_file`` (written, 0600)."""
    if args.no_api_key:
        if args.key_file is not None:
            raise CommandError("--key-file: there is no key to write with --no-api-key")
        args.key = None
        return
    from_env = os.environ.get(_fleet_key.ENV)
    if args.api_key is None and from_env:
        try:
            _fleet_key.api_key(from_env)
        except argparse.ArgumentTypeError as exc:
            raise CommandError(f"${_fleet_key.ENV}: {exc}") from None
    args.key = args.api_key or from_env
    if args.key is None:
        if not _fleet_key.other_users() and args.key_file is None:
            return  # nobody else can reach the workers; --key-file asks for one anyway
        args.key = secrets.token_urlsafe(24)
    args.key_file = args.key_file or _fleet_key.default_key_file()
    try:
        _fleet_key.write_key_file(args.key_file, args.key)
    except OSError as exc:
        raise CommandError(f"--key-file: cannot write {args.key_file}: {exc}") from exc


def _main(args: argparse.Namespace) -> int:
    if args.ray is None:  # the workers' checkpoint and device are this machine's: check them before they start
        check_model_dir(args.worker_args.model)
        for requested in args.devices or (args.worker_args.device,):
            check_device(requested)
    _choose_key(args)
    if args.ray is not None:
        if importlib.util.find_spec("ray") is None:
            raise CommandError("--ray: Ray is not installed: pip install -e '.[ray]' from a rollout_trio checkout")
        from ..ray._cli import serve_ray_fleet

        return serve_ray_fleet(args, args.worker_options)
    return run_trio(_serve_fleet, args, args.worker_options)


def fleet_main(argv: Sequence[str]) -> int:
    """Run the fleet until Ctrl-C (exit status 130) or SIGTERM (0); returns the exit status."""
    return run_command(_PROG, _parser(), argv, _main)


if __name__ == "__main__":
    sys.exit(fleet_main(sys.argv[1:]))
