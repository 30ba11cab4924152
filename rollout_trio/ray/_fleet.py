"""A fleet of inference servers placed by Ray: :func:`open_ray_fleet`.

Each server is a Ray actor in a placement group of its own (one bundle: ``num_cpus``,
``num_gpus`` and any custom resources), restarted by Ray (``max_restarts``) when its
process or its node dies. The router (sglang-router) is an actor on the driver's node.
The driver runs one supervisor task per server, in a Trio nursery:

1. it asks the actor to make sure its server runs (:meth:`ServerActor.ensure_started`);
2. it registers a server it has not seen before with the router (``POST /workers``) and
   takes the address of the server it replaces out (``DELETE /workers/{id}``);
3. every ``health_interval`` seconds it asks the actor whether the server still runs;
   when the answer is no, or the actor cannot answer (it died, its node is gone), the slot
   is down from then until a replacement is healthy and registered: that time is logged
   and kept in :attr:`RayFleet.heal_times`.

Weights are not the fleet's business: a ``RemoteEngine(router=fleet.router_url, ...)``
notices a replacement at its next membership refresh and brings it to the fleet's weight
version before it serves (the engine's rule for any worker that joins).

Ray's blocking calls run in worker threads (``trio.to_thread.run_sync``), each with a
deadline, so that no wait of the driver depends on Ray without one.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from .._bounded import aread_response, loads_json
from ._process import SERVER_KINDS, RayFleetError

__all__ = ["RayFleet", "RayServer", "open_ray_fleet"]

log = logging.getLogger("rollout_trio.ray")
#: The most a server's or the router's answer may hold, raw and decoded.
MAX_ANSWER_BYTES = 16 * 2**20


@attrs.define(eq=False)
class RayServer:
    """One server slot of the fleet, as the driver sees it.

    Attributes:
        index: the slot's number (stable across restarts).
        url: the address of its current server, or None before the first start.
        node_ip: the address of the node its current server runs on.
        node_id: that node's Ray id.
        pid: the server process's id on that node.
        starts: servers started for this slot (1 until a restart).
        up: whether its server is healthy and registered with the router now.
    """

    index: int
    actor: Any = attrs.field(repr=False)
    placement_group: Any = attrs.field(repr=False)
    url: str | None = None
    node_ip: str | None = None
    node_id: str | None = None
    pid: int | None = None
    starts: int = 0
    up: bool = False
    down_since: float | None = attrs.field(default=None, repr=False)
    ready: trio.Event = attrs.field(factory=trio.Event, repr=False)
    error: BaseException | None = attrs.field(default=None, repr=False)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope, repr=False)


@attrs.define(eq=False)
class _Options:
    kind: str
    server_options: list[str]
    bundle: dict[str, float]
    max_restarts: int
    startup_timeout: float
    health_interval: float
    stop_timeout: float
    drain_timeout: float
    api_key: str | None


class RayFleet:
    """A running fleet (what :func:`open_ray_fleet` yields).

    Attributes:
        router_url: the router's address: give it to ``RemoteEngine(router=...)``.
        metrics_url: the router's Prometheus endpoint.
        api_key: the key every server and the router require (None if the fleet has none).
        heal_times: seconds from each server's loss to its healthy, registered replacement.
    """

    def __init__(self, options: _Options, nursery: trio.Nursery, router: Any, router_info: Mapping[str, Any]) -> None:
        self._options = options
        self._nursery = nursery
        self._router = router
        self.router_url: str = router_info["url"]
        self.metrics_url: str = router_info["metrics_url"]
        self.api_key = options.api_key
        self.heal_times: list[float] = []
        self._slots: list[RayServer] = []
        self._next_index = 0
        self._http = httpx.AsyncClient(
            timeout=10.0,
            trust_env=False,
            headers={"Authorization": f"Bearer {options.api_key}"} if options.api_key else {},
        )

    @property
    def servers(self) -> list[RayServer]:
        """The fleet's server slots, in the order they were added."""
        return list(self._slots)

    @property
    def worker_urls(self) -> list[str]:
        """The addresses of the servers that are up now."""
        return [s.url for s in self._slots if s.up and s.url]

    async def scale(self, servers: int) -> None:
        """Grow or shrink the fleet to ``servers`` servers.

        Growing starts the new servers and returns once each is healthy and registered.
        Shrinking drains the newest servers first: the router stops routing to them, their
        requests finish (at most ``drain_timeout`` seconds), then they stop.

        Raises:
            ValueError: ``servers`` is below 1.
            RayFleetError: a new server could not be placed or started (named).
        """
        if servers < 1:
            raise ValueError(f"servers: must be at least 1, got {servers}")
        if len(self._slots) < servers:
            placed = [await self._place() for _ in range(servers - len(self._slots))]
            for slot in placed:
                await slot.ready.wait()
            failed = [slot for slot in placed if slot.error is not None]
            for slot in failed:
                await self._remove(slot)
            if failed:
                raise RayFleetError("; ".join(str(slot.error) for slot in failed))
        while len(self._slots) > servers:
            await self._remove(self._slots[-1])

    async def wait_all_up(self, timeout: float) -> None:
        """Wait until every slot's server is up.

        Raises:
            RayFleetError: some are still down after ``timeout`` seconds (named).
        """
        with trio.move_on_after(timeout):
            while not all(s.up for s in self._slots):
                await trio.sleep(0.1)
            return
        down = [f"server {s.index}" for s in self._slots if not s.up]
        raise RayFleetError(f"not up within {timeout:g} s: {', '.join(down)}")

    # ------------------------------------------------------------------ slots

    async def _place(self) -> RayServer:
        """Place one new server (its placement group, its actor) and start its supervisor."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ._actors import ServerActor

        o = self._options
        index = self._next_index
        self._next_index += 1
        _check_resources(o.bundle, len(self._slots) + 1)
        pg = placement_group([o.bundle], strategy="STRICT_PACK")
        try:
            await _ray_get(pg.ready(), o.startup_timeout, what=f"the placement group of server {index}")
        except RayFleetError:
            ray.util.remove_placement_group(pg)
            raise RayFleetError(
                f"server {index}: no node has {_describe(o.bundle)} free within {o.startup_timeout:g} s "
                f"(available now: {_describe(ray.available_resources())})"
            ) from None
        remote_server: Any = ray.remote(ServerActor)
        actor = (
            remote_server
            .options(
                num_cpus=0,  # the bundle holds the resources; the actor runs inside it
                max_restarts=o.max_restarts,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            )
            .remote(index, o.kind, o.server_options, o.api_key, o.startup_timeout)
        )
        slot = RayServer(index, actor, pg)
        self._slots.append(slot)
        self._nursery.start_soon(self._supervise, slot)
        return slot

    async def _remove(self, slot: RayServer) -> None:
        """Drain one slot (router first), stop its server, and free its placement."""
        import ray

        self._slots.remove(slot)
        slot.scope.cancel()
        if slot.url is not None:
            await self._deregister(slot.url)
            await self._drain(slot)
        with trio.move_on_after(self._options.stop_timeout + 5):
            try:
                await _ray_get(slot.actor.stop.remote(self._options.stop_timeout), self._options.stop_timeout + 5)
            except RayFleetError as exc:  # a dead actor has nothing left to stop
                log.debug("server %d: stop: %s", slot.index, exc)
        ray.kill(slot.actor, no_restart=True)
        ray.util.remove_placement_group(slot.placement_group)
        slot.up = False

    async def _drain(self, slot: RayServer) -> None:
        """Wait (at most ``drain_timeout``) until the server reports nothing running."""
        assert slot.url is not None
        with trio.move_on_after(self._options.drain_timeout):
            while True:
                try:
                    stats = await self._get_json(slot.url + "/stats")
                except (httpx.HTTPError, ValueError):
                    return  # nothing to drain on a server that does not answer
                if not isinstance(stats, dict) or not stats.get("in_flight"):
                    return
                await trio.sleep(0.1)

    async def _supervise(self, slot: RayServer) -> None:
        """Keep one slot's server running and registered (see the module docstring)."""
        o = self._options
        with slot.scope:
            while True:
                try:
                    info = await _ray_get(
                        slot.actor.ensure_started.remote(), o.startup_timeout + 30, what=f"server {slot.index}"
                    )
                except RayFleetError as exc:
                    if not slot.ready.is_set():  # a first start that fails fails the caller
                        slot.error = exc
                        slot.ready.set()
                        return
                    log.warning("server %d: %s; trying again", slot.index, exc)
                    await trio.sleep(o.health_interval)
                    continue
                await self._adopt(slot, info)
                slot.ready.set()
                await self._watch(slot)

    async def _adopt(self, slot: RayServer, info: Mapping[str, Any]) -> None:
        if info["url"] != slot.url:
            if slot.url is not None:
                await self._deregister(slot.url)
            await self._register(info["url"])
        if slot.down_since is not None:
            healed = time.monotonic() - slot.down_since
            self.heal_times.append(healed)
            log.warning(
                "server %d: replaced by %s on node %s after %.1f s down", slot.index, info["url"], info["node_ip"], healed
            )
        slot.url, slot.node_ip, slot.node_id, slot.pid = info["url"], info["node_ip"], info["node_id"], info["pid"]
        slot.starts += 1
        slot.up, slot.down_since = True, None

    async def _watch(self, slot: RayServer) -> None:
        """Return once the slot's server is found dead (or its actor cannot answer)."""
        o = self._options
        while True:
            await trio.sleep(o.health_interval)
            try:
                running = await _ray_get(slot.actor.running.remote(), max(5.0, 5 * o.health_interval))
            except RayFleetError:
                running = False
            if not running:
                slot.up, slot.down_since = False, time.monotonic()
                log.warning("server %d at %s (node %s) is down; waiting for Ray to replace it", slot.index, slot.url, slot.node_ip)
                return

    # ------------------------------------------------------------------ the router

    async def _register(self, url: str) -> None:
        answer = await self._http.post(self.router_url + "/workers", json={"url": url})
        if answer.status_code >= 300:
            raise RayFleetError(f"the router refused {url}: HTTP {answer.status_code}: {answer.text[:200]}")
        await self._wait_listed(url)

    async def _wait_listed(self, url: str) -> None:
        """Wait until the router lists ``url`` healthy (its additions are asynchronous)."""
        with trio.move_on_after(self._options.startup_timeout):
            while True:
                listed = await self._listed()
                if listed.get(url, (None, False))[1]:
                    return
                await trio.sleep(0.1)
        raise RayFleetError(f"the router did not list {url} healthy within {self._options.startup_timeout:g} s")

    async def _get_json(self, url: str) -> Any:
        """The JSON of a 200 answer from ``url`` (None for another status), read bounded
        (:mod:`rollout_trio._bounded`): a server's answer is untrusted.

        Raises:
            httpx.HTTPError, ValueError: the request failed, or the answer is too large or
                not JSON.
        """
        async with self._http.stream("GET", url) as response:
            body = await aread_response(response, MAX_ANSWER_BYTES, what=f"GET {url}")
        return loads_json(body) if response.status_code == 200 else None

    async def _listed(self) -> dict[str, tuple[str | None, bool]]:
        """The router's workers: URL -> (id, healthy)."""
        try:
            body = await self._get_json(self.router_url + "/workers")
        except (httpx.HTTPError, ValueError):
            return {}
        out: dict[str, tuple[str | None, bool]] = {}
        for entry in body.get("workers", []) if isinstance(body, dict) else []:
            if isinstance(entry, dict) and isinstance(entry.get("url"), str):
                out[entry["url"]] = (entry.get("id"), bool(entry.get("is_healthy")))
        return out

    async def _deregister(self, url: str) -> None:
        worker_id = (await self._listed()).get(url, (None, False))[0]
        if worker_id is None:
            return
        try:
            await self._http.delete(f"{self.router_url}/workers/{worker_id}")
        except httpx.HTTPError as exc:
            log.warning("could not take %s out of the router: %s", url, exc)

    async def _close(self) -> None:
        """Stop every server, then the router; free every placement."""
        import ray

        async with trio.open_nursery() as nursery:
            for slot in list(self._slots):
                nursery.start_soon(self._stop_slot, slot)
        try:
            await _ray_get(self._router.stop.remote(self._options.stop_timeout), self._options.stop_timeout + 5)
        except RayFleetError as exc:
            log.debug("router: stop: %s", exc)
        ray.kill(self._router, no_restart=True)
        await self._http.aclose()

    async def _stop_slot(self, slot: RayServer) -> None:
        import ray

        slot.scope.cancel()
        try:
            await _ray_get(slot.actor.stop.remote(self._options.stop_timeout), self._options.stop_timeout + 5)
        except RayFleetError as exc:
            log.debug("server %d: stop: %s", slot.index, exc)
        ray.kill(slot.actor, no_restart=True)
        ray.util.remove_placement_group(slot.placement_group)
        self._slots.remove(slot)


