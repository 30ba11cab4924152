"""SGLang's native HTTP protocol in front of any :class:`InferenceEngine`.

Endpoints: ``/generate``, ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``, ``/update_weight_version``,
``/get_weight_version``, ``/health``, ``/get_model_info``, ``/get_server_info`` and
``/stats`` (counters for tests and operators).

Generation runs in chunks of ``segment_tokens`` tokens (one ``agenerate`` call each, the
prompt growing by what was generated), so that a pause in ``abort`` mode, an abort or a
weight update can end a request at a chunk boundary *with its partial output*, as SGLang
does. Pause modes: ``abort`` ends in-flight requests with ``finish_reason`` ``abort`` and
their partial tokens, and ends requests that arrive while paused at once ("Abort before
prefill"); ``retract`` and ``in_place`` hold requests until ``/continue_generation``.

Request bodies are structured and validated by :mod:`._schema` (HTTP 400 names the field
and the rule); :mod:`._asgi` puts these routes behind an ASGI app with limits and auth.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from .._config import GenerationConfig
from .._errors import EngineError, UnsupportedRequestError, WorkflowContractError
from .._images import DEFAULT_MAX_IMAGE_PIXELS, decode_images
from .._io import ModelRequest
from ..engines._protocol import InferenceEngine
from ..engines._version_policy import parse_version_label
from ._schema import (
    AbortBody,
    BadRequest,
    GenerateBody,
    PauseBody,
    UpdateFromDiskBody,
    UpdateVersionBody,
    parse_body,
)

__all__ = ["EngineFailure", "Reply", "SGLangApp"]

_HISTORY = 4096  # rids remembered in the counters


class EngineFailure(Exception):
    """The engine failed: HTTP 500 (worth retrying elsewhere)."""


@attrs.frozen
class Reply:
    """A route's answer: a status and a JSON value (``None``: an empty body), or a whole
    :class:`~rollout_trio._http.Response` for a non-JSON answer."""

    status: int = 200
    json: Any = None


_EMPTY = Reply(200, None)
Route = Callable[[Any], Awaitable[Reply]]


class _Live:
    """One /generate request in progress."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.chunk: trio.CancelScope | None = None
        self.reason: str | None = None  # "abort" | "pause" | "hold" | "update" | "shutdown"

    def interrupt(self, reason: str) -> None:
        if self.reason is None or reason in ("abort", "pause", "update", "shutdown"):
            self.reason = reason
        if self.chunk is not None:
            self.chunk.cancel()


class _Ring:
    """A bounded, ordered set of rids."""

    def __init__(self) -> None:
        self._d: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, rid: str) -> None:
        self._d[rid] = None
        while len(self._d) > _HISTORY:
            self._d.popitem(last=False)

    def __contains__(self, rid: object) -> bool:
        return rid in self._d

    def discard(self, rid: str) -> None:
        self._d.pop(rid, None)

    def list(self) -> list[str]:
        return list(self._d)


