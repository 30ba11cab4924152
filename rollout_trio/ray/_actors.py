"""The Ray actors of a fleet: one per inference server, one for the router.

Plain classes, made remote by ``_fleet`` with the options of each placement. An actor owns
its process (``_process.OwnedProcess``): when Ray restarts the actor (its process or its
node died), the new instance starts nothing by itself; the fleet's supervisor calls
:meth:`ServerActor.ensure_started`, which starts a server, waits until it is healthy and
says where it is. A server that died while its actor lives is started again the same way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ._process import (
    OwnedProcess,
    RayFleetError,
    free_port,
    missing_binary,
    router_argv,
    server_argv,
    server_env,
    wait_healthy,
)

__all__ = ["RouterActor", "ServerActor", "node_address"]


def node_address() -> tuple[str, str]:
    """This node's IP address (what other nodes reach it at) and its Ray node id."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


class _ProcessOwner:
    """What both actors share: the one process they own."""

    owned: OwnedProcess | None = None
    info: dict[str, Any] | None = None

    def running(self) -> bool:
        """Whether the process this actor started is still alive."""
        return self.owned is not None and self.owned.alive()

    def stop(self, timeout: float) -> None:
        """Stop the process (SIGTERM to its process group, SIGKILL after ``timeout``)."""
        if self.owned is not None:
            self.owned.stop(timeout)
            self.owned = None
            self.info = None


class ServerActor(_ProcessOwner):
    """Owns one inference server on the node Ray placed it on."""

    def __init__(
        self, index: int, kind: str, options: Sequence[str], api_key: str | None, startup_timeout: float
    ) -> None:
        self.index = index
        self.kind = kind
        self.options = list(options)
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.owned: OwnedProcess | None = None
        self.info: dict[str, Any] | None = None
        self.starts = 0

    def ensure_started(self) -> dict[str, Any]:
        """Start the server unless it runs; its ``url``, ``pid``, ``node_ip``, ``node_id`` and
        ``starts`` (servers this actor instance started).

        Raises:
            RayFleetError: the server's binary is missing on this node, or it did not become
                healthy within the start-up timeout (the message names the node).
        """
        if self.owned is not None and self.owned.alive() and self.info is not None:
            return self.info
        if self.owned is not None:
            self.owned.stop(1.0)
        host, node_id = node_address()
        where = f"server {self.index} on node {host} ({node_id[:12]})"
        missing = missing_binary(self.kind)
        if missing is not None:
            raise RayFleetError(f"{where}: {missing} is not installed there")
        port = free_port(host)
        argv = server_argv(self.kind, self.options, host, port, self.api_key)
        self.owned = OwnedProcess(f"server {self.index}", argv, server_env(self.api_key))
        url = f"http://{host}:{port}"
        wait_healthy(self.owned, url, self.startup_timeout, where)
        self.starts += 1
        self.info = {
            "url": url,
            "pid": self.owned.pid,
            "node_ip": host,
            "node_id": node_id,
            "starts": self.starts,
            "ready_at": time.time(),
        }
        return self.info



class RouterActor(_ProcessOwner):
    """Owns sglang-router on the node Ray placed it on (the driver's, by default)."""

    def __init__(self, options: Sequence[str], api_key: str | None, startup_timeout: float) -> None:
        self.options = list(options)
        self.api_key = api_key
        self.startup_timeout = startup_timeout
        self.owned: OwnedProcess | None = None
        self.info: dict[str, Any] | None = None

    def ensure_started(self, workers: Sequence[str]) -> dict[str, Any]:
        """Start the router in front of ``workers`` unless it runs; its ``url`` and ``metrics_url``.

        Raises:
            RayFleetError: sglang-router is not installed on this node, or did not answer
                within the start-up timeout.
        """
        if self.owned is not None and self.owned.alive() and self.info is not None:
            return self.info
        host, node_id = node_address()
        where = f"the router on node {host} ({node_id[:12]})"
        import importlib.util

        if importlib.util.find_spec("sglang_router") is None:
            raise RayFleetError(f"{where}: sglang-router is not installed there (pip install 'rollout-trio[fleet]')")
        port, metrics_port = free_port(host), free_port(host)
        argv = router_argv(self.options, host, port, metrics_port, workers, self.api_key)
        self.owned = OwnedProcess("router", argv, server_env(None))
        url = f"http://{host}:{port}"
        wait_healthy(self.owned, url, self.startup_timeout, where)
        self.info = {"url": url, "metrics_url": f"http://{host}:{metrics_port}/metrics", "pid": self.owned.pid}
        return self.info
