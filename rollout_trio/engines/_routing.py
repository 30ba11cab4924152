"""Choosing a server for each request: strategies, rid affinity, up/down marks.

* ``round_robin`` starts at a random server and cycles; ``least_in_flight`` picks the
  server with the fewest requests in progress (ties broken in round-robin order).
* A request id that was routed before goes to the same server while that server is up
  (so it can reuse its prefix cache); the rid -> server map is a bounded FIFO cache.
* A server that fails to connect is marked down: traffic moves to the others until a
  health probe marks it up again. When every server is down, all of them are tried.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["Router", "Server", "normalize_address"]

STRATEGIES = ("round_robin", "least_in_flight")


def normalize_address(address: str) -> str:
    """``host:port`` or a URL -> a base URL without a trailing slash."""
    address = address.strip().rstrip("/")
    if not address:
        raise ValueError("server address: must be non-empty")
    if "://" not in address:
        address = "http://" + address
    return address


class Server:
    """One inference server as the router sees it."""

    def __init__(self, base_url: str, backend: Any) -> None:
        self.base_url = base_url
        self.backend = backend
        self.in_flight = 0
        self.up = True
        self.failures = 0

    def __repr__(self) -> str:
        return f"Server({self.base_url!r}, up={self.up}, in_flight={self.in_flight})"


class _InFlight:
    """``with router.track(server):`` (a class: a generator context manager costs more per request)."""

    __slots__ = ("server",)

    def __init__(self, server: Server) -> None:
        self.server = server

    def __enter__(self) -> None:
        self.server.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self.server.in_flight -= 1


class Router:
    """Picks servers; see the module docstring for the rules."""

    def __init__(
        self,
        servers: Sequence[Server],
        *,
        strategy: str = "round_robin",
        affinity_size: int = 128,
        rng: random.Random | None = None,
    ) -> None:
        if not servers:
            raise ValueError("Router: needs at least one server")
        if strategy not in STRATEGIES:
            raise ValueError(f"routing strategy: must be one of {STRATEGIES}, got {strategy!r}")
        if affinity_size < 0:
            raise ValueError(f"affinity_size: must be >= 0, got {affinity_size}")
        self.servers = list(servers)
        self.strategy = strategy
        self.affinity_size = affinity_size
        self._rr = (rng or random.Random()).randrange(len(self.servers))
        self._affinity: OrderedDict[str, Server] = OrderedDict()

    def choose(self, rid: str, exclude: frozenset[Server] | set[Server] = frozenset()) -> Server:
        """The server for ``rid``: its affine server if usable, else by strategy."""
        pinned = self._affinity.get(rid)
        if pinned is not None and pinned.up and pinned not in exclude:
            return pinned
        candidates = [s for s in self.servers if s.up and s not in exclude]
        if not candidates:
            candidates = [s for s in self.servers if s not in exclude] or self.servers
        server = self._pick(candidates)
        if self.affinity_size:
            self._affinity[rid] = server
            self._affinity.move_to_end(rid)
            while len(self._affinity) > self.affinity_size:
                self._affinity.popitem(last=False)
        return server

    def _pick(self, candidates: list[Server]) -> Server:
        n = len(self.servers)
        if self.strategy == "least_in_flight":
            low = min(s.in_flight for s in candidates)
            candidates = [s for s in candidates if s.in_flight == low]
        if len(candidates) == 1:
            return candidates[0]
        allowed = set(map(id, candidates))
        for _ in range(n):
            server = self.servers[self._rr % n]
            self._rr = (self._rr + 1) % n
            if id(server) in allowed:
                return server
        return candidates[0]  # pragma: no cover

    def affine(self, rid: str) -> Server | None:
        """The server ``rid`` is pinned to, if any."""
        return self._affinity.get(rid)

    def track(self, server: Server) -> _InFlight:
        """Count a request in flight on ``server`` for the duration of the block."""
        return _InFlight(server)

    def mark_down(self, server: Server) -> None:
        """Stop routing to ``server`` until :meth:`mark_up`."""
        server.up = False
        server.failures += 1

    def mark_up(self, server: Server) -> None:
        """Route to ``server`` again."""
        server.up = True
        server.failures = 0