class SGLangApp:
    """Answers SGLang-protocol requests with ``engine``.

    Args:
        engine: the engine to serve (entered by the caller).
        model_path: what ``/get_model_info`` reports.
        segment_tokens: tokens per engine call (the granularity of aborts and pauses).
        step_delay: seconds to sleep after each chunk (slows generation down for demos
            and fault tests).
        tokenizer: decodes ``text`` in answers when given.
        processor: the served VLM's processor; with it ``/generate`` takes SGLang's
            ``image_data`` (base64 or ``data:image/`` URLs only: the server reads no files
            and fetches nothing), checked against the prompt's placeholders.
        max_image_pixels: the pixel budget of one image sent to ``/generate``.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        model_path: str = "tiny",
        segment_tokens: int = 16,
        step_delay: float = 0.0,
        tokenizer: Any = None,
        processor: Any = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens: must be >= 1, got {segment_tokens}")
        self.engine = engine
        self.model_path = model_path
        self.segment_tokens = segment_tokens
        self.step_delay = step_delay
        self.tokenizer = tokenizer
        self.processor = processor
        self.max_image_pixels = max_image_pixels
        self.weight_version = "default"
        self._closing = False
        self._pause_mode: str | None = None
        self._updating = False
        self._changed = trio.Event()
        self._update_lock = trio.Lock()
        self._live: dict[str, _Live] = {}
        self._early_aborts = _Ring()
        self.finished = _Ring()
        self.aborted = _Ring()
        self.counters: collections.Counter[str] = collections.Counter()
        #: ``(method, path) -> route``; a route takes the decoded JSON body (None if empty).
        self.routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): self._health,
            ("GET", "/health_generate"): self._health,
            ("GET", "/get_model_info"): self._model_info,
            ("GET", "/get_server_info"): self._server_info,
            ("GET", "/get_weight_version"): self._get_weight_version,
            ("GET", "/stats"): self._stats,
            ("POST", "/generate"): self._generate,
            ("POST", "/abort_request"): self._abort,
            ("POST", "/pause_generation"): self._pause,
            ("POST", "/continue_generation"): self._continue,
            ("POST", "/update_weights_from_disk"): self._update_from_disk,
            ("POST", "/update_weight_version"): self._update_weight_version,
        }
        # Watching the server (rollout_trio.observe): Prometheus text, the live page and its data.
        from ..observe._serve_metrics import ServeMetrics

        self.metrics = ServeMetrics(self)
        self.routes = {key: self.metrics.timed(key[1], route) for key, route in self.routes.items()}
        self.routes.update(self.metrics.routes())

    def shut_down(self) -> None:
        """End every generation now (``abort`` with its partial output) and refuse new ones."""
        self._closing = True
        for live in list(self._live.values()):
            live.interrupt("shutdown")
        self._notify()

    # ------------------------------------------------------------------ state

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _held(self) -> bool:
        return self._updating or self._pause_mode in ("retract", "in_place")

    # ------------------------------------------------------------------ info

    async def _health(self, _body: Any) -> Reply:
        return _EMPTY

    async def _model_info(self, _body: Any) -> Reply:
        return Reply(
            200,
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
                "engine_version": self.engine.get_version(),
                "stats": self._stats_dict(),
            }
        )

    async def _server_info(self, _body: Any) -> Reply:
        return Reply(
            200,
            {"server": "rollout-trio serve", "protocol": "sglang", "segment_tokens": self.segment_tokens,
             "weight_version": self.weight_version, "paused": self._pause_mode}
        )  # fmt: skip

    async def _get_weight_version(self, _body: Any) -> Reply:
        return Reply(200, {"weight_version": self.weight_version})

    def _stats_dict(self) -> dict[str, Any]:
        return {
            **{k: self.counters[k] for k in sorted(self.counters)},
            "in_flight": len(self._live),
            "in_flight_rids": sorted(self._live),
            "paused": self._pause_mode,
            "finished_rids": self.finished.list(),
            "aborted_rids": self.aborted.list(),
        }

    async def _stats(self, _body: Any) -> Reply:
        return Reply(200, self._stats_dict())

    # ------------------------------------------------------------------ control

    async def _abort(self, data: Any) -> Reply:
        body = parse_body(AbortBody, data, "abort_request")
        self.counters["abort_requests"] += 1
        if body.abort_all:
            for live in list(self._live.values()):
                live.interrupt("abort")
            return _EMPTY
        rid = body.rid
        assert rid  # AbortBody's rule
        self.aborted.add(rid)
        target = self._live.get(rid)
        if target is not None:
            target.interrupt("abort")
        else:
            self._early_aborts.add(rid)  # its /generate may still be on the way
        return _EMPTY

    async def _pause(self, data: Any) -> Reply:
        mode = parse_body(PauseBody, data, "pause_generation").mode
        self._pause_mode = mode
        self.counters["pauses"] += 1
        for live in list(self._live.values()):
            live.interrupt("pause" if mode == "abort" else "hold")
        self._notify()
        return Reply(200, {"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, _body: Any) -> Reply:
        self._pause_mode = None
        self._notify()
        return Reply(200, {"message": "Generation continued successfully.", "status": "ok"})

    async def _update_from_disk(self, data: Any) -> Reply:
        body = parse_body(UpdateFromDiskBody, data, "update_weights_from_disk")
        path, label = body.model_path, body.weight_version
        async with self._update_lock:
            version = self._version_for(label) if label is not None else self.engine.get_version()
            self._updating = True
            reason = "update" if body.abort_all_requests else "hold"
            n = len(self._live)
            for live in list(self._live.values()):
                live.interrupt(reason)
            self._notify()
            try:
                await self.engine.update_weights(path, version)
            except Exception as exc:  # noqa: BLE001 - any checkpoint the client named may be bad
                # A truncated file, a pickle weights_only refuses, a wrong architecture: the
                # client's checkpoint, not the server, is at fault (and the model is unchanged).
                return Reply(400, {"success": False, "message": f"{type(exc).__name__}: {exc}"})
            finally:
                self._updating = False
                self._notify()
            if label is not None:
                self.weight_version = label
            self.counters["weight_updates"] += 1
        return Reply(200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": n})

    async def _update_weight_version(self, data: Any) -> Reply:
        body = parse_body(UpdateVersionBody, data, "update_weight_version")
        label = body.new_version
        if body.abort_all_requests:
            for live in list(self._live.values()):
                live.interrupt("update")
        self.engine.set_version(self._version_for(label))
        self.weight_version = label
        return Reply(200, {"success": True, "new_version": label})

    def _version_for(self, label: str) -> int:
        """The engine version of a label the body schema checked (canonical int64 or 'default')."""
        return parse_version_label(label, "weight_version")

    # ------------------------------------------------------------------ generation

    async def _generate(self, data: Any) -> Reply:
        self.counters["generate_received"] += 1
        body = parse_body(GenerateBody, data, "generate")
        if self._closing:
            return Reply(503, {"error": {"message": "generate: the server is shutting down", "code": 503}})
        ids = body.input_ids
        rid = body.rid or uuid.uuid4().hex
        if rid in self._live:
            raise BadRequest(f"generate: rid: duplicate request id {rid!r} is in flight")
        try:
            gconfig = body.sampling_params.gconfig()
        except WorkflowContractError as exc:  # a combination the per-field rules allow
            raise BadRequest(f"generate: sampling_params: {exc}") from None
        return_logprob = body.return_logprob
        vision = await self._vision(body, ids) if body.image_data else {}
        live = _Live(rid)
        if rid in self._early_aborts:
            self._early_aborts.discard(rid)
            live.reason = "abort"
        self._live[rid] = live
        start = time.perf_counter()
        try:
            tokens, logprobs, finish = await self._run(live, list(ids), gconfig, vision)
        except trio.Cancelled:
            self.counters["generate_cancelled"] += 1
            raise
        finally:
            del self._live[rid]
        if finish["type"] == "abort":
            if live.reason == "abort":
                self.aborted.add(rid)
                self.counters["generate_aborted"] += 1
            else:
                self.counters["generate_interrupted"] += 1
        else:
            self.finished.add(rid)
            self.counters["generate_finished"] += 1
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.perf_counter() - start,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)]
        text = ""
        if self.tokenizer is not None and tokens:
            text = self.tokenizer.decode(tokens, skip_special_tokens=gconfig.skip_special_tokens)
        return Reply(200, {"text": text, "output_ids": tokens, "meta_info": meta})

    async def _vision(self, body: GenerateBody, ids: list[int]) -> dict[str, Any]:
        """The request's images decoded, checked and processed once (in a thread), as
        :class:`ModelRequest` fields for every chunk; a broken rule is HTTP 400."""
        if self.processor is None:
            raise BadRequest("generate: image_data: this server's model takes no images")
        processor, images, budget = self.processor, body.images(), self.max_image_pixels

        def prepare() -> dict[str, Any]:
            decoded = decode_images(images, where="image_data", max_pixels=budget, allow_paths=False)
            mm = dict(processor.image_processor(images=list(decoded), return_tensors="pt"))
            fields = {"image_data": decoded, "processor": processor, "multi_modal_input": mm, "max_image_pixels": budget}
            ModelRequest(input_ids=ids, **fields)  # the placeholder rules, checked once here
            return fields

        try:
            return await trio.to_thread.run_sync(prepare)
        except WorkflowContractError as exc:
            raise BadRequest(f"generate: {exc}") from None

    async def _run(
        self, live: _Live, prompt: list[int], g: GenerationConfig, vision: dict[str, Any] | None = None
    ) -> tuple[list[int], list[float], dict[str, Any]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        budget = g.max_new_tokens
        chunk_no = 0
        while True:
            while True:
                if live.reason == "abort":
                    return tokens, logprobs, {"type": "abort", "message": "Abort by /abort_request"}
                if live.reason == "shutdown":
                    return tokens, logprobs, {"type": "abort", "message": "Abort due to server shutdown"}
                if live.reason == "update":
                    return tokens, logprobs, {"type": "abort", "message": "Abort due to a weight update"}
                if self._pause_mode == "abort":
                    where = "before prefill" if not tokens and chunk_no == 0 else "in running queue"
                    return tokens, logprobs, {"type": "abort", "message": f"Abort {where} due to engine pause"}
                if live.reason == "pause":
                    return tokens, logprobs, {"type": "abort", "message": "Abort in running queue due to engine pause"}
                if self._held():
                    await self._changed.wait()
                    continue
                live.reason = None  # a hold is over
                break
            n = min(self.segment_tokens, budget - len(tokens))
            sub = g.new(
                max_new_tokens=n,
                min_new_tokens=min(n, max(0, g.min_new_tokens - len(tokens))),
                max_tokens=len(prompt) + len(tokens) + n,
                seed=None if g.seed is None else g.seed + chunk_no,
            )
            with trio.CancelScope() as scope:
                live.chunk = scope
                try:
                    resp = await self.engine.agenerate(
                        ModelRequest(input_ids=prompt + tokens, gconfig=sub, rid=f"{live.rid}#{chunk_no}", **(vision or {}))
                    )
                except (UnsupportedRequestError, WorkflowContractError, ValueError) as exc:
                    raise BadRequest(f"generate: {exc}") from None
                except EngineError as exc:
                    raise EngineFailure(f"generate: {exc}") from None
                finally:
                    live.chunk = None
            chunk_no += 1
            if scope.cancelled_caught:
                continue  # interrupted: the checks above decide what happens
            tokens += resp.output_tokens
            logprobs += resp.output_logprobs
            self.counters["output_tokens"] += len(resp.output_tokens)
            if resp.stop_reason == "stop" and resp.output_tokens:
                return tokens, logprobs, {"type": "stop", "matched": tokens[-1]}
            if len(tokens) >= budget or resp.stop_reason == "stop" or len(resp.output_tokens) < n:
                return tokens, logprobs, {"type": "length", "length": len(tokens)}
            if self.step_delay:
                await trio.sleep(self.step_delay)
