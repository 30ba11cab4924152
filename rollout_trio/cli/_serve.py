"""``rollout-trio serve``: a LocalEngine behind SGLang's HTTP protocol, on Hypercorn.

Binds 127.0.0.1 unless ``--host`` says otherwise; any other address needs ``--api-key``
(or ``ROLLOUT_TRIO_API_KEY``), or an explicit ``--allow-unauthenticated``. ``--port 0``
picks a free port; the bound port is printed (``listening on http://HOST:PORT``) and,
with ``--port-file``, written to a file, so tests can start the server as a subprocess.
SIGINT or SIGTERM aborts the generations in flight (they answer with their partial
output), lets the answers go out, says what was served, and exits.
Also runnable as ``python -m rollout_trio.cli._serve``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from .._util import LazyModule
from ._checkpoint import (
    add_model_options,
    check_device,
    check_model_dir,
    describe_model,
    load_model_and_tokenizer,
    load_vision_model,
)
from ._common import (
    EXIT_INTERRUPTED,
    CommandError,
    Parser,
    UsageError,
    log_level,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    run_command,
    run_trio,
    setup_logging,
    starting,
)

if TYPE_CHECKING:
    import trio
else:  # a usage error answers without importing trio (issue 31)
    trio = LazyModule("trio", globals())

__all__ = ["serve_main"]

log = logging.getLogger("rollout_trio.server")

API_KEY_ENV = "ROLLOUT_TRIO_API_KEY"


def _api_key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a non-empty string")
    return text


def _parser() -> Parser:
    """Every option of ``rollout-trio serve``."""
    p = Parser("rollout-trio serve", __doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=port, default=30000, help="port to bind; 0 picks a free one")
    p.add_argument("--port-file", help="write the bound port to this file once listening (default: none)")
    p.add_argument(
        "--api-key",
        type=_api_key,
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="bind a non-loopback address without an api key (anyone who can reach it may load weights)",
    )
    add_model_options(
        p,
        "local Hugging Face checkpoint directory, a vision-language one included; tiny-vlm: the built-in "
        "tiny vision model, which takes image_data on /generate (default: the built-in tiny model)",
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
    p.add_argument(
        "--max-body-bytes", type=positive_int, default=4 * 1024 * 1024, help="largest request body (default: 4 MiB)"
    )
    p.add_argument("--read-deadline", type=positive_float, default=60.0, help="seconds to receive a request body")
    p.add_argument(
        "--keep-alive-timeout", type=positive_float, default=75.0, help="seconds an idle connection stays open"
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=None,
        help="open connections the server must hold (default: what the open-file limit allows; 503 beyond it)",
    )
    p.add_argument(
        "--graceful-timeout",
        type=positive_float,
        default=10.0,
        help="seconds answers may take to go out after SIGINT/SIGTERM",
    )
    p.add_argument("--log-level", type=log_level, default="WARNING", help="logging level; INFO logs each request")
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere




def _build_engine(args: argparse.Namespace) -> tuple[Any, Any, str, Any]:
    from ..engines._local import LocalEngine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    processor = None
    vision = load_vision_model(args.model, args.device, args.dtype)
    if vision is not None:
        model, processor, name = vision
        tokenizer = processor.tokenizer
    else:
        model, tokenizer, name = load_model_and_tokenizer(args.model, args.device, args.dtype)
    engine = LocalEngine(model, tokenizer, seed=args.seed, max_batch_size=args.max_batch_size)
    return engine, tokenizer, name, processor


async def _serve(args: argparse.Namespace, received: list[int]) -> None:
    with starting():  # torch and transformers load here, once the options parsed
        from ..server import ServerLimits

    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes,
        read_deadline=args.read_deadline,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
    )
    with starting():  # a Ctrl-C while the model loads lands at the checkpoint, once it has
        engine, tokenizer, name, processor = await trio.to_thread.run_sync(_build_engine, args)
        await trio.lowlevel.checkpoint()
    started = trio.current_time()
    apps: list[Any] = []
    try:
        await _serve_engine(args, received, engine, tokenizer, processor, name, limits, apps.append)
    finally:
        if received and apps:  # what finished, however the shutdown went
            how = "interrupted" if received == [signal.SIGINT] else "terminated"
            line = served(apps[0].counters, trio.current_time() - started)
            print(f"rollout-trio serve: {how}; {line}", file=sys.stderr, flush=True)


def served(counters: Any, seconds: float) -> str:
    """What a server answered, for its last line: generate requests by outcome, output
    tokens, weight updates, over ``seconds``."""
    received = counters["generate_received"]
    outcomes = [
        f"{counters[key]} {word}"
        for key, word in (
            ("generate_finished", "finished"),
            ("generate_aborted", "aborted"),
            ("generate_interrupted", "cut short at shutdown"),
            ("generate_cancelled", "cancelled by the client"),
        )
        if counters[key]
    ]
    text = f"served {received} generate request{'s' if received != 1 else ''}"
    if outcomes:
        text += f" ({', '.join(outcomes)})"
    text += f", {counters['output_tokens']} output tokens"
    if counters["weight_updates"]:
        text += f", {counters['weight_updates']} weight update{'s' if counters['weight_updates'] != 1 else ''}"
    return text + f" over {seconds:.1f} s"


async def _serve_engine(
    args: argparse.Namespace,
    received: list[int],
    engine: Any,
    tokenizer: Any,
    processor: Any,
    name: str,
    limits: Any,
    made: Any,
) -> None:
    from ..server import SGLangApp, serve_app, sglang_asgi

    async with engine, trio.open_nursery() as nursery:
        app = SGLangApp(
            engine,
            model_path=name,
            segment_tokens=args.segment_tokens,
            step_delay=args.step_delay,
            tokenizer=tokenizer,
            processor=processor,
        )
        made(app)
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
        nursery.start_soon(_watch_loop_lag_until, stop, app.metrics.loop_lag)
        serve = partial(
            serve_app,
            sglang_asgi(app, api_key=args.api_key, limits=limits),
            args.host,
            args.port,
            limits,
            shutdown_trigger=stop.wait,
            graceful_timeout=args.graceful_timeout,
        )
        try:
            bound = await nursery.start(serve)
        except OSError as exc:  # a taken port, an unknown host
            raise CommandError(f"--host {args.host} --port {args.port}: cannot listen: {exc}") from exc
        host, bound_port = bound[0]
        if args.port_file:
            tmp = trio.Path(args.port_file + ".tmp")
            await tmp.write_text(f"{bound_port}\n")
            await tmp.replace(args.port_file)
        auth = "api key required" if args.api_key else "no api key"
        print(f"rollout-trio serve: listening on http://{host}:{bound_port} (model {name}, {describe_model(engine.model)}, {auth})", flush=True)


async def _watch_loop_lag_until(stop: trio.Event, gauge: Any) -> None:
    from ..observe import watch_loop_lag

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_loop_lag, gauge)
        await stop.wait()
        nursery.cancel_scope.cancel()


def _main(args: argparse.Namespace) -> int:
    if not args.api_key and not args.allow_unauthenticated and not _is_loopback(args.host):
        raise UsageError(
            f"refusing to bind {args.host} without an api key: pass --api-key (or set ${API_KEY_ENV}), "
            "or --allow-unauthenticated"
        )
    check_model_dir(args.model)  # before torch loads: these answer at once
    check_device(args.device)
    setup_logging(args.log_level)
    received: list[int] = []
    run_trio(_serve, args, received)
    return EXIT_INTERRUPTED if received == [signal.SIGINT] else 0


def serve_main(argv: Sequence[str]) -> int:
    """Run the server until Ctrl-C (exit status 130) or SIGTERM (0); returns the exit status."""
    return run_command("rollout-trio serve", _parser(), argv, _main)


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