async def _ray_get(ref: Any, timeout: float, what: str = "a Ray call") -> Any:
    """``ray.get(ref)`` off the loop, within ``timeout`` seconds.

    Raises:
        RayFleetError: the call timed out, its actor died, or it raised (a RayFleetError
            raised by the actor comes back as itself).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    def get() -> Any:
        return ray.get(ref, timeout=timeout)

    try:
        return await trio.to_thread.run_sync(get, abandon_on_cancel=True)
    except GetTimeoutError:
        raise RayFleetError(f"{what}: no answer within {timeout:g} s") from None
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RayFleetError):
            raise RayFleetError(str(cause)) from None
        raise RayFleetError(f"{what}: {cause or exc}") from exc
    except RayActorError as exc:
        raise RayFleetError(f"{what}: its actor died ({type(exc).__name__})") from exc


def _describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if not k.startswith("node:")) or "nothing"


def _check_resources(bundle: Mapping[str, float], servers: int) -> None:
    """Refuse at once what the cluster can never hold (waiting would never end).

    Raises:
        RayFleetError: naming each resource the cluster has too little of in total.
    """
    import ray

    total = ray.cluster_resources()
    short = [
        f"{need * servers:g} {key} ({servers} x {need:g}; the cluster has {total.get(key, 0):g})"
        for key, need in bundle.items()
        if need * servers > total.get(key, 0) + 1e-9
    ]
    if short:
        raise RayFleetError(f"the cluster is too small for {servers} servers: needs " + "; ".join(short))


@asynccontextmanager
async def open_ray_fleet(
    servers: int,
    *,
    server: str = "rollout-trio",
    server_options: Sequence[str] = (),
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    resources: Mapping[str, float] | None = None,
    router_options: Sequence[str] = (),
    api_key: str | None = None,
    address: str | None = None,
    max_restarts: int = -1,
    startup_timeout: float = 300.0,
    health_interval: float = 1.0,
    stop_timeout: float = 15.0,
    drain_timeout: float = 60.0,
    init: Callable[..., Any] | None = None,
) -> AsyncIterator[RayFleet]:
    """Start ``servers`` inference servers on a Ray cluster, with sglang-router in front.

    Args:
        servers: how many servers to start (at least 1); :meth:`RayFleet.scale` changes it.
        server: ``"rollout-trio"`` (``rollout-trio serve``), ``"sglang"``
            (``python -m sglang.launch_server``) or ``"vllm"`` (``vllm serve``).
        server_options: options for every server (``--model``, ``--device``, ...); the fleet
            sets ``--host``, ``--port`` and the key.
        num_cpus: CPUs reserved for each server (its placement-group bundle).
        num_gpus: GPUs reserved for each server.
        resources: custom Ray resources reserved for each server.
        router_options: extra options for sglang-router (``--policy``, ...).
        api_key: the key every server and the router require; None generates one. An empty
            string means none (only for a cluster nobody else can reach).
        address: the Ray cluster to join (``"auto"``, ``"ray://..."`` or ``host:port``) when
            Ray is not initialized yet; None starts or joins as ``ray.init()`` does.
        max_restarts: how often Ray restarts a server's actor (-1: without limit).
        startup_timeout: seconds for a placement, a server start or the router.
        health_interval: seconds between the driver's checks of each server.
        stop_timeout: seconds a stopping server may take after SIGTERM before SIGKILL.
        drain_timeout: seconds a removed server's requests may take to finish.
        init: what initializes Ray when it is not (default ``ray.init``).

    Returns:
        An async context manager yielding a :class:`RayFleet`; leaving it stops the router,
        every server and their processes, and frees every placement group.

    Raises:
        ValueError: an argument out of range (named).
        RayFleetError: the cluster lacks the resources asked for, a binary is missing on a
            node, or a server or the router did not start (named, with the node).
    """
    if servers < 1:
        raise ValueError(f"servers: must be at least 1, got {servers}")
    if server not in SERVER_KINDS:
        raise ValueError(f"server: must be one of {', '.join(SERVER_KINDS)}, got {server!r}")
    for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    for name, value in (("startup_timeout", startup_timeout), ("health_interval", health_interval)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    bundle = {k: float(v) for k, v in {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}.items() if v}
    if not bundle:
        raise ValueError("num_cpus, num_gpus, resources: a server must reserve something (Ray bundles cannot be empty)")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ._actors import RouterActor

    if not ray.is_initialized():
        await trio.to_thread.run_sync(lambda: (init or ray.init)(address=address, include_dashboard=False))
    key = secrets.token_urlsafe(24) if api_key is None else (api_key or None)
    options = _Options(
        server, list(server_options), bundle, max_restarts, startup_timeout, health_interval, stop_timeout,
        drain_timeout, key,
    )
    _check_resources(bundle, servers)
    here = ray.get_runtime_context().get_node_id()
    remote_router: Any = ray.remote(RouterActor)  # Ray's stubs type actor classes loosely
    router = (
        remote_router
        .options(num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
        .remote(list(router_options), key, startup_timeout)
    )
    try:
        info = await _ray_get(router.ensure_started.remote([]), startup_timeout + 30, what="the router")
    except BaseException:
        ray.kill(router, no_restart=True)
        raise
    error: BaseException | None = None  # the start's or the body's, raised bare (not in a group)
    async with trio.open_nursery() as nursery:
        fleet = RayFleet(options, nursery, router, info)
        try:
            await fleet.scale(servers)
            yield fleet
        except BaseException as exc:
            error = exc
        finally:
            with trio.CancelScope(shield=True):
                await fleet._close()
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error
