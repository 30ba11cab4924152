"""``RemoteEngine``: the InferenceEngine over HTTP to SGLang or vLLM servers.

One ``httpx.AsyncClient`` lives as long as the engine (``async with``). The engine is made
of parts along its trust rules (DESIGN.md turn 4, "Trust"):

* transport: :mod:`._remote_http` (one attempt, retries, error mapping) over
  :mod:`._transport`;
* routing and fleet membership: :mod:`._routing` (choosing a server) and
  :mod:`._remote_fleet` (the workers, a router's list, who is in service, the control
  plane's calls);
* the version policy: :mod:`._version_policy` (which versions are accepted, when a server
  is out), applied by :mod:`._remote_service` (start, audits, health rounds, bringing a
  server back);
* request segments: :mod:`._remote_segments` (the interrupt/resume loop of ``agenerate``).

Two ways to reach the servers:

* **direct**: ``RemoteEngine(["h1:30000", "h2:30000"])``; this engine routes each
  request itself.
* **router**: ``RemoteEngine(router="h0:30000")`` in front of an sglang-router (or a
  router with the same protocol; SGLang workers only). Generation goes through the
  router; the control plane (version reads, pause, resume, weight updates, aborts) goes to
  every worker directly, discovered from the router's ``GET /workers`` and refreshed every
  ``health_interval``.

The control plane tolerates faults: a server that cannot be reached (connect error,
timeout, 5xx) is skipped, logged with a :class:`~rollout_trio.ServerUnavailableError`
naming it, and taken out of service; once healthy again it gets the fleet's weights
(reloading the last checkpoint, or through ``restore``) and pause state before it serves
again. A worker that joins a router mid-run goes through the same door.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from os import PathLike, fspath
from types import TracebackType
from typing import Literal, Self

import httpx
import trio

from .._errors import (
    EngineConnectError,
    EngineError,
    FleetError,
    UnsupportedRequestError,
)
from .._io import ModelRequest, ModelResponse
from ._protocol import WeightsSource
from ._remote_fleet import Membership, Shared, listing
from ._remote_http import HttpSession, RetryPolicy
from ._remote_segments import Segments
from ._remote_service import Restore, Service
from ._routing import Router, Server, normalize_address
from ._transport import TrioTransport
from ._version_policy import VersionPolicy, check_version

__all__ = ["RemoteEngine"]

log = logging.getLogger("rollout_trio.remote")


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
        vllm_reload_path: the endpoint a vLLM server reloads weights from disk with:
            ``/collective_rpc`` (the default: vLLM's dev-mode route, running its workers'
            ``reload_weights`` on the checkpoint's path, in place), another path taking
            ``{"model_path"}`` (AReaL's wrapper has ``/areal_update_weights``), or None:
            :meth:`update_weights` then only relabels the servers in service (the trainer
            loaded the weights some other way), and a server that comes back needs
            ``restore`` (it is never relabelled without its weights).
        verify_versions: label tokens with the versions the servers report and hold every
            answer to the fleet's version (:mod:`._version_policy`): an answer labelled
            older than the fleet's version when its segment was sent, newer than the
            fleet's version now (unless a quorum of the servers holds it), going
            backwards, or with a bad label is dropped, its server taken out of service,
            and the segment sent elsewhere. False: stamp SGLang tokens with
            :meth:`get_version` and check nothing.
        version: the weight version to assume when no server can report one at start
            (at start the engine reads the servers' versions and adopts the one they agree
            on, or a strict majority holds).
        restore: ``await restore(base_url, version)`` when a server that comes back must
            get the weights of ``version`` and this engine cannot load them itself (a vLLM
            server without a reload route, or an engine that never published a checkpoint
            while the server holds another version): the trainer pushes them, and the
            engine then labels the server and puts it back. Raising keeps it out (logged,
            tried again next round). None: such a server stays out of service.
        api_key: sent as ``Authorization: Bearer`` on every call (``rollout-trio serve
            --api-key``, SGLang ``--api-key``, vLLM ``--api-key``, the key
            ``rollout-trio fleet`` wrote); None: ``$ROLLOUT_TRIO_API_KEY`` if set.
        transport: an httpx transport to use instead of the default (a test seam).
        seed: seeds the routing start and the backoff jitter.

    Raises:
        ValueError: an argument out of range, both or neither of ``addresses`` and
            ``router``, or ``router`` with ``backend="vllm"`` (sglang-router cannot front
            vLLM's token routes).
    """

    # The fleet's version moves only by this engine's control plane (update_weights,
    # set_version): an executor's set_version announces the trainer's version to the
    # executor without moving this engine's.
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
        vllm_reload_path: str | None = "/collective_rpc",
        verify_versions: bool = True,
        version: int = 0,
        restore: Restore | None = None,
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
        if router is not None and backend == "vllm":
            raise ValueError(
                "RemoteEngine(router=..., backend='vllm'): sglang-router cannot front vLLM's token routes "
                "(/inference/v1/generate, per-token weight_versions; it answers them 404): give the vLLM "
                "servers' addresses instead and this engine routes between them"
            )
        self.backend_name = backend
        self._shared = shared = Shared(
            backend_name=backend,
            vllm_api=vllm_api,
            vllm_reload_path=vllm_reload_path,
            rng=random.Random(seed),
            retry=retry or RetryPolicy(),
            control_timeout=float(control_timeout),
            request_timeout=float(request_timeout),
            abort_grace=float(abort_grace),
        )
        self._policy = VersionPolicy(version, verify=verify_versions)
        workers = [Server(normalize_address(a), shared.new_backend()) for a in addresses]
        gateway = Server(normalize_address(router), shared.new_backend()) if router is not None else None
        targets = [gateway] if gateway is not None else workers
        routing_ = Router(targets, strategy=routing, affinity_size=affinity_size, rng=shared.rng)
        self._members = Membership(shared, self._policy, workers, gateway, routing_)
        self._service = Service(shared, self._members, self._policy, restore=restore)
        self._segments = Segments(
            shared,
            self._members,
            self._policy,
            audit=self._service.audit,
            bar=self._service.bar,
            max_empty_aborts=int(max_empty_aborts),
        )
        self._setup_timeout = float(setup_timeout)
        self._connect_deadline = float(connect_deadline)
        self._health_interval = float(health_interval)
        self._transport = transport
        self._api_key = api_key if api_key is not None else (os.environ.get("ROLLOUT_TRIO_API_KEY") or None)
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ lifetime

    @property
    def servers(self) -> list[Server]:
        """The inference servers (router mode: the workers), with their up/down marks,
        in-flight counts, last known versions and the error that took them out."""
        return list(self._members.workers)

    @property
    def router_address(self) -> str | None:
        """The router's base URL in router mode, else None."""
        gateway = self._members.gateway
        return gateway.base_url if gateway is not None else None

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("RemoteEngine: already entered")
        members = self._members
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            transport = self._transport or TrioTransport()
            client = httpx.AsyncClient(transport=transport, timeout=None)
            await stack.enter_async_context(client)  # closes the transport too
            self._shared.http = HttpSession(client, transport, api_key=self._api_key)
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(self._nursery.cancel_scope.cancel)
            last: dict[Server, EngineError] = {}
            with trio.move_on_after(self._setup_timeout):
                if members.gateway is not None:
                    await members.wait_healthy([members.gateway], last, self._connect_deadline)
                    await members.discover_at_start(last)
                await members.wait_healthy(members.workers, last, self._connect_deadline)
            down = [s for s in members.all_servers() if not s.up]
            if down or not members.workers:
                raise EngineConnectError(
                    f"RemoteEngine: no healthy answer within setup_timeout={self._setup_timeout} s from "
                    + "; ".join(f"{s.base_url} (last error: {last.get(s, 'none')})" for s in down)
                    + ("" if members.workers else f"{self.router_address} (lists no workers)")
                )
            await self._service.setup_servers()
            self._nursery.start_soon(self._service.health_loop, self._health_interval)
        except BaseException as exc:
            self._nursery = None
            self._shared.http = None
            await _close(stack, exc)
            raise
        self._stack = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack = self._stack, None
        self._shared.http = None
        self._nursery = None
        if stack is not None:
            await _close(stack, exc)

    async def check_fleet(self) -> None:
        """One round of what runs every ``health_interval`` in the background.

        Probes the router (router mode) and refreshes its worker list, probes every
        worker, marks failing ones down, and brings each healthy server that is out of
        service back: gives it the fleet's weights (reloads the last checkpoint, or asks
        ``restore``; in router mode, out of the router while it does), applies this
        engine's pause state, then marks it up. A server that cannot be given the fleet's
        weights stays out. Returns when the round is done (tests and operators can call
        it instead of waiting for the loop). Never raises for a server's failure.
        """
        self._shared.session()  # raises outside 'async with'
        await self._service.check_fleet()

    # ------------------------------------------------------------------ versions and pause

    def get_version(self) -> int:
        """The weight version of the fleet (stamped on tokens whose server reports none)."""
        return self._policy.label

    def set_version(self, version: int) -> None:
        """The trainer says the fleet now holds ``version`` (it pushed the weights itself,
        or another rank published them): answers labelled ``version`` are accepted from now
        on, and servers still at an older version are taken out as they answer. Servers are
        told nothing (:meth:`update_weights` loads and labels them).

        Raises:
            VersionLabelError: ``version`` is not an int in ``[0, 2**63 - 1]``.
        """
        self._policy.set(check_version(version, "RemoteEngine.set_version.version"))

    @property
    def paused(self) -> bool:
        """Whether new segments are held."""
        return self._shared.paused

    async def pause(self) -> None:
        """Hold new segments, then pause every server in service in abort mode.

        In-flight segments come back with ``abort`` and their partial output; their loops
        wait until :meth:`resume` and then send the rest. A server that cannot be reached
        is skipped and taken out of service (logged; see :meth:`check_fleet`).

        Raises:
            FleetError: a server refused the pause (this engine is paused all the same).
        """
        shared = self._shared
        if not shared.paused:
            shared.paused = True
            shared.gate = trio.Event()
        await self._members.control("pause", lambda s: s.backend.pause())

    async def resume(self) -> None:
        """Continue generation on every server in service, then release held segments.

        This engine resumes whatever the servers answer: a server that cannot be reached,
        or that refuses, is taken out of service (logged) and resumed when it is brought
        back, so one server cannot keep the fleet paused.
        """
        try:
            await self._members.control("resume", lambda s: s.backend.resume(), refusals="take_out")
        finally:
            self._shared.paused = False
            self._shared.gate.set()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Reload every server's weights from the checkpoint directory ``source``.

        Serialized (one update at a time). Pauses (unless already paused), sends the reload
        with ``str(version)`` as the servers' weight version, sets the fleet's version, and
        resumes if it paused. The resume runs whatever happened, cancellation included
        (shielded, within ``control_timeout``).

        A server that cannot be reached or refuses the reload is skipped (logged as a
        :class:`ServerUnavailableError` naming it) and taken out of service; it gets
        ``source`` before it serves again. Requests in flight are not lost: they resume
        after the update and their tokens carry the version the servers report.

        Raises:
            FleetError: no server took the update (the version is unchanged).
            UnsupportedRequestError: ``source`` is a state dict.
            VersionLabelError: ``version`` is not an int in ``[0, 2**63 - 1]``.
        """
        if isinstance(source, Mapping):
            raise UnsupportedRequestError(
                "RemoteEngine.update_weights: source must be a checkpoint directory the servers can read, "
                "not a state dict"
            )
        path = fspath(source) if isinstance(source, PathLike) else str(source)
        version = check_version(version, "RemoteEngine.update_weights.version")
        shared, members = self._shared, self._members
        async with shared.update_lock:
            was_paused = shared.paused
            reload_sent = False
            try:
                if not was_paused:
                    await self.pause()
                reload_sent = True
                done, errors = await members.fan_out(lambda s: shared.update_calls(s, path, version))
                if not done:
                    why: dict[str, EngineError] = {s.base_url: s.error for s in members.workers if s.error is not None}
                    why.update((server.base_url, exc) for server, exc in errors.items())
                    raise FleetError(
                        f"RemoteEngine.update_weights: no server took version {version} from {path}: "
                        + (listing(why) or "no server is in service"),
                        why,
                    )
                self._service.checkpoint = path
                self._policy.set(version)
                for server in done:
                    server.version = version
                members.take_out("update_weights", errors)
            except BaseException as exc:
                if reload_sent:
                    # A server may have applied the reload though its answer never came back:
                    # learn where the servers stand before anything generates again.
                    await self._service.reread_versions(exc)
                raise
            finally:
                if not was_paused:
                    await self._resume_after_update()

    async def _resume_after_update(self) -> None:
        """Resume every server and this engine, even when cancelled; a server that cannot
        be resumed is taken out of service (and resumed when it is brought back)."""
        with trio.CancelScope(shield=True), trio.move_on_after(self._shared.control_timeout * 2):
            await self.resume()

    async def update_weights_from_disk(self, path: str | PathLike[str], version: int) -> None:
        """The same as :meth:`update_weights` with a path."""
        await self.update_weights(path, version)

    # ------------------------------------------------------------------ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req``, resuming across pauses.

        Each segment's tokens carry the version their server reports (a request held
        across a weight update is labelled with the new version, not failed). The seed
        (``gconfig.seed``, else :func:`~rollout_trio.workflow_context.request_seed`, as
        :class:`LocalEngine` does) goes to the server as SGLang ``sampling_seed`` / vLLM
        ``seed``; a segment resumed after ``n`` tokens sends
        :func:`~rollout_trio.engines._remote_wire.segment_seed` of ``(seed, n)``. An
        answer whose versions disagree with the fleet's is dropped and its segment sent to
        another server (see ``verify_versions``).

        Raises:
            UnsupportedRequestError: ``n_samples != 1``, no token budget, or a setting the
                backend refuses.
            EngineError: the servers failed (after retries, on other servers too) or
                answered malformed bodies.
            ServerUnavailableError: every try went to servers whose answers disagreed
                with the fleet's version (each taken out of service), or none is left.
        """
        return await self._segments.agenerate(req)


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
