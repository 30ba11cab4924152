"""``RemoteEngine``'s fleet membership: which servers there are and which are in service.

* the workers (given, or discovered from a router's ``GET /workers`` and refreshed),
* health probes at start (``connect_deadline``, ``setup_timeout``) and in the background,
* taking a server out of service (logged with a :class:`~rollout_trio.ServerUnavailableError`
  naming it) and, in router mode, out of the router while it is brought up to date,
* the control plane's transport: a server's calls in order with retries, and one call
  fanned out to every server in service.

Which version a server must hold to come back is :mod:`._version_policy`'s rule; bringing
it back is the engine's (it owns the checkpoint and the pause state).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from .._errors import (
    EngineConnectError,
    EngineError,
    EngineServerError,
    FleetError,
    ServerUnavailableError,
)
from ._remote_http import HttpSession, RetryPolicy, is_retriable, retrying
from ._remote_wire import HttpCall
from ._routing import Router, Server, parse_worker_list
from ._sglang import SGLangBackend
from ._version_policy import VersionPolicy, parse_version_label
from ._vllm import TITO_PATH, VLLMBackend

__all__ = ["Membership", "Shared", "listing", "unavailable"]

log = logging.getLogger("rollout_trio.remote")


def unavailable(exc: EngineError) -> bool:
    """Whether a failed control call says the server is away (skip it), not that it refused."""
    return is_retriable(exc)


def listing(errors: Mapping[Any, BaseException]) -> str:
    """``url (Type: message); ...`` for servers (or their URLs) and their errors."""
    return "; ".join(
        f"{getattr(key, 'base_url', key)} ({type(exc).__name__}: {exc})"
        for key, exc in sorted(errors.items(), key=lambda item: str(getattr(item[0], "base_url", item[0])))
    )


class Shared:
    """What the engine's parts share: settings, the HTTP session, the pause gate, the update lock."""

    def __init__(
        self,
        *,
        backend_name: str,
        vllm_api: str,
        vllm_reload_path: str | None,
        rng: random.Random,
        retry: RetryPolicy,
        control_timeout: float,
        request_timeout: float,
        abort_grace: float,
    ) -> None:
        self.backend_name = backend_name
        self.vllm_api = vllm_api
        self.vllm_reload_path = vllm_reload_path
        self.rng = rng
        self.retry = retry
        self.control_timeout = control_timeout
        self.request_timeout = request_timeout
        self.abort_grace = abort_grace
        self.http: HttpSession | None = None
        self.paused = False
        self.gate = trio.Event()
        self.gate.set()
        self.update_lock = trio.Lock()
        self.ids = itertools.count()
        self._warned: set[str] = set()

    def session(self) -> HttpSession:
        if self.http is None:
            raise RuntimeError("RemoteEngine: use it inside 'async with RemoteEngine(...)'")
        return self.http

    def new_backend(self) -> Any:
        if self.backend_name == "sglang":
            return SGLangBackend()
        return VLLMBackend("completions" if self.vllm_api == "completions" else "tito")

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def can_reload(self, server: Server) -> bool:
        """Whether this engine can load a checkpoint into ``server`` itself."""
        if isinstance(server.backend, VLLMBackend):
            return self.vllm_reload_path is not None
        return True

    def update_calls(self, server: Server, path: str, version: int) -> list[HttpCall]:
        """The calls that reload ``server`` from ``path`` and label it ``version``."""
        if isinstance(server.backend, VLLMBackend):
            return server.backend.update_from_disk(path, version, self.vllm_reload_path)
        return server.backend.update_from_disk(path, version)


