"""``RemoteEngine``: the InferenceEngine over HTTP to SGLang or vLLM servers.

One ``httpx.AsyncClient`` lives as long as the engine (``async with``). Each
``agenerate`` runs the interrupt/resume loop: pin the weight version, send a segment,
append what came back, shrink the budget, wait while paused, send again. A cancelled
request sends the server's abort for its id in a shielded, time-bounded scope, so a
cancelled group leaves no generation running on any server.
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
    UnsupportedRequestError,
    VersionMismatchError,
)
from .._io import ModelRequest, ModelResponse
from ._protocol import WeightsSource
from ._remote_http import HttpSession, RetryPolicy, is_retriable, retrying
from ._remote_wire import HttpCall, Segment, parse_version
from ._routing import Router, Server, normalize_address
from ._sglang import SGLangBackend
from ._transport import TrioTransport
from ._vllm import TITO_PATH, VLLMBackend

__all__ = ["RemoteEngine"]

log = logging.getLogger("rollout_trio.remote")

_FINAL = ("stop", "length", "tool_calls")


class RemoteEngine:
    """An :class:`~rollout_trio.engines.InferenceEngine` backed by inference servers.

    Args:
        addresses: ``host:port`` strings or base URLs (one or many; a comma-separated
            string is split).
        backend: ``"sglang"`` or ``"vllm"``.
        routing: ``"round_robin"`` or ``"least_in_flight"``.
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
        health_interval: seconds between health probes of every server.
        max_empty_aborts: consecutive empty ``abort`` answers tolerated (with backoff)
            while this engine is not paused, before ``EngineServerError``.
        vllm_api: ``"auto"`` (probe ``/inference/v1/generate``, fall back to
            ``/v1/completions`` on 403/404), ``"tito"`` or ``"completions"``.
        vllm_reload_path: the endpoint a vLLM server reloads weights from disk with
            (stock vLLM has none; AReaL's wrapper has ``/areal_update_weights``), or None
            to only relabel the version.
        verify_versions: raise :class:`VersionMismatchError` when a server reports a
            weight version other than the one pinned for the segment.
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
        addresses: str | Sequence[str],
        backend: Literal["sglang", "vllm"] = "sglang",
        *,
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
        servers = [Server(normalize_address(a), self._make_backend(backend, vllm_api)) for a in addresses]
        self._router = Router(servers, strategy=routing, affinity_size=affinity_size, rng=self._rng)
        self._vllm_api = vllm_api
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
        self._adopt_pending = False  # no server reported a version at start: take the first one seen
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

    @staticmethod
    def _make_backend(backend: str, vllm_api: str) -> Any:
        if backend == "sglang":
            return SGLangBackend()
        return VLLMBackend("completions" if vllm_api == "completions" else "tito")

    # ------------------------------------------------------------------ lifetime

    @property
    def servers(self) -> list[Server]:
        """The servers, with their up/down marks and in-flight counts."""
        return list(self._router.servers)

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
                await self._wait_healthy(last)
            down = [s for s in self._router.servers if not s.up]
            if down:
                raise EngineConnectError(
                    f"RemoteEngine: no healthy answer within setup_timeout={self._setup_timeout} s from "
                    + "; ".join(f"{s.base_url} (last error: {last.get(s, 'none')})" for s in down)
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

    async def _wait_healthy(self, last: dict[Server, EngineError]) -> None:
        """Probe until every server is healthy; a server refusing connections past
        ``connect_deadline`` is an :class:`EngineConnectError` naming it."""
        for server in self._router.servers:
            server.up = False
        pending = set(self._router.servers)
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

    async def _setup_servers(self) -> None:
        reported: dict[str, int | None] = {}
        async with trio.open_nursery() as nursery:
            for server in self._router.servers:
                nursery.start_soon(self._setup_server, server, reported)
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
        else:
            self._adopt_pending = self._verify  # take the version of the first reported tokens

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
            async with trio.open_nursery() as nursery:
                for server in self._router.servers:
                    nursery.start_soon(self._health_check, server)

    async def _health_check(self, server: Server) -> None:
        error: EngineError | None
        try:
            error = await self._probe(server)
        except Exception:  # never let a probe bug take the engine down
            log.exception("health probe of %s failed", server.base_url)
            error = EngineError("the probe itself failed")
        if error is None and not server.up:
            log.info("%s is healthy again", server.base_url)
            self._router.mark_up(server)
        elif error is not None and server.up:
            log.warning("%s failed its health check; marked down: %s", server.base_url, error)
            self._router.mark_down(server)
        elif error is not None:
            log.debug("%s is still down: %s", server.base_url, error)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # ------------------------------------------------------------------ versions and pause

    def get_version(self) -> int:
        """The weight version pinned on segments sent from now on."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the client-side weight version (servers are told by :meth:`update_weights`)."""
        self._version = int(version)

    @property
    def paused(self) -> bool:
        """Whether new segments are held."""
        return self._paused

    async def pause(self) -> None:
        """Hold new segments, then pause every server in abort mode.

        In-flight segments come back with ``abort`` and their partial output; their loops
        wait until :meth:`resume` and then send the rest.
        """
        if not self._paused:
            self._paused = True
            self._gate = trio.Event()
        await self._fan_out(lambda s: s.backend.pause())

    async def resume(self) -> None:
        """Continue generation on every server, then release held segments."""
        await self._fan_out(lambda s: s.backend.resume())
        self._paused = False
        self._gate.set()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Reload every server's weights from the checkpoint directory ``source``.

        Serialized (one update at a time). Pauses (unless already paused), sends the reload
        with ``str(version)`` as the servers' weight version, sets this engine's version,
        and resumes if it paused. The resume runs whatever happened, cancellation
        included (shielded, within ``control_timeout``); a server it cannot resume is
        named in the error (or, when another exception is already propagating, in a note
        on it and the log).
        """
        if isinstance(source, Mapping):
            raise UnsupportedRequestError(
                "RemoteEngine.update_weights: source must be a checkpoint directory the servers can read, "
                "not a state dict"
            )
        path = fspath(source) if isinstance(source, PathLike) else str(source)
        async with self._update_lock:
            was_paused = self._paused
            failed: BaseException | None = None
            reload_sent = False
            try:
                if not was_paused:
                    await self.pause()
                reload_sent = True
                await self._fan_out(lambda s: self._update_calls(s, path, int(version)))
                self.set_version(int(version))
            except BaseException as exc:
                failed = exc
                if reload_sent:
                    # A server may have applied the reload though its answer never came back:
                    # learn where the servers stand before anything generates again.
                    await self._reread_versions(exc)
                raise
            finally:
                if not was_paused:
                    await self._resume_after_update(failed)

    async def _reread_versions(self, failed: BaseException) -> None:
        """After an interrupted reload, adopt the servers' versions (shielded, bounded).

        When they disagree, or cannot be read, the interrupted error says so in a note.
        """
        reported: dict[str, int | None] = {}
        with trio.CancelScope(shield=True), trio.move_on_after(self._control_timeout) as scope:

            async def one(server: Server) -> None:
                try:
                    reported[server.base_url] = await self._read_version(server)
                except EngineError as exc:
                    log.warning("could not read %s's version after an interrupted update: %s", server.base_url, exc)

            async with trio.open_nursery() as nursery:
                for server in self._router.servers:
                    nursery.start_soon(one, server)
        if scope.cancelled_caught or len(reported) < len(self._router.servers):
            self._adopt_pending = self._verify  # unknown: take the version of the first reported tokens
            failed.add_note("RemoteEngine.update_weights: interrupted; some servers' versions could not be read back")
            return
        try:
            self._adopt_versions(reported)
        except VersionMismatchError as exc:
            log.error("%s", exc)
            failed.add_note(f"RemoteEngine.update_weights: interrupted mid-reload: {exc}")

    async def _resume_after_update(self, failed: BaseException | None) -> None:
        """Resume every server and this engine, even when cancelled; name the servers left paused."""
        left: dict[str, BaseException] = {}
        with trio.CancelScope(shield=True):
            session = self._session()

            async def one(server: Server) -> None:
                try:
                    with trio.fail_after(self._control_timeout):
                        for call in server.backend.resume():
                            await session.call(server.base_url, call, timeout=self._control_timeout, expect_json=False)
                except (EngineError, trio.TooSlowError) as exc:
                    left[server.base_url] = exc

            async with trio.open_nursery() as nursery:
                for server in self._router.servers:
                    nursery.start_soon(one, server)
        self._paused = False
        self._gate.set()
        if not left:
            return
        message = "RemoteEngine.update_weights: could not resume " + ", ".join(
            f"{url} ({type(exc).__name__}: {exc})" for url, exc in sorted(left.items())
        ) + "; those servers are left paused (call resume() to retry)"
        if failed is not None:
            log.error("%s", message)
            failed.add_note(message)
            return
        raise EngineServerError(message, status_code=0)

    async def update_weights_from_disk(self, path: str | PathLike[str], version: int) -> None:
        """The same as :meth:`update_weights` with a path."""
        await self.update_weights(path, version)

    def _update_calls(self, server: Server, path: str, version: int) -> list[HttpCall]:
        """The calls that reload ``server`` and label it ``version``."""
        if isinstance(server.backend, VLLMBackend):
            return server.backend.update_from_disk(path, version, self._vllm_reload_path)
        return server.backend.update_from_disk(path, version)

    async def _fan_out(self, calls_for: Callable[[Server], list[HttpCall]]) -> None:
        """Send each server its calls (in order, with retries), all servers at once."""
        session = self._session()

        async def one(server: Server) -> None:
            for call in calls_for(server):

                async def attempt(_k: int, call: HttpCall = call) -> Any:
                    return await session.call(server.base_url, call, timeout=self._control_timeout, expect_json=False)

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

        async with trio.open_nursery() as nursery:
            for server in self._router.servers:
                nursery.start_soon(one, server)

    # ------------------------------------------------------------------ generation

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req``, resuming across pauses.

        Raises:
            UnsupportedRequestError: ``n_samples != 1``, no token budget, or a setting the
                backend refuses.
            EngineError: the servers failed (after retries) or answered malformed bodies.
            VersionMismatchError: a server reported a version other than the pinned one.
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
            seg, version = await self._segment(req, prompt + tokens, remaining, min_new)
            if len(seg.tokens) > remaining:
                raise EngineProtocolError(
                    f"{self.backend_name}: a segment returned {len(seg.tokens)} tokens for a budget of {remaining}"
                )
            seg_versions = self._versions_for(seg, version)
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
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop,  # type: ignore[arg-type]
            latency=latency,
            ttft=ttft if ttft is not None else latency,
            tokenizer=req.tokenizer,
        )

    def _versions_for(self, seg: Segment, pinned: int) -> list[int]:
        if self._adopt_pending and seg.tokens and (seg.versions or seg.server_version is not None):
            self._adopt_pending = False
            pinned = self._version = seg.versions[0] if seg.versions else int(seg.server_version or 0)
            log.info("adopting weight version %d from the first reported tokens", pinned)
        if seg.versions is not None:
            if self._verify:
                bad = sorted({v for v in seg.versions if v != pinned})
                if bad:
                    raise VersionMismatchError(
                        f"{self.backend_name}: the server reports weight versions {bad} for tokens of a segment "
                        f"pinned to version {pinned}"
                    )
            return list(seg.versions)
        if self._verify and seg.server_version is not None and seg.server_version != pinned and seg.tokens:
            raise VersionMismatchError(
                f"{self.backend_name}: the server reports weight version {seg.server_version} for a segment "
                f"pinned to version {pinned}"
            )
        return [pinned] * len(seg.tokens)

    async def _segment(self, req: ModelRequest, ids: list[int], max_new: int, min_new: int) -> tuple[Segment, int]:
        """One segment and the version pinned for it, with routing and retries.

        Each try waits while the engine is paused, pins the version, and sends under a
        fresh server-side id; a failed try is aborted on its server.
        """
        tried: set[Server] = set()

        async def attempt(_k: int) -> tuple[Segment, int]:
            while self._paused:
                await self._gate.wait()
            version = self._version
            server = self._router.choose(req.rid, tried)
            server.backend.check(req.gconfig)
            srid = f"{req.rid}-{next(self._ids)}"
            call = server.backend.generate(ids, req.gconfig, max_new=max_new, min_new=min_new, rid=srid)
            try:
                with self._router.track(server):
                    body = await self._send_generate(server, call, srid)
            except EngineConnectError:
                self._router.mark_down(server)
                tried.add(server)
                raise
            except EngineError as exc:
                if is_retriable(exc):
                    tried.add(server)
                raise
            return server.backend.parse(body), version

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
        call = server.backend.abort(srid)
        if call is None:
            return  # the connection was closed by the cancellation: that aborts it
        try:
            await self._session().call(server.base_url, call, timeout=self._abort_grace, expect_json=False)
        except EngineError as exc:
            log.warning("abort of %s on %s failed: %s", srid, server.base_url, exc)


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
