"""``RemoteEngine``'s service rules: who is in service, at which version, and how a server
comes back.

* **At start** every worker's version is read; the one they agree on (or a strict majority
  holds) is the fleet's, and a server holding another is taken out.
* **A disagreeing answer** (see :mod:`._version_policy`) bars its server (direct mode), or
  (through a router, which does not say which worker answered, and when an answer is newer
  than the fleet) starts an *audit*: every worker in service is read over the control
  plane; a newer version a quorum holds is followed, and every server holding another is
  barred (and taken out of the router).
* **Every** ``health_interval`` the router's list is refreshed, every worker probed, and a
  healthy server out of service brought back: reloaded from the last checkpoint when this
  engine published one, or given back its weights by the trainer's ``restore`` callback,
  or (an engine that never published) taken back as it is only at the fleet's version;
  then paused or resumed as the engine is, and only then marked up.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from .._errors import EngineError, VersionLabelError, VersionMismatchError
from ._remote_fleet import Membership, Shared, listing
from ._routing import Server
from ._version_policy import VersionPolicy
from ._vllm import VLLMBackend

__all__ = ["Restore", "Service"]

log = logging.getLogger("rollout_trio.remote")

#: ``restore(base_url, version)``: load the weights of ``version`` into that server (the
#: trainer pushes them), returning once they are loaded.
Restore = Callable[[str, int], Awaitable[None]]


class Service:
    """Setup, health rounds, audits and bringing servers back (see the module docstring)."""

    def __init__(
        self, shared: Shared, members: Membership, policy: VersionPolicy, *, restore: Restore | None
    ) -> None:
        self.shared = shared
        self.members = members
        self.policy = policy
        self.restore = restore
        #: The checkpoint the fleet was last updated from: what a returning server reloads.
        self.checkpoint: str | None = None
        self._auditing: trio.Event | None = None

    # ------------------------------------------------------------------ start

    async def setup_servers(self) -> None:
        """Read every worker's version, adopt the fleet's, take out those holding another.

        Raises:
            VersionMismatchError: no version is held by a strict majority, or no server
                is left in service.
            EngineError: a worker failed its setup (the first; the others in a note).
        """
        members = self.members
        reported: dict[Server, int | None | VersionLabelError] = {}
        errors: dict[Server, EngineError] = {}

        async def one(server: Server) -> None:
            try:
                reported[server] = await self._setup_server(server)
            except VersionLabelError as exc:
                reported[server] = exc
            except EngineError as exc:  # one typed error out of __aenter__, never a group
                errors[server] = exc

        async with trio.open_nursery() as nursery:
            for server in members.workers:
                nursery.start_soon(one, server)
        if errors:
            first = next(iter(errors.values()))
            if len(errors) > 1:
                first.add_note(f"setup also failed on: {listing(dict(list(errors.items())[1:]))}")
            raise first
        bad: dict[Server, EngineError] = {s: v for s, v in reported.items() if isinstance(v, VersionLabelError)}
        good = {s: v for s, v in reported.items() if not isinstance(v, VersionLabelError)}
        for server, version in good.items():
            server.version = version
        outliers = self.policy.agree({s.base_url: v for s, v in good.items()}, where="RemoteEngine")
        for server in good:
            if server.base_url in outliers:
                bad[server] = VersionMismatchError(
                    f"{server.base_url} holds weight version {server.version}, the other servers {self.policy.fleet}"
                )
        await members.bar("setup", bad)
        if members.workers and not members.in_service():
            raise VersionMismatchError(
                "RemoteEngine: no server holds a weight version this engine accepts: " + listing(bad)
            )
        first_worker = members.workers[0] if members.workers else None
        if members.gateway is not None and first_worker is not None and isinstance(first_worker.backend, VLLMBackend):
            members.gateway.backend = VLLMBackend(first_worker.backend.api)

    async def _setup_server(self, server: Server) -> int | None:
        shared = self.shared
        if shared.backend_name == "vllm" and shared.vllm_api == "auto":
            server.backend = VLLMBackend(await self.members.probe_vllm_api(server))
        if isinstance(server.backend, VLLMBackend) and not server.backend.can_abort:
            shared.warn_once(
                "degraded-abort",
                "vLLM /v1/completions has no abort endpoint: aborts close the connection "
                "(start the server with --enable-scale-out for /inference/v1/* and real aborts)",
            )
        return await self.members.read_version(server)

    # ------------------------------------------------------------------ audits

    async def audit(self) -> None:
        """Read every worker in service; follow a newer version a quorum holds; bar every
        server holding another. Concurrent callers wait for the audit under way."""
        if self._auditing is not None:
            await self._auditing.wait()
            return
        self._auditing = done = trio.Event()
        try:
            async with self.shared.update_lock:  # never half-way through an update
                await self._audit()
        finally:
            self._auditing = None
            done.set()

    async def _audit(self) -> None:
        members, policy = self.members, self.policy
        read = await members.read_versions(members.in_service())
        versions = {s.base_url: (v if not isinstance(v, EngineError) else None) for s, v in read.items()}
        follow = policy.quorum(versions)
        if follow is not None:
            held = sum(1 for v in versions.values() if v == follow)
            log.warning(
                "following weight version %d: %d of the %d servers in service hold it (published elsewhere)",
                follow,
                held,
                len(versions),
            )
            policy.follow(follow)
        wrong: dict[Server, EngineError] = {}
        for server, value in read.items():
            if isinstance(value, VersionLabelError):
                wrong[server] = value
            elif isinstance(value, int) and policy.fleet is not None and value != policy.fleet:
                wrong[server] = VersionMismatchError(
                    f"{server.base_url} holds weight version {value}, the fleet {policy.fleet}"
                )
            elif isinstance(value, int):
                server.version = value
        await members.bar("version check", wrong)

    async def bar(self, server: Server, why: str) -> None:
        """Take ``server`` out for an answer that disagrees on the version."""
        await self.members.bar("a generation", {server: VersionMismatchError(f"{server.base_url}: {why}")})

    async def reread_versions(self, failed: BaseException) -> None:
        """After an interrupted reload, learn where the servers stand (shielded, bounded);
        servers off the majority's version are taken out. Problems go in a note on ``failed``."""
        members = self.members
        servers = members.in_service()
        read: dict[Server, int | None | EngineError] = {}
        with trio.CancelScope(shield=True), trio.move_on_after(self.shared.control_timeout) as scope:
            read = await members.read_versions(servers)
        unreadable = [s for s in servers if isinstance(read.get(s, EngineError()), EngineError)]
        if scope.cancelled_caught or unreadable:
            for server in unreadable:
                log.warning("could not read %s's version after an interrupted update: %s", server.base_url, read.get(server))
            failed.add_note("RemoteEngine.update_weights: interrupted; some servers' versions could not be read back")
            # Unknown: those servers must prove their version before they serve again.
            members.take_out("update_weights", {s: VersionMismatchError("version unknown after an interrupted update") for s in unreadable})
            return
        known: dict[str, int | None] = {}
        for server in servers:
            value = read[server]
            assert not isinstance(value, EngineError)
            server.version = value
            known[server.base_url] = value
        try:
            outliers = self.policy.agree(known, where="RemoteEngine.update_weights")
        except VersionMismatchError as exc:
            log.error("%s", exc)
            failed.add_note(f"RemoteEngine.update_weights: interrupted mid-reload: {exc}")
            return
        off = {s: VersionMismatchError(f"{s.base_url} holds weight version {s.version}") for s in servers if s.base_url in outliers}
        members.take_out("update_weights", off)

    # ------------------------------------------------------------------ health rounds

    async def health_loop(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            await self.check_fleet()

    async def check_fleet(self) -> None:
        """See :meth:`RemoteEngine.check_fleet`."""
        members = self.members
        if members.gateway is not None:
            await self._health_check(members.gateway)
            try:
                await members.refresh_workers()
            except EngineError as exc:
                log.warning("could not refresh the worker list of router %s: %s", members.gateway.base_url, exc)
        async with trio.open_nursery() as nursery:
            for server in list(members.workers):
                nursery.start_soon(self._health_check, server)

    async def _health_check(self, server: Server) -> None:
        members = self.members
        error: EngineError | None
        try:
            error = await members.probe(server)
        except Exception:  # never let a probe bug take the engine down
            log.exception("health probe of %s failed", server.base_url)
            error = EngineError("the probe itself failed")
        if error is None and not server.up:
            if server is members.gateway:
                log.info("router %s is healthy again", server.base_url)
                members.router.mark_up(server)
            else:
                await self.bring_in(server)
        elif error is not None and server.up:
            log.warning("%s failed its health check; marked down: %s", server.base_url, error)
            members.router.mark_down(server)
        elif error is not None:
            log.debug("%s is still down: %s", server.base_url, error)

    async def bring_in(self, server: Server) -> None:
        """Bring a healthy server that is out of service to the fleet's weights and pause
        state, then mark it up; on failure it stays out (logged, retried next round)."""
        shared, members, policy = self.shared, self.members, self.policy
        async with shared.update_lock:  # never half-way through an update of the others
            if server.up or server.left:  # an O(1) test: 'not in members.workers' scanned the list
                return
            quarantined = server.base_url in members.quarantined  # barred: out of the router already
            try:
                with trio.fail_after(shared.control_timeout * 3):
                    if shared.backend_name == "vllm" and shared.vllm_api == "auto":
                        server.backend = VLLMBackend(await members.probe_vllm_api(server))
                    try:
                        held = await members.read_version(server)
                    except VersionLabelError as exc:
                        log.warning("%s", exc)
                        held = None
                    target = policy.fleet
                    how = policy.admission(
                        held,
                        checkpoint=self.checkpoint is not None,
                        can_reload=shared.can_reload(server),
                        can_restore=self.restore is not None,
                    )
                    if how == "keep_out":
                        raise VersionMismatchError(self._why_out(server, held))
                    if how != "admit":
                        assert target is not None
                        quarantined = await members.quarantine(server) or quarantined
                    if how == "reload":
                        assert self.checkpoint is not None
                        log.info("reloading %s on %s (it reports version %s)", self.checkpoint, server.base_url, held)
                        await members.send(server, shared.update_calls(server, self.checkpoint, target))  # type: ignore[arg-type]
                    elif how == "restore":
                        assert self.restore is not None and target is not None
                        log.info("asking the trainer to load version %d into %s", target, server.base_url)
                        await self.restore(server.base_url, target)
                        await members.send(server, server.backend.label(target))
                    server.version = target if target is not None else held
                    while True:  # a pause or resume may land meanwhile: apply the last one
                        paused = shared.paused
                        await members.send(server, server.backend.pause() if paused else server.backend.resume())
                        if shared.paused == paused:
                            break
                    if quarantined:
                        await members.release(server)
            except Exception as exc:  # noqa: BLE001 - a restore callback's failure too: it stays out, retried next round
                log.warning("%s is healthy but could not be brought back into service: %s", server.base_url, exc)
                server.error = exc if isinstance(exc, EngineError) else server.error
                return
            server.error = None
            members.router.mark_up(server)
            log.info("%s is back in service at weight version %s", server.base_url, server.version)

    def _why_out(self, server: Server, held: int | None) -> str:
        target = self.policy.fleet
        if self.checkpoint is not None:
            return (
                f"{server.base_url} must be given the weights of version {target} before it serves, and this "
                "engine cannot load them itself (a vLLM server with vllm_reload_path=None): pass "
                "RemoteEngine(restore=...) to push them, or call update_weights"
            )
        return (
            f"{server.base_url} holds weight version {held}, the fleet {target}, and this engine has no checkpoint "
            "to reload it from (update_weights was not called here): it stays out until it holds version "
            f"{target} (or pass RemoteEngine(restore=...))"
        )
