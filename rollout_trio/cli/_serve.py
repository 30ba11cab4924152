"""``rollout-trio serve``: a LocalEngine behind SGLang's HTTP protocol, on Hypercorn.

Binds 127.0.0.1 unless ``--host`` says otherwise; any other address needs ``--api-key``
(or ``ROLLOUT_TRIO_API_KEY``), or an explicit ``--allow-unauthenticated``. ``--port 0``
picks a free port; the bound port is printed (``listening on http://HOST:PORT``) and,
with ``--port-file``, written to a file, so tests can start the server as a subprocess.
SIGINT or SIGTERM aborts the generations in flight (they answer with their partial
output), lets the answers go out, and exits.
Also runnable as ``python -m rollout_trio.cli._serve``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from functools import partial
from typing import Any, NoReturn

import trio

__all__ = ["serve_main"]

log = logging.getLogger("rollout_trio.server")

API_KEY_ENV = "ROLLOUT_TRIO_API_KEY"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error: one line on stderr, exit status 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 0-65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {port}")
    return port


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__} > 0, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    """Every option of ``rollout-trio serve``."""
    p = _Parser(prog="rollout-trio serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=30000, help="port to bind, 0-65535; 0 picks a free one (default 30000)")
    p.add_argument("--port-file", help="write the bound port to this file once listening")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="bind a non-loopback address without an api key (anyone who can reach it may load weights)",
    )
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--seed", type=int, default=None, help="seed for requests without sampling_seed")
    p.add_argument("--segment-tokens", type=int, default=16, help="tokens per engine call: abort/pause granularity")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep between chunks (slows generation)")
    p.add_argument("--max-batch-size", type=int, default=256, help="requests per forward pass")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--max-body-bytes", type=_positive(int), default=16 * 1024 * 1024, help="largest request body (default 16 MiB)"
    )
    p.add_argument(
        "--read-deadline", type=_positive(float), default=60.0, help="seconds to receive a request body (default 60)"
    )
    p.add_argument(
        "--keep-alive-timeout", type=_positive(float), default=75.0, help="seconds an idle connection stays open (default 75)"
    )
    p.add_argument("--max-connections", type=_positive(int), default=1024, help="open connections at once (default 1024)")
    p.add_argument(
        "--graceful-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds answers may take to go out after SIGINT/SIGTERM (default 10)",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def _build_engine(args: argparse.Namespace) -> tuple[Any, Any, str]:
    from ..engines._local import LocalEngine
    from ..models import load_model, tiny_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.model:
        model, tokenizer = load_model(args.model, device=args.device)
        name = args.model
    else:
        model, tokenizer = tiny_model(device=args.device)
        name = "tiny"
    engine = LocalEngine(model, tokenizer, seed=args.seed, max_batch_size=args.max_batch_size)
    return engine, tokenizer, name


async def _serve(args: argparse.Namespace, received: list[int]) -> None:
    from ..server import ServerLimits, SGLangApp, serve_app, sglang_asgi

    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes,
        read_deadline=args.read_deadline,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
    )
    engine, tokenizer, name = await trio.to_thread.run_sync(_build_engine, args)
    async with engine, trio.open_nursery() as nursery:
        app = SGLangApp(
            engine, model_path=name, segment_tokens=args.segment_tokens, step_delay=args.step_delay, tokenizer=tokenizer
        )
        stop = trio.Event()

        async def on_signal(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                task_status.started()
                async for signum in signals:
                    received.append(signum)
                    app.shut_down()  # in-flight generations end now, with their partial output
                    stop.set()
                    return

        await nursery.start(on_signal)
        serve = partial(
            serve_app,
            sglang_asgi(app, api_key=args.api_key, limits=limits),
            args.host,
            args.port,
            limits,
            shutdown_trigger=stop.wait,
            graceful_timeout=args.graceful_timeout,
        )
        bound = await nursery.start(serve)
        host, port = bound[0]
        if args.port_file:
            tmp = trio.Path(args.port_file + ".tmp")
            await tmp.write_text(f"{port}\n")
            await tmp.replace(args.port_file)
        auth = "api key required" if args.api_key else "no api key"
        print(f"rollout-trio serve: listening on http://{host}:{port} (model {name}, {auth})", flush=True)


def serve_main(argv: list[str]) -> int:
    """Run the server until SIGINT or SIGTERM; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.api_key and not args.allow_unauthenticated and not _is_loopback(args.host):
        parser.error(
            f"refusing to bind {args.host} without an api key: pass --api-key (or set ${API_KEY_ENV}), "
            "or --allow-unauthenticated"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    received: list[int] = []
    failed = False
    try:
        trio.run(_serve, args, received)
    except* OSError as group:  # e.g. the port is taken (raised inside the server's nursery)
        for exc in group.exceptions:
            print(f"rollout-trio serve: {exc}", file=sys.stderr)
        failed = True
    if failed:
        return 1
    return 130 if received == [signal.SIGINT] else 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
