"""``rollout-trio serve``: a LocalEngine behind SGLang's HTTP protocol.

Binds 127.0.0.1 unless ``--host`` says otherwise. ``--port 0`` picks a free port; the
bound port is printed (``listening on http://HOST:PORT``) and, with ``--port-file``,
written to a file, so tests can start the server as a subprocess.
Also runnable as ``python -m rollout_trio.cli._serve``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import trio

from ._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Parser,
    device,
    load_model_and_tokenizer,
    log_level,
    non_negative_float,
    non_negative_int,
    port,
    positive_int,
    run_command,
    setup_logging,
)

__all__ = ["serve_main"]

log = logging.getLogger("rollout_trio.server")


def _parser() -> Parser:
    p = Parser("rollout-trio serve", __doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=port, default=30000, help="port to bind; 0 picks a free one")
    p.add_argument("--port-file", help="write the bound port to this file once listening (default: none)")
    p.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint directory (default: the built-in tiny model)"
    )
    p.add_argument(
        "--device", type=device, default=None, help="cpu, cuda, cuda:N or mps (default: cuda if present, else cpu)"
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=None, help="seed for requests without sampling_seed (default: random)"
    )
    p.add_argument(
        "--segment-tokens", type=positive_int, default=16, help="tokens per engine call: abort/pause granularity"
    )
    p.add_argument(
        "--step-delay", type=non_negative_float, default=0.0, help="seconds to sleep between chunks (slows generation)"
    )
    p.add_argument("--max-batch-size", type=positive_int, default=256, help="requests per forward pass")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", type=log_level, default="WARNING", help="logging level; INFO logs each request")
    return p


def _build_engine(args: argparse.Namespace) -> tuple[Any, Any, str]:
    from ..engines._local import LocalEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model_and_tokenizer(args.model, args.device)
    engine = LocalEngine(model, tokenizer, seed=args.seed, max_batch_size=args.max_batch_size)
    return engine, tokenizer, name


def _access_logged(app: Any) -> Any:
    """``app`` logging each request at INFO: method, path, status, seconds."""

    async def handle(request: Any) -> Any:
        started = time.perf_counter()
        status: int | str = "cancelled"
        try:
            response = await app(request)
            status = response.status
            return response
        finally:
            log.info("%s %s %s %.3fs", request.method, request.path, status, time.perf_counter() - started)

    return handle


async def _serve(args: argparse.Namespace) -> int:
    from ..server import HttpServer, SGLangApp

    engine, tokenizer, name = await trio.to_thread.run_sync(_build_engine, args)
    async with engine, trio.open_nursery() as nursery:
        app = SGLangApp(
            engine, model_path=name, segment_tokens=args.segment_tokens, step_delay=args.step_delay, tokenizer=tokenizer
        )
        try:
            listeners = await nursery.start(HttpServer(_access_logged(app)).serve, args.host, args.port)
        except OSError as exc:  # a taken port, an unknown host
            raise CommandError(f"--host {args.host} --port {args.port}: cannot listen: {exc}") from exc
        host, bound = listeners[0].socket.getsockname()[:2]
        if args.port_file:
            tmp = trio.Path(args.port_file + ".tmp")
            await tmp.write_text(f"{bound}\n")
            await tmp.replace(args.port_file)
        print(f"rollout-trio serve: listening on http://{host}:{bound} (model {name})", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                nursery.cancel_scope.cancel()
                return EXIT_INTERRUPTED if signum == signal.SIGINT else 0
    return 0


def _main(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    return trio.run(_serve, args)


def serve_main(argv: Sequence[str]) -> int:
    """Run the server until Ctrl-C (exit status 130) or SIGTERM (0); returns the exit status."""
    return run_command("rollout-trio serve", _parser(), argv, _main)


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
