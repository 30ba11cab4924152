"""Choosing a server for each request: strategies, rid affinity, up/down marks.

* ``round_robin`` starts at a random server and cycles; ``least_in_flight`` picks the
  server with the fewest requests in progress (ties broken in round-robin order).
* A request id that was routed before goes to the same server while that server is up
  (so it can reuse its prefix cache); the rid -> server map is a bounded FIFO cache.
* A server that fails to connect is marked down: traffic moves to the others until a
  health probe marks it up again. When every server is down, all of them are tried,
  except those *barred* (they disagreed on the weight version: no request goes to them
  until they are brought back); with every server barred, choosing raises
  :class:`~rollout_trio.ServerUnavailableError`.

:func:`parse_worker_list` reads a router's worker listing (sglang-router ``GET /workers``,
or the older ``GET /list_workers``).
"""

from __future__ import annotations

import logging
import random
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import EngineError, EngineProtocolError, ServerUnavailableError

__all__ = ["Router", "Server", "normalize_address", "parse_worker_list", "worker_url"]

STRATEGIES = ("round_robin", "least_in_flight")
log = logging.getLogger("rollout_trio.engines")

_HOST = re.compile(r"[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]")
MAX_WORKERS = 4096


def normalize_address(address: str) -> str:
    """``host:port`` or a URL -> a base URL without a trailing slash."""
    address = address.strip().rstrip("/")
    if not address:
        raise ValueError("server address: must be non-empty")
    if "://" not in address:
        address = "http://" + address
    return address


def worker_url(value: Any) -> str:
    """A worker URL a router listed, checked and normalized (``http://host:port``).

    Raises:
        ValueError: not a string naming ``http://host:port`` (an IPv4/IPv6 address or a
            host name, a port 1-65535; no user, path, query or fragment), naming the rule.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    if len(value) > 512:
        raise ValueError(f"must be at most 512 characters, got {len(value)}")
    url = normalize_address(value)
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "http":
        raise ValueError(f"scheme {scheme[:20]!r}: must be http")
    host, sep, port = rest.rpartition(":")
    if not sep or not _HOST.fullmatch(host):
        raise ValueError("must be http://HOST:PORT with a host name or an IP address")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port[:20]!r}: must be an integer 1-65535")
    return f"http://{host}:{int(port)}"


def parse_worker_list(body: Any, where: str) -> list[tuple[str, str | None]]:
    """``(url, router's worker id or None)`` for each worker a router lists, its URL
    normalized by :func:`worker_url`.

    Accepts sglang-router's ``{"workers": [{"url", "id", ...}, ...]}`` and the older
    ``{"urls": [...]}``. An entry whose URL is malformed is skipped and logged (a router
    is untrusted: one bad entry costs that entry only); at most :data:`MAX_WORKERS` are read.

    Raises:
        EngineProtocolError: neither shape.
    """
    entries: list[Any]
    if isinstance(body, dict) and isinstance(body.get("workers"), list):
        entries = [(e.get("url"), e.get("id")) if isinstance(e, dict) else (e, None) for e in body["workers"]]
        name = "workers"
    elif isinstance(body, dict) and isinstance(body.get("urls"), list):
        entries = [(u, None) for u in body["urls"]]
        name = "urls"
    else:
        raise EngineProtocolError(f"{where}: must be an object with a 'workers' (or 'urls') list, got {body!r:.80}")
    out: list[tuple[str, str | None]] = []
    seen: set[str] = set()
    for i, (url, wid) in enumerate(entries[:MAX_WORKERS]):
        try:
            checked = worker_url(url)
        except ValueError as exc:
            log.warning("%s: %s[%d] skipped: url %r: %s", where, name, i, str(url)[:80], exc)
            continue
        if checked in seen:
            continue
        seen.add(checked)
        out.append((checked, wid if isinstance(wid, str) and len(wid) <= 256 else None))
    if len(entries) > MAX_WORKERS:
        log.warning("%s: lists %d workers; only the first %d are read", where, len(entries), MAX_WORKERS)
    return out


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
        left: the router stopped listing it (router mode): it is no longer part of the
            engine's fleet and is never brought back into service.
        barred: out of service because it disagreed on the weight version (never tried
            until brought back, not even when every other server is down).
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
        self.left = False
        self.barred = False

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
            lambda s: not s.barred and s not in exclude,
            lambda s: not s.barred,
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
        raise ServerUnavailableError(
            "no server to send the request to: every server is out of service for disagreeing on the "
            "weight version (each comes back once it holds the fleet's version)",
            server=", ".join(s.base_url for s in self.servers),
        )

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
        server.barred = False
