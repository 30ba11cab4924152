"""Serve an ASGI app on loopback for agents in other processes (the package's one server)."""

from __future__ import annotations

from typing import Any

import trio

from .._http import ServerLimits
from .._http import serve_app as _serve_app

__all__ = ["serve_app"]


async def serve_app(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    limits: ServerLimits = ServerLimits(keep_alive_timeout=30.0, max_header_bytes=64 * 1024),
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until cancelled; ``task_status.started`` gets ``"http://host:port"``.

    ``port=0`` picks a free port. Use with ``base_url = await nursery.start(serve_app, app)``.
    The server is :func:`rollout_trio.server.serve_app`, with ``limits``.
    """
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(_serve_app, app, host, port, limits)
        bound_host, bound_port = bound[0]
        task_status.started(f"http://{bound_host}:{bound_port}")
