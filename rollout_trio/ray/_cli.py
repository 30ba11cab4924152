"""``rollout-trio fleet --ray ADDRESS``: the fleet's workers placed by Ray instead of on this machine.

Prints the lines the local fleet prints (``worker i: URL (node IP)``, then ``router: URL
(N workers, metrics URL)``), gives every server and the router the fleet's api key (the
fleet command chose it and wrote it to ``--key-file``, mode 0600), logs each loss and
replacement, and on Ctrl-C (130) or SIGTERM (0) stops the router, the servers and their
processes on every node before it says what it stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from ..cli._common import EXIT_INTERRUPTED, CommandError
from ._fleet import open_ray_fleet
from ._process import RayFleetError

__all__ = ["serve_ray_fleet"]

_PROG = "rollout-trio fleet"


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
                    api_key=args.key or "",  # chosen (and written, 0600) by the fleet command
                    address=args.ray,
                    startup_timeout=args.startup_timeout,
                    stop_timeout=args.stop_timeout,
                ) as fleet:
                    started = len(fleet.servers)
                    where = f"api key in {args.key_file}" if fleet.api_key else "no api key"
                    for s in fleet.servers:
                        print(f"worker {s.index}: {s.url} (node {s.node_ip}, pid {s.pid})", flush=True)
                    print(
                        f"router: {fleet.router_url} ({len(fleet.servers)} workers, metrics {fleet.metrics_url}, "
                        f"{where})",
                        flush=True,
                    )
                    print(f"{_PROG}: ready on Ray; Ctrl-C stops the router and the workers", file=sys.stderr, flush=True)
                    # Ray's core worker, started by ray.init above, may install its own C-level
                    # SIGTERM handler (it prints a stack and aborts): take the signals back.
                    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as ready_signals:
                        async for signum in ready_signals:
                            received.append(signum)
                            break
                    nursery.cancel_scope.cancel()
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
