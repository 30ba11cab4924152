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
from typing import Any

import trio

__all__ = ["serve_main"]

log = logging.getLogger("rollout_trio.server")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-trio serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to bind; 0 picks a free one (default 30000)")
    p.add_argument("--port-file", help="write the bound port to this file once listening")
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--seed", type=int, default=None, help="seed for requests without sampling_seed")
    p.add_argument("--segment-tokens", type=int, default=16, help="tokens per engine call: abort/pause granularity")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep between chunks (slows generation)")
    p.add_argument("--max-batch-size", type=int, default=256, help="requests per forward pass")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return p


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


async def _serve(args: argparse.Namespace) -> None:
    from ..server import HttpServer, SGLangApp

    engine, tokenizer, name = await trio.to_thread.run_sync(_build_engine, args)
    async with engine, trio.open_nursery() as nursery:
        app = SGLangApp(
            engine, model_path=name, segment_tokens=args.segment_tokens, step_delay=args.step_delay, tokenizer=tokenizer
        )
        listeners = await nursery.start(HttpServer(app).serve, args.host, args.port)
        host, port = listeners[0].socket.getsockname()[:2]
        if args.port_file:
            tmp = trio.Path(args.port_file + ".tmp")
            await tmp.write_text(f"{port}\n")
            await tmp.replace(args.port_file)
        print(f"rollout-trio serve: listening on http://{host}:{port} (model {name})", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def serve_main(argv: list[str]) -> int:
    """Run the server until SIGINT or SIGTERM; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    failed = False
    try:
        trio.run(_serve, args)
    except* OSError as group:  # e.g. the port is taken (raised inside the server's nursery)
        for exc in group.exceptions:
            print(f"rollout-trio serve: {exc}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
