"""``rollout-trio fleet --ray ADDRESS``: the fleet's workers placed by Ray instead of on this machine.

Prints the lines the local fleet prints (``worker i: URL (node IP)``, then ``router: URL
(N workers, metrics URL)``), writes the fleet's api key to ``--key-file`` (mode 0600; the
trainers read it from there or from ``ROLLOUT_TRIO_API_KEY``), logs each loss and
replacement, and on Ctrl-C (130) or SIGTERM (0) stops the router, the servers and their
processes on every node before it says what it stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

import trio

from ..cli._common import EXIT_INTERRUPTED, CommandError
from ._fleet import open_ray_fleet
from ._process import RayFleetError

__all__ = ["serve_ray_fleet"]

_PROG = "rollout-trio fleet"


def _default_key_file() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"rollout-trio-fleet-{os.getpid()}.key")


def _write_key(path: str, key: str | None) -> None:
    """The key, readable by this user only (created 0600, never widened)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((key or "") + "\n")


def _router_options(args: argparse.Namespace) -> list[str]:
    return [
        "--policy", args.policy,
        "--log-level", args.router_log_level,
        "--health-check-interval-secs", str(args.health_interval),
        "--worker-startup-check-interval", "1",
    ]


async def _run(args: argparse.Namespace, worker_options: list[str]) -> int:
    received: list[int] = []
    started = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    received.append(signum)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_signal)
            try:
                async with open_ray_fleet(
                    args.workers,
                    server_options=worker_options,
                    num_cpus=args.ray_num_cpus,
                    num_gpus=args.ray_num_gpus,
                    router_options=_router_options(args),
                    api_key=os.environ.get("ROLLOUT_TRIO_API_KEY") or None,
                    address=args.ray,
                    startup_timeout=args.startup_timeout,
                    stop_timeout=args.stop_timeout,
                ) as fleet:
                    started = len(fleet.servers)
                    key_file = args.key_file or _default_key_file()
                    _write_key(key_file, fleet.api_key)
                    for s in fleet.servers:
                        print(f"worker {s.index}: {s.url} (node {s.node_ip}, pid {s.pid})", flush=True)
                    print(
                        f"router: {fleet.router_url} ({len(fleet.servers)} workers, metrics {fleet.metrics_url}, "
                        f"api key in {key_file})",
                        flush=True,
                    )
                    print(f"{_PROG}: ready on Ray; Ctrl-C stops the router and the workers", file=sys.stderr, flush=True)
                    await trio.sleep_forever()
            except RayFleetError as exc:
                raise CommandError(f"{_PROG}: {exc}") from exc
    if received:
        how = "interrupted" if received == [signal.SIGINT] else "terminated"
        what = f"the router and {started} workers" if started else "what had started (the fleet was not ready)"
        print(f"{_PROG}: {how}; stopped {what} on Ray", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED if received == [signal.SIGINT] else 0


def serve_ray_fleet(args: argparse.Namespace, worker_options: list[str]) -> int:
    """Run the fleet on the Ray cluster ``args.ray`` until a signal; returns the exit status."""
    return trio.run(_run, args, worker_options)
