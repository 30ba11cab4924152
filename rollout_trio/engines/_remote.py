"""``RemoteEngine``: the InferenceEngine over HTTP to SGLang or vLLM servers.

One ``httpx.AsyncClient`` lives as long as the engine (``async with``). Each
``agenerate`` runs the interrupt/resume loop: note the fleet's weight version, send a
segment, append what came back (labelled with the version the server reports), shrink
the budget, wait while paused, send again. A cancelled request sends the server's abort
for its id in a shielded, time-bounded scope, so a cancelled group leaves no generation
running on any server.

Two ways to reach the servers:

* **direct**: ``RemoteEngine(["h1:30000", "h2:30000"])``; this engine routes each
  request itself (:mod:`._routing`).
* **router**: ``RemoteEngine(router="h0:30000")`` in front of an sglang-router (or a
  router with the same protocol). Generation goes through the router; the control
  plane (version reads, pause, resume, weight updates, aborts) goes to every worker
  directly, discovered from the router's ``GET /workers`` and refreshed every
  ``health_interval``.

The control plane tolerates faults: a server that cannot be reached (connect error,
timeout, 5xx) is skipped, logged with a :class:`~rollout_trio.ServerUnavailableError`
naming it, and taken out of service; once healthy again it is brought to the fleet's
weight version (reloading the last checkpoint) and pause state before it serves again.
A worker that joins a router mid-run goes through the same door.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from os import PathLike, fspath
from types import TracebackType
from typing import Any, Literal, Self

import httpx
import trio

from .._errors import (
    EngineConnectError,
    EngineError,
    EngineProtocolError,
    EngineServerError,
    FleetError,
    ServerUnavailableError,
    UnsupportedRequestError,
    VersionMismatchError,
)
from .._images import encode_image_base64
from .._io import ModelRequest, ModelResponse
from ..workflow_context import request_seed
from ._protocol import WeightsSource
from ._remote_http import HttpSession, RetryPolicy, is_retriable, retrying
from ._remote_wire import HttpCall, Segment, parse_version, segment_seed
from ._routing import Router, Server, normalize_address, parse_worker_list
from ._sglang import SGLangBackend
from ._transport import TrioTransport
from ._vllm import TITO_PATH, VLLMBackend

__all__ = ["RemoteEngine"]

log = logging.getLogger("rollout_trio.remote")

_FINAL = ("stop", "length", "tool_calls")


def _unavailable(exc: EngineError) -> bool:
    """Whether a failed control call says the server is away (skip it), not that it refused."""
    return is_retriable(exc)


class RemoteEngine:
    """An :class:`~rollout_trio.engines.InferenceEngine` backed by inference servers.

    Give either ``addresses`` (this engine routes between them) or ``router`` (an
    sglang-router in front of the workers; see the module docstring).

    Args:
        addresses: ``host:port`` strings or base URLs (one or many; a comma-separated
            string is split).
        backend: ``"sglang"`` or ``"vllm"``.
        router: the address of a router in front of the workers (sglang-router's
            protocol: ``GET /workers`` lists them). Generation goes through it; control
            calls and aborts go to each worker directly.
        routing: ``"round_robin"`` or ``"least_in_flight"`` (direct mode).
        affinity_size: how many ``rid -> server`` choices to remember (FIFO).
        request_timeout: seconds for one HTTP attempt (a generation segment included).
        control_timeout: seconds for one control call (pause, resume, abort, health).
        setup_timeout: seconds to wait at start for every server's ``/health``.
        connect_deadline: seconds at start that a server may go on refusing connections
            (or be unreachable) before :class:`EngineConnectError` names it and the last
            error; a server that accepts connections but is not healthy yet gets
            ``setup_timeout``. Raise it for servers that are still booting.
        retry: attempts and backoff for retriable failures.
        abort_grace: seconds a cancelled request may spend sending its abort.
        health_interval: seconds between rounds of :meth:`check_fleet` (health probes,
            bringing recovered servers back, refreshing a router's worker list).
        max_empty_aborts: consecutive empty ``abort`` answers tolerated (with backoff)
            while this engine is not paused, before ``EngineServerError``.
        vllm_api: ``"auto"`` (probe ``/inference/v1/generate``, fall back to
            ``/v1/completions`` on 403/404), ``"tito"`` or ``"completions"``.
        vllm_reload_path: the endpoint a vLLM server reloads weights from disk with
            (stock vLLM has none; AReaL's wrapper has ``/areal_update_weights``), or None
            to only relabel the version.
        verify_versions: label tokens with the versions the servers report, adopt a newer
            fleet version seen there (another trainer rank updated the servers), and raise
            :class:`VersionMismatchError` when a server reports a version older than the
            fleet's when the segment was sent (stale weights) or versions that go
            backwards. False: stamp SGLang tokens with :meth:`get_version` and check nothing.
        version: the weight version to assume when no server can report one at start
            (servers own their versions: at start the engine reads them and adopts the
            one they agree on; only :meth:`update_weights` changes them).
        api_key: sent as ``Authorization: Bearer`` on every call (``rollout-trio serve
            --api-key``, SGLang ``--api-key``, vLLM ``--api-key``).
        transport: an httpx transport to use instead of the default (a test seam).
        seed: seeds the routing start and the backoff jitter.
    """

    # The servers own the weight version (only update_weights changes it): an executor's
    # set_version announces the trainer's version without re-pinning this client.
    servers_own_version = True

    def __init__(
        self,
        addresses: str | Sequence[str] = (),
        backend: Literal["sglang", "vllm"] = "sglang",
        *,
        router: str | None = None,
        routing: Literal["round_robin", "least_in_flight"] = "round_robin",
        affinity_size: int = 128,
        request_timeout: float = 3600.0,
        control_timeout: float = 60.0,
        setup_timeout: float = 300.0,
        connect_deadline: float = 10.0,
        retry: RetryPolicy | None = None,
        abort_grace: float = 5.0,
        health_interval: float = 5.0,
        max_empty_aborts: int = 20,
        vllm_api: Literal["auto", "tito", "completions"] = "auto",
        vllm_reload_path: str | None = "/areal_update_weights",
        verify_versions: bool = True,
        version: int = 0,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        seed: int | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a.strip()]
        if router is None and not addresses:
            raise ValueError("RemoteEngine.addresses: give at least one server address (or router=)")
        if router is not None and addresses:
            raise ValueError("RemoteEngine.router: give either server addresses or router=, not both")
        if backend not in ("sglang", "vllm"):
            raise ValueError(f"RemoteEngine.backend: must be 'sglang' or 'vllm', got {backend!r}")
        if vllm_api not in ("auto", "tito", "completions"):
            raise ValueError(f"RemoteEngine.vllm_api: must be 'auto', 'tito' or 'completions', got {vllm_api!r}")
        for name, value in (
            ("request_timeout", request_timeout),
            ("control_timeout", control_timeout),
            ("setup_timeout", setup_timeout),
            ("connect_deadline", connect_deadline),
            ("abort_grace", abort_grace),
            ("health_interval", health_interval),
        ):
            if not value > 0:
                raise ValueError(f"RemoteEngine.{name}: must be > 0, got {value!r}")
        self.backend_name = backend
        self._rng = random.Random(seed)
        self._vllm_api = vllm_api
        self._workers = [Server(normalize_address(a), self._new_backend()) for a in addresses]
        self._gateway = Server(normalize_address(router), self._new_backend()) if router is not None else None
        targets = [self._gateway] if self._gateway is not None else self._workers
        self._router = Router(targets, strategy=routing, affinity_size=affinity_size, rng=self._rng)
        self._vllm_reload_path = vllm_reload_path
        self._request_timeout = float(request_timeout)
        self._control_timeout = float(control_timeout)
        self._setup_timeout = float(setup_timeout)
        self._connect_deadline = float(connect_deadline)
        self._retry = retry or RetryPolicy()
        self._abort_grace = float(abort_grace)
        self._health_interval = float(health_interval)
        self._max_empty_aborts = int(max_empty_aborts)
        self._verify = verify_versions
        self._version = int(version)
        #: The version the servers hold, as far as this engine knows (None: none reports one).
        self._fleet_version: int | None = None
        #: The checkpoint the fleet was last updated from: what a returning server reloads.
        self._checkpoint: str | None = None
        self._quarantined: set[str] = set()  # workers this engine took out of the router
        self._transport = transport
        self._api_key = api_key
        self._paused = False
        self._update_lock = trio.Lock()
        self._gate = trio.Event()
        self._gate.set()
        self._ids = itertools.count()
        self._warned: set[str] = set()
        self._stack: AsyncExitStack | None = None
        self._http: HttpSession | None = None
        self._nursery: trio.Nursery | None = None

    def _new_backend(self) -> Any:
        if self.backend_name == "sglang":
            return SGLangBackend()
        return VLLMBackend("completions" if self._vllm_api == "completions" else "tito")

    # ------------------------------------------------------------------ lifetime

    @property
    def servers(self) -> list[Server]:
        """The inference servers (router mode: the workers), with their up/down marks,
        in-flight counts, last known versions and the error that took them out."""
        return list(self._workers)

    @property
    def router_address(self) -> str | None:
        """The router's base URL in router mode, else None."""
        return self._gateway.base_url if self._gateway is not None else None

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("RemoteEngine: already entered")
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            transport = self._transport or _default_transport()
            client = httpx.AsyncClient(transport=transport, timeout=None)
            await stack.enter_async_context(client)  # closes the transport too
            self._http = HttpSession(client, transport, api_key=self._api_key)
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(self._nursery.cancel_scope.cancel)
            last: dict[Server, EngineError] = {}
            with trio.move_on_after(self._setup_timeout):
                if self._gateway is not None:
                    await self._wait_healthy([self._gateway], last)
                    await self._discover_at_start(last)
                await self._wait_healthy(self._workers, last)
            down = [s for s in self._all_servers() if not s.up]
            if down or not self._workers:
                raise EngineConnectError(
                    f"RemoteEngine: no healthy answer within setup_timeout={self._setup_timeout} s from "
                    + "; ".join(f"{s.base_url} (last error: {last.get(s, 'none')})" for s in down)
                    + ("" if self._workers else f"{self.router_address} (lists no workers)")
                )
            await self._setup_servers()
            self._nursery.start_soon(self._health_loop)
        except BaseException as exc:
            self._nursery = None
            self._http = None
            await _close(stack, exc)
            raise
        self._stack = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack = self._stack, None
        self._http = None
        self._nursery = None
        if stack is not None:
            await _close(stack, exc)

    def _session(self) -> HttpSession:
        if self._http is None:
            raise RuntimeError("RemoteEngine: use it inside 'async with RemoteEngine(...)'")
        return self._http

    def _all_servers(self) -> list[Server]:
        return ([self._gateway] if self._gateway is not None else []) + self._workers

    async def _wait_healthy(self, servers: Sequence[Server], last: dict[Server, EngineError]) -> None:
        """Probe until every server is healthy; a server refusing connections past
        ``connect_deadline`` is an :class:`EngineConnectError` naming it."""
        for server in servers:
            server.up = False
        pending = set(servers)
        refused_since: dict[Server, float] = {}
        while pending:
            for server in list(pending):
                error = await self._probe(server)
                if error is None:
                    self._router.mark_up(server)
                    pending.discard(server)
                    continue
                log.log(
                    logging.WARNING if server not in last else logging.DEBUG,
                    "%s is not healthy yet (still trying): %s",
                    server.base_url,
                    error,
                )
                last[server] = error
                if not isinstance(error, EngineConnectError):
                    refused_since.pop(server, None)
                    continue
                since = refused_since.setdefault(server, trio.current_time())
                if trio.current_time() - since >= self._connect_deadline:
                    raise EngineConnectError(
                        f"RemoteEngine: cannot connect to {server.base_url} "
                        f"(connect_deadline={self._connect_deadline:g} s): {error}"
                    ) from error
            if pending:
                await trio.sleep(0.2)

    async def _probe(self, server: Server) -> EngineError | None:
        """One health check: None when healthy, else the error."""
        try:
            await self._session().call(
                server.base_url, server.backend.health(), timeout=min(5.0, self._control_timeout), expect_json=False
            )
        except EngineError as exc:
            return exc
        return None

    # ------------------------------------------------------------------ router mode

    async def _list_workers(self) -> list[tuple[str, str | None]]:
        """The router's workers as ``(base URL, worker id)``."""
        assert self._gateway is not None
        url = self._gateway.base_url
        session = self._session()
        try:
            body = await session.call(url, HttpCall("GET", "/workers"), timeout=self._control_timeout)
        except EngineServerError as exc:
            if exc.status_code not in (404, 405):
                raise
            body = await session.call(url, HttpCall("GET", "/list_workers"), timeout=self._control_timeout)
        return parse_worker_list(body, f"GET {url}/workers")

    async def _discover_at_start(self, last: dict[Server, EngineError]) -> None:
        """Wait (within setup_timeout) until the router lists at least one worker."""
        assert self._gateway is not None
        while True:
            try:
                listed = await self._list_workers()
            except EngineError as exc:
                last[self._gateway] = exc
                listed = []
                if not _unavailable(exc):
                    raise
            if listed:
                for url, wid in listed:
                    server = Server(url, self._new_backend())
                    server.worker_id = wid
                    self._workers.append(server)
                log.info("router %s lists %d workers", self._gateway.base_url, len(listed))
                return
            await trio.sleep(0.2)

    async def _refresh_workers(self) -> None:
        """Follow the router's worker list: new workers join (out of service until brought
        in), workers the router no longer lists leave (unless this engine took them out)."""
        listed = dict(await self._list_workers())
        known = {s.base_url: s for s in self._workers}
        for url, wid in listed.items():
            if url in known:
                known[url].worker_id = wid
                continue
            server = Server(url, self._new_backend())
            if self._workers and isinstance(self._workers[0].backend, VLLMBackend):
                server.backend = VLLMBackend(self._workers[0].backend.api)
            server.worker_id = wid
            server.up = False  # serves for this engine once brought to the fleet's version
            self._workers.append(server)
            log.info("worker %s joined router %s", url, self.router_address)
        gone = [s for url, s in known.items() if url not in listed and url not in self._quarantined]
        if gone:  # one pass over the list, not one list.remove each (O(N^2) when many leave)
            for server in gone:
                server.left = True
                log.info("worker %s left router %s", server.base_url, self.router_address)
            self._workers[:] = [s for s in self._workers if not s.left]

    async def _quarantine(self, server: Server) -> bool:
        """Take a worker out of the router while it is brought up to date (best effort)."""
        if self._gateway is None or server.worker_id is None:
            return False
        try:
            await self._session().call(
                self._gateway.base_url,
                HttpCall("DELETE", f"/workers/{server.worker_id}"),
                timeout=self._control_timeout,
                expect_json=False,
            )
        except EngineError as exc:
            log.warning("could not take %s out of router %s: %s", server.base_url, self._gateway.base_url, exc)
            return False
        self._quarantined.add(server.base_url)
        return True

    async def _release(self, server: Server) -> None:
        """Give a quarantined worker back to the router."""
        assert self._gateway is not None
        try:
            await self._session().call(
                self._gateway.base_url,
                HttpCall("POST", "/workers", {"url": server.base_url}),
                timeout=self._control_timeout,
                expect_json=False,
            )
        finally:
            self._quarantined.discard(server.base_url)

    # ------------------------------------------------------------------ setup and health

    async def _setup_servers(self) -> None:
        reported: dict[str, int | None] = {}
        errors: dict[Server, EngineError] = {}

        async def one(server: Server) -> None:
            try:
                await self._setup_server(server, reported)
            except EngineError as exc:  # one typed error out of __aenter__, never a group
                errors[server] = exc

        async with trio.open_nursery() as nursery:
            for server in self._workers:
                nursery.start_soon(one, server)
        if errors:
            first = next(iter(errors.values()))
            if len(errors) > 1:
                first.add_note(f"setup also failed on: {_listing(dict(list(errors.items())[1:]))}")
            raise first
        for server in self._workers:
            server.version = reported.get(server.base_url)
        if self._gateway is not None and self._workers and isinstance(self._workers[0].backend, VLLMBackend):
            self._gateway.backend = VLLMBackend(self._workers[0].backend.api)
        self._adopt_versions(reported)

    def _adopt_versions(self, reported: dict[str, int | None]) -> None:
        """Take the servers' version when they agree; a disagreement is an error naming them."""
        known = {url: v for url, v in reported.items() if v is not None}
        if len(set(known.values())) > 1:
            listing = ", ".join(f"{url} at {v}" for url, v in sorted(known.items()))
            raise VersionMismatchError(
                f"RemoteEngine: the servers disagree on their weight version ({listing}); "
                "update them to one checkpoint (update_weights) before starting"
            )
        if known:
            version = next(iter(known.values()))
            if version != self._version:
                log.info("adopting weight version %d reported by %s", version, sorted(known))
            self._version = version
            self._fleet_version = version
        else:
            self._fleet_version = None  # take the version of the first reported tokens

    async def _setup_server(self, server: Server, reported: dict[str, int | None]) -> None:
        if self.backend_name == "vllm" and self._vllm_api == "auto":
            server.backend = VLLMBackend(await self._probe_vllm_api(server))
        if isinstance(server.backend, VLLMBackend) and not server.backend.can_abort:
            self._warn_once(
                "degraded-abort",
                "vLLM /v1/completions has no abort endpoint: aborts close the connection "
                "(start the server with --enable-scale-out for /inference/v1/* and real aborts)",
            )
        reported[server.base_url] = await self._read_version(server)

    async def _probe_vllm_api(self, server: Server) -> str:
        call = HttpCall(
            "POST",
            TITO_PATH,
            {
                "request_id": f"rollout-trio-probe-{next(self._ids)}",
                "token_ids": [0],
                "sampling_params": {"max_tokens": 1},
            },
        )
        try:
            await self._session().call(server.base_url, call, timeout=self._control_timeout, expect_json=False)
        except EngineServerError as exc:
            if exc.status_code in (403, 404, 405):
                log.warning("%s: %s answered %d; using /v1/completions", server.base_url, TITO_PATH, exc.status_code)
                return "completions"
            raise
        return "tito"

    async def _read_version(self, server: Server) -> int | None:
        """The server's weight version, or None when it has no endpoint that reports one."""
        try:
            body = await self._session().call(server.base_url, server.backend.version(), timeout=self._control_timeout)
        except EngineServerError as exc:
            if exc.status_code in (403, 404, 405):
                self._warn_once(
                    "no-version-endpoint",
                    f"{server.base_url} does not report its weight version (HTTP {exc.status_code}); "
                    "this engine takes the version of the first tokens it reports",
                )
                return None
            raise
        value = body.get("weight_version") if isinstance(body, dict) else None
        if value is None:
            return None
        return parse_version(value, f"{server.base_url}: weight_version")

    async def _health_loop(self) -> None:
        while True:
            await trio.sleep(self._health_interval)
            await self.check_fleet()

    async def check_fleet(self) -> None:
        """One round of what runs every ``health_interval`` in the background.

        Probes the router (router mode) and refreshes its worker list, probes every
        worker, marks failing ones down, and brings each healthy server that is out of
        service back: reloads the fleet's last checkpoint when its version differs (in
        router mode, out of the router while it does), applies this engine's pause state,
        then marks it up. Returns when the round is done (tests and operators can call
        it instead of waiting for the loop). Never raises for a server's failure.
        """
        if self._gateway is not None:
            await self._health_check(self._gateway)
            try:
                await self._refresh_workers()
            except EngineError as exc:
                log.warning("could not refresh the worker list of router %s: %s", self._gateway.base_url, exc)
        async with trio.open_nursery() as nursery:
            for server in list(self._workers):
                nursery.start_soon(self._health_check, server)

    async def _health_check(self, server: Server) -> None:
        error: EngineError | None
        try:
            error = await self._probe(server)
        except Exception:  # never let a probe bug take the engine down
            log.exception("health probe of %s failed", server.base_url)
            error = EngineError("the probe itself failed")
        if error is None and not server.up:
            if server is self._gateway:
                log.info("router %s is healthy again", server.base_url)
                self._router.mark_up(server)
            else:
                await self._bring_in(server)
        elif error is not None and server.up:
            log.warning("%s failed its health check; marked down: %s", server.base_url, error)
            self._router.mark_down(server)
        elif error is not None:
            log.debug("%s is still down: %s", server.base_url, error)

    async def _bring_in(self, server: Server) -> None:
        """Bring a healthy server that is out of service to the fleet's version and pause
        state, then mark it up; on failure it stays out (logged, retried next round)."""
        async with self._update_lock:  # never half-way through an update of the others
            if server.up or server.left:  # an O(1) test: 'not in self._workers' scanned the list
                return
            quarantined = False
            try:
                with trio.fail_after(self._control_timeout * 3):
                    if self.backend_name == "vllm" and self._vllm_api == "auto":
                        server.backend = VLLMBackend(await self._probe_vllm_api(server))
                    reported = await self._read_version(server)
                    held = reported if reported is not None else server.version
                    target = self._fleet_version
                    if target is not None and held is not None and held != target:
                        if self._checkpoint is None:
                            raise VersionMismatchError(
                                f"{server.base_url} holds weight version {held}, the fleet {target}, and this "
                                "engine has no checkpoint to reload it from (update_weights was not called here)"
                            )
                        quarantined = await self._quarantine(server)
                        log.info("reloading %s on %s (it holds version %d)", self._checkpoint, server.base_url, held)
                        await self._send(server, self._update_calls(server, self._checkpoint, target))
                    server.version = target if target is not None else held
                    while True:  # a pause or resume may land meanwhile: apply the last one
                        paused = self._paused
                        await self._send(server, server.backend.pause() if paused else server.backend.resume())
                        if self._paused == paused:
                            break
                    if quarantined:
                        await self._release(server)
                        quarantined = False
            except (EngineError, trio.TooSlowError) as exc:
                log.warning("%s is healthy but could not be brought back into service: %s", server.base_url, exc)
                server.error = exc if isinstance(exc, EngineError) else server.error
                if quarantined:
                    self._quarantined.discard(server.base_url)  # it stays out of the router
                return
            server.error = None
            self._router.mark_up(server)
            log.info("%s is back in service at weight version %s", server.base_url, server.version)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # ------------------------------------------------------------------ versions and pause

    def get_version(self) -> int:
        """The weight version of the fleet (stamped on tokens whose server reports none)."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the client-side weight version (servers are told by :meth:`update_weights`).

        Tokens from servers that report their version keep the servers' label.
        """
        self._version = int(version)

    @property
    def paused(self) -> bool:
        """Whether new segments are held."""
        return self._paused

    async def pause(self) -> None:
        """Hold new segments, then pause every server in service in abort mode.

        In-flight segments come back with ``abort`` and their partial output; their loops
        wait until :meth:`resume` and then send the rest. A server that cannot be reached
        is skipped and taken out of service (logged; see :meth:`check_fleet`).

        Raises:
            FleetError: a server refused the pause (this engine is paused all the same).
        """
        if not self._paused:
            self._paused = True
            self._gate = trio.Event()
        await self._control("pause", lambda s: s.backend.pause())

    async def resume(self) -> None:
        """Continue generation on every server in service, then release held segments.

        This engine resumes whatever the servers answer: a server that cannot be reached,
        or that refuses, is taken out of service (logged) and resumed when it is brought
        back, so one server cannot keep the fleet paused.
        """
        try:
            await self._control("resume", lambda s: s.backend.resume(), refusals="take_out")
        finally:
            self._paused = False
            self._gate.set()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Reload every server's weights from the checkpoint directory ``source``.

        Serialized (one update at a time). Pauses (unless already paused), sends the reload
        with ``str(version)`` as the servers' weight version, sets this engine's version,
        and resumes if it paused. The resume runs whatever happened, cancellation
        included (shielded, within ``control_timeout``).

        A server that cannot be reached or refuses the reload is skipped (logged as a
        :class:`ServerUnavailableError` naming it) and taken out of service; it reloads
        ``source`` before it serves again. Requests in flight are not lost: they resume
        after the update and their tokens carry the version the servers report.

        Raises:
            FleetError: no server took the update (the version is unchanged).
            UnsupportedRequestError: ``source`` is a state dict.
        """
        if isinstance(source, Mapping):
            raise UnsupportedRequestError(
                "RemoteEngine.update_weights: source must be a checkpoint directory the servers can read, "
                "not a state dict"
            )
        path = fspath(source) if isinstance(source, PathLike) else str(source)
        version = int(version)
        async with self._update_lock:
            was_paused = self._paused
            failed: BaseException | None = None
            reload_sent = False
            try:
                if not was_paused:
                    await self.pause()
                reload_sent = True
                done, errors = await self._fan_out(lambda s: self._update_calls(s, path, version))
                if not done:
                    why: dict[str, EngineError] = {s.base_url: s.error for s in self._workers if s.error is not None}
                    why.update((server.base_url, exc) for server, exc in errors.items())
                    raise FleetError(
                        f"RemoteEngine.update_weights: no server took version {version} from {path}: "
                        + (_listing(why) or "no server is in service"),
                        why,
                    )
                self._checkpoint = path
                self._fleet_version = version
                self.set_version(version)
                for server in done:
                    server.version = version
                self._take_out("update_weights", errors)
            except BaseException as exc:
                failed = exc
                if reload_sent:
                    # A server may have applied the reload though its answer never came back:
                    # learn where the servers stand before anything generates again.
                    await self._reread_versions(exc)
                raise
            finally:
                if not was_paused:
                    await self._resume_after_update()

    async def _reread_versions(self, failed: BaseException) -> None:
        """After an interrupted reload, adopt the servers' versions (shielded, bounded).

        When they disagree, or cannot be read, the interrupted error says so in a note.
        """
        reported: dict[str, int | None] = {}
        servers = [s for s in self._workers if s.up]
        with trio.CancelScope(shield=True), trio.move_on_after(self._control_timeout) as scope:

            async def one(server: Server) -> None:
                try:
                    reported[server.base_url] = await self._read_version(server)
                except EngineError as exc:
                    log.warning("could not read %s's version after an interrupted update: %s", server.base_url, exc)

            async with trio.open_nursery() as nursery:
                for server in servers:
                    nursery.start_soon(one, server)
        if scope.cancelled_caught or len(reported) < len(servers):
            if self._verify:
                self._fleet_version = None  # unknown: take the version of the first reported tokens
            failed.add_note("RemoteEngine.update_weights: interrupted; some servers' versions could not be read back")
            return
        for server in servers:
            server.version = reported[server.base_url]
        try:
            self._adopt_versions(reported)
        except VersionMismatchError as exc:
            log.error("%s", exc)
            failed.add_note(f"RemoteEngine.update_weights: interrupted mid-reload: {exc}")

    async def _resume_after_update(self) -> None:
        """Resume every server and this engine, even when cancelled; a server that cannot
        be resumed is taken out of service (and resumed when it is brought back)."""
        with trio.CancelScope(shield=True), trio.move_on_after(self._control_timeout * 2):
            try:
                await self._control("resume", lambda s: s.backend.resume(), refusals="take_out")
            finally:
                self._paused = False
                self._gate.set()

    async def update_weights_from_disk(self, path: str | PathLike[str], version: int) -> None:
        """The same as :meth:`update_weights` with a path."""
        await self.update_weights(path, version)

    def _update_calls(self, server: Server, path: str, version: int) -> list[HttpCall]:
        """The calls that reload ``server`` and label it ``version``."""
        if isinstance(server.backend, VLLMBackend):
            return server.backend.update_from_disk(path, version, self._vllm_reload_path)
        return server.backend.update_from_disk(path, version)

    async def _send(self, server: Server, calls: list[HttpCall]) -> None:
        """Send ``server`` its control calls in order, each with retries."""
        session = self._session()
        for call in calls:

            async def attempt(_k: int, call: HttpCall = call) -> Any:
                return await session.call(
                    server.base_url, call, timeout=self._control_timeout, expect_json=False, direct=True
                )

            try:
                await retrying(attempt, policy=self._retry, rng=self._rng)
            except EngineServerError as exc:
                if exc.status_code == 404 and call.path == self._vllm_reload_path:
                    raise EngineServerError(
                        f"{exc}. {server.base_url} has no {call.path} endpoint: a stock vLLM server cannot "
                        "reload weights over HTTP; pass RemoteEngine(vllm_reload_path=None) to only relabel "
                        "its version (and load the weights some other way)",
                        status_code=404,
                        body=exc.body,
                    ) from exc
                raise

    async def _fan_out(
        self, calls_for: Callable[[Server], list[HttpCall]]
    ) -> tuple[list[Server], dict[Server, EngineError]]:
        """Send every server in service its calls, all at once: who succeeded, who failed how."""
        done: list[Server] = []
        errors: dict[Server, EngineError] = {}

        async def one(server: Server) -> None:
            try:
                await self._send(server, calls_for(server))
            except EngineError as exc:
                errors[server] = exc
            else:
                done.append(server)

        async with trio.open_nursery() as nursery:
            for server in self._workers:
                if server.up:
                    nursery.start_soon(one, server)
        return done, errors

    async def _control(
        self, what: str, calls_for: Callable[[Server], list[HttpCall]], *, refusals: str = "raise"
    ) -> None:
        """Pause or resume the servers in service; skip (and take out) unavailable ones.
        A refusal raises (``refusals="raise"``) or takes that server out too (``"take_out"``).

        Raises:
            FleetError: a server refused the call (it stays in service).
        """
        _done, errors = await self._fan_out(calls_for)
        away = {s: e for s, e in errors.items() if refusals == "take_out" or _unavailable(e)}
        self._take_out(what, away)
        refused = {s.base_url: e for s, e in errors.items() if s not in away}
        if refused:
            raise FleetError(f"RemoteEngine.{what}: refused by " + _listing(refused), refused)

    def _take_out(self, what: str, errors: Mapping[Server, EngineError]) -> None:
        """Mark each server down with a logged :class:`ServerUnavailableError` naming it."""
        for server, exc in errors.items():
            error = ServerUnavailableError(
                f"{server.base_url}: {what} failed, taken out of service until it is healthy and brought "
                f"to weight version {self._fleet_version}: {type(exc).__name__}: {exc}",
                server=server.base_url,
            )
            error.__cause__ = exc
            server.error = error
            self._router.mark_down(server)
            log.error("%s", error)

    # ------------------------------------------------------------------ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req``, resuming across pauses.

        Each segment's tokens carry the version their server reports (a request held
        across a weight update is labelled with the new version, not failed). The seed
        (``gconfig.seed``, else :func:`~rollout_trio.workflow_context.request_seed`, as
        :class:`LocalEngine` does) goes to the server as SGLang ``sampling_seed`` / vLLM
        ``seed``; a segment resumed after ``n`` tokens sends
        :func:`~rollout_trio.engines._remote_wire.segment_seed` of ``(seed, n)``.

        Raises:
            UnsupportedRequestError: ``n_samples != 1``, no token budget, or a setting the
                backend refuses.
            EngineError: the servers failed (after retries, on other servers too) or
                answered malformed bodies.
            VersionMismatchError: a server reported a version older than the fleet's
                when the segment was sent (stale weights), or versions going backwards.
        """
        self._session()  # raises outside 'async with'
        g = req.gconfig
        if g.n_samples != 1:
            raise UnsupportedRequestError(
                f"GenerationConfig.n_samples: RemoteEngine generates one sample per request, got {g.n_samples}"
            )
        budget = min(g.max_tokens - len(req.input_ids), g.max_new_tokens)
        if budget <= 0:
            raise UnsupportedRequestError(
                f"GenerationConfig.max_tokens: the prompt ({len(req.input_ids)} tokens) leaves no room "
                f"(max_tokens={g.max_tokens}, max_new_tokens={g.max_new_tokens})"
            )
        if self.backend_name == "vllm" and (g.top_k_active or g.top_p < 1.0):
            self._warn_once(
                "vllm-topk",
                "vLLM with top-k/top-p active reports logprobs renormalised over the kept tokens; "
                "they differ from the trainer's log_softmax(logits / T)",
            )
        seed = g.seed if g.seed is not None else request_seed()
        start = trio.current_time()
        ttft: float | None = None
        prompt = list(req.input_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        stop = "abort"
        empty_aborts = 0
        while stop not in _FINAL and len(tokens) < budget:
            remaining = budget - len(tokens)
            min_new = min(remaining, max(0, g.min_new_tokens - len(tokens)))
            seg_seed = None if seed is None else segment_seed(seed, len(tokens))
            seg, label, floor, server = await self._segment(req, prompt + tokens, remaining, min_new, seg_seed)
            if len(seg.tokens) > remaining:
                raise EngineProtocolError(
                    f"{self.backend_name}: a segment returned {len(seg.tokens)} tokens for a budget of {remaining}"
                )
            seg_versions = self._versions_for(seg, label, floor, server)
            tokens += seg.tokens
            logprobs += seg.logprobs
            versions += seg_versions
            stop = seg.stop_reason
            if seg.tokens and ttft is None:
                ttft = trio.current_time() - start
            if stop == "abort" and not seg.tokens:
                if self._paused:
                    continue
                empty_aborts += 1
                if empty_aborts > self._max_empty_aborts:
                    raise EngineServerError(
                        f"{self.backend_name}: {empty_aborts} consecutive segments aborted with no output "
                        f"while this engine was not paused (last message: {seg.message!r})"
                    )
                await trio.sleep(self._retry.delay(min(empty_aborts, 6), self._rng))
            elif seg.tokens:
                empty_aborts = 0
        if stop == "abort":
            stop = "length"
        latency = trio.current_time() - start
        # Every field is checked already: the request on construction, each segment where
        # the backend parsed it (token ids, logprobs, versions, one entry per token).
        return ModelResponse.from_engine(
            input_tokens=req.input_ids,
            output_tokens=tuple(tokens),
            output_logprobs=tuple(logprobs),
            output_versions=tuple(versions),
            stop_reason=stop,  # type: ignore[arg-type]
            latency=latency,
            ttft=ttft if ttft is not None else latency,
            tokenizer=req.tokenizer,
        )

    def _versions_for(self, seg: Segment, label: int, floor: int | None, server: Server) -> list[int]:
        """One version per token of ``seg``: what the server reports, checked and adopted.

        ``label`` is this engine's version when the segment was sent (stamped where the
        server reports none); ``floor`` the fleet's version then (None: not known yet). A
        server reporting a *newer* version is right (the request was held across an
        update, or another trainer rank updated the fleet): the fleet's version is
        raised to it. An older one means stale weights.
        """
        if not seg.tokens:
            return []
        if seg.versions is not None:
            reported = seg.versions
        elif seg.server_version is not None and self._verify:
            reported = [seg.server_version] * len(seg.tokens)
        else:
            return [label] * len(seg.tokens)
        if not self._verify:
            return list(reported)
        if seg.versions is not None:  # per-token versions (one server-wide version cannot go backwards)
            for i in range(1, len(reported)):
                if reported[i] < reported[i - 1]:
                    raise VersionMismatchError(
                        f"{server.base_url}: weight versions go backwards within a segment "
                        f"({reported[i - 1]} then {reported[i]} at token {i})"
                    )
        if floor is not None and reported[0] < floor:
            raise VersionMismatchError(
                f"{server.base_url}: reports weight version {reported[0]} for tokens of a segment sent when "
                f"the fleet was at version {floor} (a server with stale weights)"
            )
        self._observe_version(reported[-1], server)
        return list(reported)

    def _observe_version(self, version: int, server: Server) -> None:
        """A server generated with ``version``: adopt it when it is newer than the fleet's."""
        if self._fleet_version is not None and version <= self._fleet_version:
            return
        log.info("adopting weight version %d reported by %s", version, server.base_url)
        self._fleet_version = version
        self._version = max(self._version, version)

    async def _segment(
        self, req: ModelRequest, ids: list[int], max_new: int, min_new: int, seed: int | None
    ) -> tuple[Segment, int, int | None, Server]:
        """One segment, this engine's and the fleet's version when it was sent, and the
        server that answered; with routing and retries.

        Each try waits while the engine is paused, notes the versions, and sends under a
        fresh server-side id; a failed try is aborted on its server.
        """
        tried: set[Server] = set()
        # Images go as base64 PNG, encoded once per image object (a group's slots share theirs).
        images = [encode_image_base64(img) for img in req.image_data] if req.image_data else None

        async def attempt(_k: int) -> tuple[Segment, int, int | None, Server]:
            while self._paused:
                await self._gate.wait()
            label, floor = self._version, self._fleet_version
            server = self._router.choose(req.rid, tried)
            server.backend.check(req.gconfig)
            srid = f"{req.rid}-{next(self._ids)}"
            call = server.backend.generate(
                ids, req.gconfig, max_new=max_new, min_new=min_new, rid=srid, seed=seed, image_data=images
            )
            try:
                with self._router.track(server):
                    body = await self._send_generate(server, call, srid)
            except EngineConnectError as exc:
                # Refused: the server is away. A read that broke mid-answer may be the
                # connection's fault alone: the server is marked down only if its health
                # check fails too (the attempt is retried elsewhere either way).
                if isinstance(exc.__cause__, httpx.ConnectError) or await self._probe(server) is not None:
                    self._router.mark_down(server)
                tried.add(server)
                raise
            except EngineError as exc:
                if is_retriable(exc):
                    tried.add(server)
                raise
            return server.backend.parse(body), label, floor, server

        def on_retry(k: int, exc: EngineError) -> None:
            log.warning("generation attempt %d for rid %s failed, retrying: %s", k + 1, req.rid, exc)

        return await retrying(attempt, policy=self._retry, rng=self._rng, on_retry=on_retry)

    async def _send_generate(self, server: Server, call: HttpCall, srid: str) -> Any:
        try:
            return await self._session().call(server.base_url, call, timeout=self._request_timeout, direct=True)
        except EngineServerError:
            raise  # the server answered: nothing runs for this id
        except BaseException as exc:
            cause = exc.__cause__
            if isinstance(cause, httpx.ConnectError):
                raise  # never reached the server
            with trio.CancelScope(shield=True), trio.move_on_after(self._abort_grace):
                await self._abort(server, srid)
            raise

    async def _abort(self, server: Server, srid: str) -> None:
        """Abort ``srid`` where it runs: on ``server``, or (through a router, which does not
        forward aborts) on every worker in service."""
        if server is not self._gateway:
            await self._abort_on(server, srid)
            return
        async with trio.open_nursery() as nursery:
            for worker in self._workers:
                if worker.up:
                    nursery.start_soon(self._abort_on, worker, srid)

    async def _abort_on(self, server: Server, srid: str) -> None:
        call = server.backend.abort(srid)
        if call is None:
            return  # the connection was closed by the cancellation: that aborts it
        try:
            await self._session().call(
                server.base_url, call, timeout=self._abort_grace, expect_json=False, direct=True
            )
        except EngineError as exc:
            log.warning("abort of %s on %s failed: %s", srid, server.base_url, exc)


def _listing(errors: Mapping[Any, EngineError]) -> str:
    """``url (Type: message); ...`` for servers (or their URLs) and their errors."""
    return "; ".join(
        f"{getattr(key, 'base_url', key)} ({type(exc).__name__}: {exc})"
        for key, exc in sorted(errors.items(), key=lambda item: str(getattr(item[0], "base_url", item[0])))
    )


async def _close(stack: AsyncExitStack, exc: BaseException | None) -> None:
    """Exit ``stack`` (client and nursery) as the block that raised ``exc`` (or None) ends.

    The health loop never fails, so a group raised here only wraps ``exc`` itself (the
    nursery saw it pass): that is left to propagate unwrapped.
    """
    try:
        await stack.__aexit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc else None)
    except BaseExceptionGroup as group:
        if exc is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc:
            return
        raise


def _default_transport() -> httpx.AsyncBaseTransport:
    return TrioTransport()
