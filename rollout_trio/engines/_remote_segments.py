"""``RemoteEngine``'s request segments: the interrupt/resume loop of one ``agenerate``.

Note the fleet's version, send a segment (routed, retried elsewhere on failure), check its
versions against :mod:`._version_policy`, append what came back, shrink the budget, wait
while paused, send again. A cancelled segment sends the server's abort for its id in a
shielded, time-bounded scope. An answer whose versions disagree with the fleet is dropped:
the engine takes its server out (see :class:`~rollout_trio.engines._remote_service.Service`)
and the segment goes to another server.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

from .._errors import (
    EngineConnectError,
    EngineError,
    EngineProtocolError,
    EngineServerError,
    ServerUnavailableError,
    UnsupportedRequestError,
    VersionLabelError,
)
from .._images import encode_image_base64
from .._io import ModelRequest, ModelResponse
from ..workflow_context import request_seed
from ._remote_fleet import Membership, Shared
from ._remote_http import is_retriable, retrying
from ._remote_wire import HttpCall, Segment, segment_seed
from ._routing import Server
from ._version_policy import VersionPolicy

__all__ = ["Segments"]

log = logging.getLogger("rollout_trio.remote")

_FINAL = ("stop", "length", "tool_calls")

#: ``audit()``: read every worker's version, follow a quorum, bar the servers off it.
Audit = Callable[[], Awaitable[None]]
#: ``bar(server, why)``: take a server whose answer disagreed out of service.
Bar = Callable[[Server, str], Awaitable[None]]


class Segments:
    """Runs ``agenerate`` for the engine (see the module docstring)."""

    def __init__(
        self, shared: Shared, members: Membership, policy: VersionPolicy, *, audit: Audit, bar: Bar,
        max_empty_aborts: int,
    ) -> None:
        self.shared = shared
        self.members = members
        self.policy = policy
        self.audit = audit
        self.bar = bar
        self.max_empty_aborts = max_empty_aborts

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """See :meth:`RemoteEngine.agenerate`."""
        shared = self.shared
        shared.session()  # raises outside 'async with'
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
        if shared.backend_name == "vllm" and (g.top_k_active or g.top_p < 1.0):
            shared.warn_once(
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
        restarts = bool(req.image_data) and shared.backend_name == "vllm"
        while stop not in _FINAL and len(tokens) < budget:
            remaining = budget - len(tokens)
            min_new = min(remaining, max(0, g.min_new_tokens - len(tokens)))
            seg_seed = None if seed is None else segment_seed(seed, len(tokens))
            seg, seg_versions = await self._segment(req, prompt + tokens, remaining, min_new, seg_seed)
            if len(seg.tokens) > remaining:
                raise EngineProtocolError(
                    f"{shared.backend_name}: a segment returned {len(seg.tokens)} tokens for a budget of {remaining}"
                )
            if restarts and seg.stop_reason == "abort":
                # A chat call (vLLM images) cannot continue a partial answer: generate it
                # again from the start rather than append a second answer to the first.
                seg = type(seg)(tokens=[], logprobs=[], stop_reason="abort", message=seg.message)
                seg_versions = []
            tokens += seg.tokens
            logprobs += seg.logprobs
            versions += seg_versions
            stop = seg.stop_reason
            if seg.tokens and ttft is None:
                ttft = trio.current_time() - start
            if stop == "abort" and not seg.tokens:
                if shared.paused:
                    continue
                empty_aborts += 1
                if empty_aborts > self.max_empty_aborts:
                    raise EngineServerError(
                        f"{shared.backend_name}: {empty_aborts} consecutive segments aborted with no output "
                        f"while this engine was not paused (last message: {seg.message!r})"
                    )
                await trio.sleep(shared.retry.delay(min(empty_aborts, 6), shared.rng))
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

    def _reported(self, seg: Segment) -> list[int] | None:
        """The versions ``seg``'s server reports for its tokens (None: it reports none)."""
        if not seg.tokens:
            return []
        if seg.versions is not None:
            return list(seg.versions)
        if seg.server_version is not None and self.policy.verify:
            return [seg.server_version] * len(seg.tokens)
        return None

    def _judge(self, seg: Segment, floor: int | None) -> str | None:
        reported = self._reported(seg)
        if reported is None or not self.policy.verify:
            return None
        return self.policy.judge(reported, floor)

    def _ahead(self, seg: Segment) -> bool:
        reported = self._reported(seg)
        fleet = self.policy.fleet
        return bool(reported) and fleet is not None and reported[-1] > fleet  # type: ignore[index]

    def _versions(self, seg: Segment, label: int) -> list[int]:
        """One version per token: what the server reports (checked), else ``label``."""
        reported = self._reported(seg)
        return reported if reported is not None else [label] * len(seg.tokens)

    async def _segment(
        self, req: ModelRequest, ids: list[int], max_new: int, min_new: int, seed: int | None
    ) -> tuple[Segment, list[int]]:
        """One segment and its tokens' versions, with routing and retries.

        Each try waits while the engine is paused, notes the versions, and sends under a
        fresh server-side id; a failed try is aborted on its server.
        """
        shared, members = self.shared, self.members
        tried: set[Server] = set()
        # Images go as base64 PNG, encoded once per image object (a group's slots share theirs).
        images = [encode_image_base64(img) for img in req.image_data] if req.image_data else None

        async def attempt(_k: int) -> tuple[Segment, list[int]]:
            while shared.paused:
                await shared.gate.wait()
            label, floor = self.policy.label, self.policy.fleet
            server = members.router.choose(req.rid, tried)
            server.backend.check(req.gconfig)
            srid = f"{req.rid}-{next(shared.ids)}"
            extra = {"messages": req.vision_msg_vllm} if images and server.backend.name == "vllm" else {}
            call = server.backend.generate(
                ids, req.gconfig, max_new=max_new, min_new=min_new, rid=srid, seed=seed, image_data=images, **extra
            )
            try:
                with members.router.track(server):
                    body = await self._send_generate(server, call, srid)
            except EngineConnectError as exc:
                # Refused: the server is away. A read that broke mid-answer may be the
                # connection's fault alone: the server is marked down only if its health
                # check fails too (the attempt is retried elsewhere either way).
                if isinstance(exc.__cause__, httpx.ConnectError) or await members.probe(server) is not None:
                    members.router.mark_down(server)
                tried.add(server)
                raise
            except EngineError as exc:
                if is_retriable(exc):
                    tried.add(server)
                raise
            routed = server is members.gateway  # a router does not say which worker answered
            try:
                seg = server.backend.parse(body)
            except VersionLabelError as exc:
                await (self.audit() if routed else self.bar(server, str(exc)))
                raise self._dropped(server, str(exc), tried) from exc
            if seg.prompt_tokens is not None and seg.prompt_tokens != ids:
                raise EngineProtocolError(_prompt_mismatch(server.base_url, ids, seg.prompt_tokens))
            why = self._judge(seg, floor)
            if why is not None:
                if routed or self._ahead(seg):
                    await self.audit()  # the fleet may follow a quorum: then the answer stands
                    why = self._judge(seg, floor)
                if why is not None:
                    if not routed:
                        await self.bar(server, why)
                    raise self._dropped(server, why, tried)
                if not routed and not server.up:
                    raise self._dropped(server, "taken out by the version check", tried)
            return seg, self._versions(seg, label)

        def on_retry(k: int, exc: EngineError) -> None:
            log.warning("generation attempt %d for rid %s failed, retrying: %s", k + 1, req.rid, exc)

        return await retrying(attempt, policy=shared.retry, rng=shared.rng, on_retry=on_retry)

    def _dropped(self, server: Server, why: str, tried: set[Server]) -> ServerUnavailableError:
        """The (retriable) error for an answer dropped because its versions disagree."""
        if server is not self.members.gateway:
            tried.add(server)
        return ServerUnavailableError(
            f"{server.base_url}: answer dropped, its weight versions disagree with the fleet's: {why}",
            server=server.base_url,
        )

    async def _send_generate(self, server: Server, call: HttpCall, srid: str) -> Any:
        shared = self.shared
        try:
            return await shared.session().call(server.base_url, call, timeout=shared.request_timeout, direct=True)
        except EngineServerError:
            raise  # the server answered: nothing runs for this id
        except BaseException as exc:
            cause = exc.__cause__
            if isinstance(cause, httpx.ConnectError):
                raise  # never reached the server
            with trio.CancelScope(shield=True), trio.move_on_after(shared.abort_grace) as grace:
                await self._abort(server, srid)
            if grace.cancelled_caught:
                log.warning(
                    "abort of %s on %s got no answer within abort_grace=%ss: the server may still be generating it",
                    srid, server.base_url, shared.abort_grace,
                )
            raise

    async def _abort(self, server: Server, srid: str) -> None:
        """Abort ``srid`` where it runs: on ``server``, or (through a router, which does not
        forward aborts) on every worker in service."""
        if server is not self.members.gateway:
            await self._abort_on(server, srid)
            return
        async with trio.open_nursery() as nursery:
            for worker in self.members.workers:
                if worker.up:
                    nursery.start_soon(self._abort_on, worker, srid)

    async def _abort_on(self, server: Server, srid: str) -> None:
        call = server.backend.abort(srid)
        if call is None:
            return  # the connection was closed by the cancellation: that aborts it
        try:
            await self.shared.session().call(
                server.base_url, call, timeout=self.shared.abort_grace, expect_json=False, direct=True
            )
        except EngineError as exc:
            log.warning("abort of %s on %s failed: %s", srid, server.base_url, exc)


def _prompt_mismatch(where: str, sent: list[int], got: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
    return (
        f"{where}: the server tokenized the chat messages into {len(got)} prompt tokens that differ from the "
        f"request's {len(sent)} input_ids from position {at} (its chat template or processor is not the "
        "workflow's); the answer's tokens would not follow the prompt the trainer sees"
    )
