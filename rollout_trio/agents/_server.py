"""Serve an ASGI app on loopback with Hypercorn's Trio worker (for agents in other processes)."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

__all__ = ["ServerLimits", "serve_app"]

logger = logging.getLogger("rollout_trio.agents.server")


@attrs.frozen(kw_only=True)
class ServerLimits:
    """The limits a served endpoint enforces (bodies are bounded by the app itself).

    Attributes:
        max_header_bytes: largest request head (request line plus headers).
        read_timeout: seconds of silence after which a connection is closed, even in the
            middle of a request. None (the default): a client waiting for a long
            generation sends nothing, and closing it would abort the generation. The
            endpoint bounds the time to receive a request body itself.
        keep_alive_timeout: seconds an idle keep-alive connection stays open.
        backlog: pending connections the listening socket queues.
    """

    max_header_bytes: int = 64 * 1024
    read_timeout: float | None = None
    keep_alive_timeout: float = 30.0
    backlog: int = 1024


async def serve_app(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    limits: ServerLimits = ServerLimits(),
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"http://host:port"``.

    ``port=0`` picks a free port. Use with ``base_url = await nursery.start(serve_app, app)``.
    """
    from hypercorn.config import Config  # only subprocess agents need a socket: import on use
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.read_timeout = None if limits.read_timeout is None else int(limits.read_timeout)
    config.keep_alive_timeout = limits.keep_alive_timeout
    config.backlog = limits.backlog
    config.accesslog = None
    config.errorlog = logger

    class _Status:
        def started(self, binds: list[str] | None = None) -> None:
            task_status.started(binds[0] if binds else f"http://{host}:{port}")

    await serve(app, config, mode="asgi", task_status=_Status())