class Membership:
    """The servers, the router in front of them (if any), and who is in service."""

    def __init__(
        self, shared: Shared, policy: VersionPolicy, workers: list[Server], gateway: Server | None, router: Router
    ) -> None:
        self.shared = shared
        self.policy = policy
        self.workers = workers
        self.gateway = gateway
        self.router = router
        self.quarantined: set[str] = set()  # workers this engine took out of the router

    def all_servers(self) -> list[Server]:
        return ([self.gateway] if self.gateway is not None else []) + self.workers

    def in_service(self) -> list[Server]:
        return [s for s in self.workers if s.up]

    # ------------------------------------------------------------------ health

    async def wait_healthy(
        self, servers: Sequence[Server], last: dict[Server, EngineError], connect_deadline: float
    ) -> None:
        """Probe until every server is healthy; a server refusing connections past
        ``connect_deadline`` is an :class:`EngineConnectError` naming it."""
        for server in servers:
            server.up = False
        pending = set(servers)
        refused_since: dict[Server, float] = {}
        while pending:
            for server in list(pending):
                error = await self.probe(server)
                if error is None:
                    self.router.mark_up(server)
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
                if trio.current_time() - since >= connect_deadline:
                    raise EngineConnectError(
                        f"RemoteEngine: cannot connect to {server.base_url} "
                        f"(connect_deadline={connect_deadline:g} s): {error}"
                    ) from error
            if pending:
                await trio.sleep(0.2)

    async def probe(self, server: Server) -> EngineError | None:
        """One health check: None when healthy, else the error."""
        try:
            await self.shared.session().call(
                server.base_url,
                server.backend.health(),
                timeout=min(5.0, self.shared.control_timeout),
                expect_json=False,
            )
        except EngineError as exc:
            return exc
        return None

    async def probe_vllm_api(self, server: Server) -> str:
        call = HttpCall(
            "POST",
            TITO_PATH,
            {
                "request_id": f"rollout-trio-probe-{next(self.shared.ids)}",
                "token_ids": [0],
                "sampling_params": {"max_tokens": 1},
            },
        )
        try:
            await self.shared.session().call(
                server.base_url, call, timeout=self.shared.control_timeout, expect_json=False
            )
        except EngineServerError as exc:
            if exc.status_code in (403, 404, 405):
                log.warning("%s: %s answered %d; using /v1/completions", server.base_url, TITO_PATH, exc.status_code)
                return "completions"
            raise
        return "tito"

    async def read_version(self, server: Server) -> int | None:
        """The server's weight version, or None when it has no endpoint that reports one.

        Raises:
            VersionLabelError: the label it reports breaks the rules.
        """
        try:
            body = await self.shared.session().call(
                server.base_url, server.backend.version(), timeout=self.shared.control_timeout
            )
        except EngineServerError as exc:
            if exc.status_code in (403, 404, 405):
                self.shared.warn_once(
                    "no-version-endpoint",
                    f"{server.base_url} does not report its weight version (HTTP {exc.status_code}); "
                    "this engine labels its tokens as the servers report them and checks only their order",
                )
                return None
            raise
        value = body.get("weight_version") if isinstance(body, dict) else None
        if value is None:
            return None
        return parse_version_label(value, f"{server.base_url}: weight_version")

    async def read_versions(self, servers: Sequence[Server]) -> dict[Server, int | None | EngineError]:
        """Every server's version read at once (an error where it could not be read)."""
        out: dict[Server, int | None | EngineError] = {}

        async def one(server: Server) -> None:
            try:
                out[server] = await self.read_version(server)
            except EngineError as exc:
                out[server] = exc

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(one, server)
        return out

    # ------------------------------------------------------------------ router mode

    async def list_workers(self) -> list[tuple[str, str | None]]:
        """The router's workers as ``(base URL, worker id)``."""
        assert self.gateway is not None
        url = self.gateway.base_url
        session = self.shared.session()
        timeout = self.shared.control_timeout
        try:
            body = await session.call(url, HttpCall("GET", "/workers"), timeout=timeout)
        except EngineServerError as exc:
            if exc.status_code not in (404, 405):
                raise
            body = await session.call(url, HttpCall("GET", "/list_workers"), timeout=timeout)
        return parse_worker_list(body, f"GET {url}/workers")

    async def discover_at_start(self, last: dict[Server, EngineError]) -> None:
        """Wait (within setup_timeout) until the router lists at least one worker."""
        assert self.gateway is not None
        while True:
            try:
                listed = await self.list_workers()
            except EngineError as exc:
                last[self.gateway] = exc
                listed = []
                if not unavailable(exc):
                    raise
            if listed:
                for url, wid in listed:
                    server = Server(url, self.shared.new_backend())
                    server.worker_id = wid
                    self.workers.append(server)
                log.info("router %s lists %d workers", self.gateway.base_url, len(listed))
                return
            await trio.sleep(0.2)

    async def refresh_workers(self) -> None:
        """Follow the router's worker list: new workers join (out of service until brought
        in), workers the router no longer lists leave (unless this engine took them out)."""
        assert self.gateway is not None
        listed = dict(await self.list_workers())
        known = {s.base_url: s for s in self.workers}
        for url, wid in listed.items():
            if url in known:
                known[url].worker_id = wid
                continue
            server = Server(url, self.shared.new_backend())
            if self.workers and isinstance(self.workers[0].backend, VLLMBackend):
                server.backend = VLLMBackend(self.workers[0].backend.api)
            server.worker_id = wid
            server.up = False  # serves for this engine once brought to the fleet's version
            self.workers.append(server)
            log.info("worker %s joined router %s", url, self.gateway.base_url)
        gone = [s for url, s in known.items() if url not in listed and url not in self.quarantined]
        if gone:  # one pass over the list, not one list.remove each (O(N^2) when many leave)
            for server in gone:
                server.left = True
                log.info("worker %s left router %s", server.base_url, self.gateway.base_url)
            self.workers[:] = [s for s in self.workers if not s.left]

    async def quarantine(self, server: Server) -> bool:
        """Take a worker out of the router while it is brought up to date (best effort)."""
        if self.gateway is None or server.worker_id is None or server.base_url in self.quarantined:
            return self.gateway is not None and server.base_url in self.quarantined
        try:
            await self.shared.session().call(
                self.gateway.base_url,
                HttpCall("DELETE", f"/workers/{server.worker_id}"),
                timeout=self.shared.control_timeout,
                expect_json=False,
            )
        except EngineError as exc:
            log.warning("could not take %s out of router %s: %s", server.base_url, self.gateway.base_url, exc)
            return False
        self.quarantined.add(server.base_url)
        return True

    async def release(self, server: Server) -> None:
        """Give a quarantined worker back to the router."""
        assert self.gateway is not None
        try:
            await self.shared.session().call(
                self.gateway.base_url,
                HttpCall("POST", "/workers", {"url": server.base_url}),
                timeout=self.shared.control_timeout,
                expect_json=False,
            )
        finally:
            self.quarantined.discard(server.base_url)

    # ------------------------------------------------------------------ out of service

    def take_out(self, what: str, errors: Mapping[Server, EngineError], *, barred: bool = False) -> None:
        """Mark each server down with a logged :class:`ServerUnavailableError` naming it.

        ``barred``: it disagreed on the version; no request goes to it, even when every
        other server is down too, until it is brought back.
        """
        for server, exc in errors.items():
            error = ServerUnavailableError(
                f"{server.base_url}: {what} failed, taken out of service until it is healthy and holds "
                f"weight version {self.policy.fleet}: {type(exc).__name__}: {exc}",
                server=server.base_url,
            )
            error.__cause__ = exc
            server.error = error
            self.router.mark_down(server)
            server.barred = server.barred or barred
            log.error("%s", error)

    async def bar(self, what: str, errors: Mapping[Server, EngineError]) -> None:
        """Take servers that disagree on the version out of service, and (router mode) out
        of the router, so no request reaches them until they are brought back."""
        errors = {s: e for s, e in errors.items() if s.up or not s.barred}
        self.take_out(what, errors, barred=True)
        for server in errors:
            await self.quarantine(server)

    # ------------------------------------------------------------------ control transport

    async def send(self, server: Server, calls: list[HttpCall]) -> None:
        """Send ``server`` its control calls in order, each with retries."""
        session = self.shared.session()
        reload_path = self.shared.vllm_reload_path
        for call in calls:

            async def attempt(_k: int, call: HttpCall = call) -> Any:
                return await session.call(
                    server.base_url, call, timeout=self.shared.control_timeout, expect_json=False, direct=True
                )

            try:
                await retrying(attempt, policy=self.shared.retry, rng=self.shared.rng)
            except EngineServerError as exc:
                if exc.status_code == 404 and call.path == reload_path:
                    raise EngineServerError(
                        f"{exc}. {server.base_url} has no {call.path} endpoint: start vLLM with "
                        "VLLM_SERVER_DEV_MODE=1 for /collective_rpc (the default vllm_reload_path), or pass "
                        "RemoteEngine(vllm_reload_path=None) to only relabel its version (and load the "
                        "weights some other way, with restore= for servers that come back)",
                        status_code=404,
                        body=exc.body,
                    ) from exc
                raise

    async def fan_out(
        self, calls_for: Callable[[Server], list[HttpCall]]
    ) -> tuple[list[Server], dict[Server, EngineError]]:
        """Send every server in service its calls, all at once: who succeeded, who failed how."""
        done: list[Server] = []
        errors: dict[Server, EngineError] = {}

        async def one(server: Server) -> None:
            try:
                await self.send(server, calls_for(server))
            except EngineError as exc:
                errors[server] = exc
            else:
                done.append(server)

        async with trio.open_nursery() as nursery:
            for server in self.workers:
                if server.up:
                    nursery.start_soon(one, server)
        return done, errors

    async def control(
        self, what: str, calls_for: Callable[[Server], list[HttpCall]], *, refusals: str = "raise"
    ) -> None:
        """Pause or resume the servers in service; skip (and take out) unavailable ones.
        A refusal raises (``refusals="raise"``) or takes that server out too (``"take_out"``).

        Raises:
            FleetError: a server refused the call (it stays in service).
        """
        _done, errors = await self.fan_out(calls_for)
        away = {s: e for s, e in errors.items() if refusals == "take_out" or unavailable(e)}
        self.take_out(what, away)
        refused = {s.base_url: e for s, e in errors.items() if s not in away}
        if refused:
            raise FleetError(f"RemoteEngine.{what}: refused by " + listing(refused), refused)
