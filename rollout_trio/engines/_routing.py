"""Choosing a server for each request: strategies, rid affinity, up/down marks.

* ``round_robin`` starts at a random server and cycles; ``least_in_flight`` picks the
  server with the fewest requests in progress (ties broken in round-robin order).
* A request id that was routed before goes to the same server while that server is up
  (so it can reuse its prefix cache); the rid -> server map is a bounded FIFO cache.
* A server that fails to connect is marked down: traffic moves to the others until a
  health probe marks it up again. When every server is down, all of them are tried.

:func:`parse_worker_list` reads a router's worker listing (sglang-router ``GET /workers``,
or the older ``GET /list_workers``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import EngineProtocolError, EngineError

__all__ = ["Router", "Server", "normalize_address", "parse_worker_list"]

STRATEGIES = ("round_robin", "least_in_flight")


def normalize_address(address: str) -> str:
    """``host:port`` or a URL -> a base URL without a trailing slash."""
    address = address.strip().rstrip("/")
    if not address:
        raise ValueError("server address: must be non-empty")
    if "://" not in address:
        address = "http://" + address
    return address


def parse_worker_list(body: Any, where: str) -> list[tuple[str, str | None]]:
    """``(url, router's worker id or None)`` for each worker a router lists.

    Accepts sglang-router's ``{"workers": [{"url", "id", ...}, ...]}`` and the older
    ``{"urls": [...]}``.

    Raises:
        EngineProtocolError: neither shape, or an entry without a string ``url``.
    """
    if isinstance(body, dict) and isinstance(body.get("workers"), list):
        out: list[tuple[str, str | None]] = []
        for i, entry in enumerate(body["workers"]):
            url = entry.get("url") if isinstance(entry, dict) else None
            if not isinstance(url, str) or not url:
                raise EngineProtocolError(f"{where}: workers[{i}].url: must be a non-empty string, got {entry!r:.80}")
            wid = entry.get("id")
            out.append((url, wid if isinstance(wid, str) else None))
        return out
    if isinstance(body, dict) and isinstance(body.get("urls"), list):
        urls = body["urls"]
        if not all(isinstance(u, str) and u for u in urls):
            raise EngineProtocolError(f"{where}: urls: must be a list of non-empty strings")
        return [(u, None) for u in urls]
    raise EngineProtocolError(f"{where}: must be an object with a 'workers' (or 'urls') list, got {body!r:.80}")


class Server:
    """One inference server as the engine sees it.

    Attributes:
        base_url: ``http://host:port``.
        up: whether requests and control calls go to it (a server taken out of service
            is brought to the fleet's version and pause state before it is marked up).
        in_flight: generation requests in progress on it.
        version: the weight version it was last known to hold (None: unknown).
        error: why it was last taken out of service, if it was.
        worker_id: the id a router knows it by (router mode), if any.
    """

    def __init__(self, base_url: str, backend: Any) -> None:
        self.base_url = base_url
        self.backend = backend
        self.in_flight = 0
        self.up = True
        self.failures = 0
        self.version: int | None = None
        self.error: EngineError | None = None
        self.worker_id: str | None = None

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


def _with_load(usable: Callable[[Server], bool], load: int) -> Callable[[Server], bool]:
    return lambda s: usable(s) and s.in_flight == load


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
        server = self._next(exclude)
        if self.affinity_size:
            self._affinity[rid] = server
            self._affinity.move_to_end(rid)
            while len(self._affinity) > self.affinity_size:
                self._affinity.popitem(last=False)
        return server

    def _next(self, exclude: frozenset[Server] | set[Server]) -> Server:
        """The next server by strategy among those up and not excluded, else among those
        not excluded, else among all. No per-request list of candidates for round robin:
        the walk from its cursor is O(1) while most servers are usable."""
        if self.strategy == "round_robin":  # the common case, without building the rules
            n = len(self.servers)
            first = self.servers[self._rr % n]
            if first.up and first not in exclude:
                self._rr = (self._rr + 1) % n
                return first
        rules: tuple[Callable[[Server], bool], ...] = (
            lambda s: s.up and s not in exclude,
            lambda s: s not in exclude,
            lambda s: True,
        )
        for usable in rules:
            rule = usable
            if self.strategy == "least_in_flight":
                loads = [s.in_flight for s in self.servers if usable(s)]
                if not loads:
                    continue
                rule = _with_load(usable, min(loads))
            server = self._walk(rule)
            if server is not None:
                return server
        raise AssertionError("unreachable: the last rule accepts every server")  # pragma: no cover

    def _walk(self, rule: Callable[[Server], bool]) -> Server | None:
        """The first server from the round-robin cursor that ``rule`` accepts (the cursor
        moves past it), or None."""
        n = len(self.servers)
        for _ in range(n):
            server = self.servers[self._rr % n]
            self._rr = (self._rr + 1) % n
            if rule(server):
                return server
        return None

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
