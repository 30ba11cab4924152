"""LocalEngine: an in-process transformers model behind the InferenceEngine protocol.

One dedicated worker thread owns the model and runs a batched decode loop
(:class:`~rollout_trio.engines._local_batch.KVBatch`): every step admits waiting requests
with one prefill pass and advances every in-flight request with one shared decode pass.
Trio tasks hand requests over under a ``threading.Condition`` (the worker sleeps on it
when idle: no polling) and are woken through the Trio token (``run_sync_soon`` sets the
request's ``trio.Event``).

Why our own loop rather than transformers' continuous batching manager: the manager has
one ``do_sample`` for all requests (no per-request greedy), draws from torch's global RNG
(no per-request seeds), reports logprobs after top-k / top-p renormalisation, and its
``pause()`` keeps the KV cache across a weight swap (tokens after an update would be
produced from keys of the old weights). Each is a hard requirement here.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import attrs
import torch
import trio

from ..workflow_context import request_seed
from .._errors import EngineError, EngineTimeoutError, UnsupportedRequestError
from .._io import ModelRequest, ModelResponse
from ._local_batch import KVBatch, check_supported
from ._local_sampling import RowSampling, sample_rows
from ._local_vision import check_takes_images, is_vlm, is_vlm_checkpoint, vision_tensors
from ._protocol import WeightsSource

__all__ = ["LocalEngine", "LocalEngineStatistics"]

logger = logging.getLogger(__name__)

_RID_HISTORY = 4096  # how many rids statistics() remembers step counts for


@attrs.frozen
class LocalEngineStatistics:
    """A snapshot of a :class:`LocalEngine`'s counters (see :meth:`LocalEngine.statistics`).

    ``steps_per_rid`` counts, for the most recent requests, the forward passes that
    produced a token for that request (a cancelled request's count never grows again).
    ``live_rids`` are the requests waiting or in the batch.
    """

    version: int
    paused: bool
    forward_passes: int
    prefill_passes: int
    decode_steps: int
    generated_tokens: int
    max_batch_rows: int
    interrupts: int
    live_rids: frozenset[str]
    steps_per_rid: Mapping[str, int]


@attrs.define(eq=False)
class _Seq:
    """One request as the worker sees it. Fields after ``done`` are written under the lock."""

    rid: str
    prompt: list[int]
    budget: int
    stop_ids: frozenset[int]
    min_new: int
    sampling: RowSampling
    start: float
    done: trio.Event
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[float] = attrs.Factory(list)
    versions: list[int] = attrs.Factory(list)
    stop_reason: str | None = None
    first_token_at: float | None = None
    error: BaseException | None = None
    cancelled: bool = False
    vision: dict[str, Any] | None = None  # the images' processor tensors (a VLM's prompt)

    def inputs(self) -> list[int]:
        return self.prompt + self.tokens


class LocalEngine:
    """An embedded inference engine batching concurrent ``agenerate`` calls.

    Use it as an async context manager; leaving it stops and joins the worker thread.

    Args:
        model: a transformers causal LM (full attention, e.g. Llama / Qwen / GPT-2), or a
            Qwen-VL-style image-text-to-text model (requests then may carry images).
        tokenizer: its tokenizer; supplies eos and pad ids and is attached to responses.
        device: move the model there; None keeps the model's device.
        max_batch_tokens: admission cap on the tokens held in the KV cache (sum of each
            row's current length); a request waits while it would exceed it, except that a
            lone request is always admitted.
        max_batch_size: at most this many requests share a forward pass.
        request_timeout: seconds an ``agenerate`` may take before
            :class:`~rollout_trio.EngineTimeoutError`; None leaves it to the caller's cancel
            scope.
        seed: seeds the engine's generator for requests without ``gconfig.seed`` made
            outside :func:`workflow_context.use_seed`; None draws a random seed.
        version: the initial weight version.

    Raises:
        ValueError: the model's cache is not plain full attention.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: str | torch.device | None = None,
        max_batch_tokens: int = 65536,
        max_batch_size: int = 256,
        request_timeout: float | None = None,
        seed: int | None = None,
        version: int = 0,
    ) -> None:
        if max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens: must be > 0, got {max_batch_tokens}")
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size: must be > 0, got {max_batch_size}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout: must be > 0 or None, got {request_timeout}")
        check_supported(model)
        if device is not None:
            model = model.to(device)
        self._model = model.eval()
        self._tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self._eos = _eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None) or getattr(model.config, "pad_token_id", None)
        self._batch = KVBatch(model, self._device, pad if isinstance(pad, int) and 0 <= pad < self._vocab else 0)
        self._max_batch_tokens = max_batch_tokens
        self._max_batch_size = max_batch_size
        self._request_timeout = request_timeout
        self._shared_gen = torch.Generator(device=self._device)
        self._shared_gen.manual_seed(secrets.randbits(63) if seed is None else seed)
        self._version = version

        self._cond = threading.Condition()
        self._pending: collections.deque[_Seq] = collections.deque()
        self._active: list[_Seq] = []  # row order of self._batch (worker thread only)
        self._paused = False
        self._pause_waiters: list[trio.Event] = []
        self._stopping = False
        self._fatal: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._update_lock = trio.Lock()
        # Counters (under self._cond).
        self._forward = self._prefills = self._decodes = self._generated = 0
        self._max_rows = self._interrupts = 0
        self._steps: collections.OrderedDict[str, int] = collections.OrderedDict()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> LocalEngine:
        """Build an engine from a local checkpoint directory (model and tokenizer).

        Args:
            path: a directory written by ``save_pretrained`` (model and tokenizer).
            device: where to load the model; None picks CUDA when present, else CPU.
            dtype: parameter dtype; None keeps the checkpoint's.
            **kwargs: passed to the constructor.
        """
        from ..models import load_model

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if is_vlm_checkpoint(path):
            from ..models_vision import load_vlm

            model, processor = load_vlm(path, device=device, dtype=dtype)
            return cls(model, processor.tokenizer, **kwargs)
        model, tokenizer = load_model(path, device=device, dtype=dtype)
        return cls(model, tokenizer, **kwargs)

    @property
    def model(self) -> Any:
        """The served model (do not change its weights except through :meth:`update_weights`)."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given at construction."""
        return self._tokenizer

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        if self._thread is not None:
            raise RuntimeError("LocalEngine: already entered (an engine runs once)")
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="rollout-trio-local-engine", daemon=True)
        self._thread.start()
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            # Bounded by one forward pass: the worker checks _stopping between steps.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)

    # ------------------------------------------------------------------ protocol

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req``, batched with other concurrent calls.

        Cancelling the call removes the request from the batch before its next step.

        Raises:
            UnsupportedRequestError: a setting LocalEngine cannot honour (the message names it).
            ValueError: an empty prompt, a token id outside the vocabulary, or no token budget.
            EngineTimeoutError: ``request_timeout`` passed.
            EngineError: the engine is not running or the forward pass failed.
        """
        await trio.lowlevel.checkpoint()  # every path checkpoints, errors included
        if req.image_data:
            check_takes_images(self._model, req)
        seq = self._make_seq(req)
        if req.image_data:
            seq.vision = await vision_tensors(req)
        self._check_running()
        with self._cond:
            self._pending.append(seq)
            self._cond.notify_all()
        try:
            with trio.move_on_after(math.inf if self._request_timeout is None else self._request_timeout) as scope:
                await seq.done.wait()
        finally:
            if not seq.done.is_set():
                self._cancel(seq)
        # The wake-up may share a scheduler round with the failure that cancelled this
        # task (a sibling in its group): hand no result to an already cancelled scope.
        await trio.lowlevel.checkpoint_if_cancelled()
        if scope.cancelled_caught:
            raise EngineTimeoutError(
                f"LocalEngine: request {req.rid!r} ran past request_timeout={self._request_timeout} s"
            )
        if seq.error is not None:
            raise EngineError(f"LocalEngine: generation failed for request {req.rid!r}: {seq.error!r}") from seq.error
        assert seq.stop_reason is not None
        end = time.perf_counter()
        return ModelResponse(
            input_tokens=seq.prompt,
            output_tokens=seq.tokens,
            output_logprobs=[min(lp, 0.0) for lp in seq.logprobs],
            output_versions=seq.versions,
            stop_reason=seq.stop_reason,  # type: ignore[arg-type]
            latency=end - seq.start,
            ttft=(seq.first_token_at or end) - seq.start,
            tokenizer=req.tokenizer if req.tokenizer is not None else self._tokenizer,
        )

    def get_version(self) -> int:
        """The weight version stamped on tokens generated from now on."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the version stamped on tokens of forward passes that start after this call."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version: must be an int, got {version!r}")
        with self._cond:
            self._version = version

    async def pause(self) -> None:
        """Stop at the next step boundary; returns once the worker has stopped.

        In-flight requests are interrupted (their KV cache dropped) and keep waiting, inside
        their callers' cancel scopes; after :meth:`resume` they re-prefill prompt plus the
        tokens they already have and continue.
        """
        self._check_running()
        stopped = trio.Event()
        with self._cond:
            self._paused = True
            self._pause_waiters.append(stopped)
            self._cond.notify_all()
        await stopped.wait()
        self._check_running()

    async def resume(self) -> None:
        """Let held and interrupted requests continue."""
        self._unpause()
        await trio.lowlevel.checkpoint()

    def _unpause(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Pause at a step boundary, load ``source``, set ``version``, resume.

        Args:
            source: a state dict (name -> tensor, any device / dtype) or a checkpoint
                directory saved with ``save_pretrained``.
            version: the version stamped on every token generated with the new weights.

        Raises:
            EngineError: the weights do not fit the model (version and weights unchanged
                as far as loading allows; generation resumes).

        Serialized by a lock, and cancellation-safe: cancelled anywhere (while waiting for
        the step boundary included), the engine resumes unless it was paused before. The
        load itself runs to its end in its thread, so weights and version stay paired.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version: must be an int, got {version!r}")
        async with self._update_lock:
            was_paused = self._paused
            try:
                await self.pause()
                await trio.to_thread.run_sync(self._load_weights, source)
                self.set_version(version)
            finally:
                if not was_paused:
                    self._unpause()  # no checkpoint: nothing can interrupt it

    def statistics(self) -> LocalEngineStatistics:
        """A snapshot of the engine's counters."""
        with self._cond:
            # A cancelled row is out from the moment of cancellation (nothing is committed for
            # it again); the worker only compacts its cache slot at the next step boundary.
            live = {s.rid for s in self._pending} | {
                s.rid for s in self._active if s.stop_reason is None and not s.cancelled
            }
            return LocalEngineStatistics(
                version=self._version,
                paused=self._paused,
                forward_passes=self._forward,
                prefill_passes=self._prefills,
                decode_steps=self._decodes,
                generated_tokens=self._generated,
                max_batch_rows=self._max_rows,
                interrupts=self._interrupts,
                live_rids=frozenset(live),
                steps_per_rid=dict(self._steps),
            )

    # ------------------------------------------------------------------ trio side helpers

    def _check_running(self) -> None:
        if self._fatal is not None:
            raise EngineError(f"LocalEngine: the worker thread failed: {self._fatal!r}") from self._fatal
        if self._thread is None or self._stopping:
            raise EngineError("LocalEngine: not running; use it inside `async with engine:`")

    def _make_seq(self, req: ModelRequest) -> _Seq:
        g = req.gconfig
        if g.n_samples != 1:
            raise UnsupportedRequestError(
                f"gconfig.n_samples: LocalEngine generates one sample per request, got {g.n_samples} "
                "(send n_samples requests instead)"
            )
        if g.use_beam_search:
            raise UnsupportedRequestError("gconfig.use_beam_search: LocalEngine does not do beam search")
        if g.stop:
            raise UnsupportedRequestError(
                f"gconfig.stop: LocalEngine does not support stop strings, got {g.stop!r}; use stop_token_ids"
            )
        if g.frequency_penalty != 0:
            raise UnsupportedRequestError(
                f"gconfig.frequency_penalty: LocalEngine supports only 0.0, got {g.frequency_penalty}"
            )
        prompt = list(req.input_ids)
        if not prompt:
            raise ValueError("ModelRequest.input_ids: the prompt must hold at least one token")
        for i, t in enumerate(prompt):
            if not 0 <= t < self._vocab:
                raise ValueError(f"ModelRequest.input_ids[{i}]: token id {t} is outside the vocabulary [0, {self._vocab})")
        budget = min(g.max_tokens - len(prompt), g.max_new_tokens)
        if budget <= 0:
            raise ValueError(
                f"gconfig.max_tokens: no room to generate: min(max_tokens - len(input_ids), max_new_tokens) = "
                f"min({g.max_tokens} - {len(prompt)}, {g.max_new_tokens}) = {budget}, must be > 0"
            )
        if self._max_len is not None:
            # The model's context length caps the budget like a server's context length.
            budget = min(budget, self._max_len - len(prompt))
            if budget <= 0:
                raise ValueError(
                    f"ModelRequest.input_ids: prompt of {len(prompt)} tokens leaves no room in the model's "
                    f"context of {self._max_len} tokens"
                )
        stop = {t for t in g.stop_token_ids if 0 <= t < self._vocab}
        if not g.ignore_eos:
            stop |= self._eos
        if g.min_new_tokens > 0 and len(stop) >= self._vocab:
            # Masked under min_new_tokens, no token would be left to draw: refuse this request
            # alone (in the shared batched step it would fail every row batched with it).
            raise ValueError(
                f"gconfig.stop_token_ids: with min_new_tokens={g.min_new_tokens} every one of the {self._vocab} "
                "tokens of the vocabulary is a stop token (or EOS): no token can be sampled"
            )
        temperature = g.effective_temperature
        gen = None
        # A request without its own seed follows the run's (workflow_context.use_seed), if any.
        seed = g.seed if g.seed is not None else request_seed()
        if seed is not None and temperature > 0:
            gen = torch.Generator(device=self._device)
            gen.manual_seed(seed)
        sampling = RowSampling(
            temperature=temperature,
            top_k=g.top_k if g.top_k_active else None,
            top_p=float(g.top_p),
            generator=gen,
        )
        return _Seq(
            rid=req.rid,
            prompt=prompt,
            budget=budget,
            stop_ids=frozenset(stop),
            min_new=g.min_new_tokens,
            sampling=sampling,
            start=time.perf_counter(),
            done=trio.Event(),
        )


    def _cancel(self, seq: _Seq) -> None:
        # Synchronous, so it needs no shield: the worker drops the row at its next boundary
        # and never commits another token (or step count) for it.
        with self._cond:
            seq.cancelled = True
            try:
                self._pending.remove(seq)
            except ValueError:
                pass
            self._cond.notify_all()

    def _load_weights(self, source: WeightsSource) -> None:
        try:
            if isinstance(source, Mapping):
                state = dict(source)
            else:
                from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

                path = os.fspath(source)
                if not os.path.isdir(path):
                    raise FileNotFoundError(f"source: {path!r} is not a checkpoint directory")
                auto = AutoModelForImageTextToText if is_vlm(self._model) else AutoModelForCausalLM
                loaded = auto.from_pretrained(path, dtype=self._model.dtype, local_files_only=True)
                state = loaded.state_dict()
            with torch.no_grad():
                self._model.load_state_dict(state, strict=True)
        except (RuntimeError, OSError, ValueError) as exc:
            raise EngineError(f"update_weights: could not load weights into the model: {exc}") from exc

    def _notify(self, event: trio.Event) -> None:
        assert self._token is not None
        try:
            self._token.run_sync_soon(event.set)
        except trio.RunFinishedError:  # pragma: no cover - the engine outlived its trio.run
            pass

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._next_step():
                    pass
        except BaseException as exc:  # the loop itself broke: fail everyone, refuse new work
            logger.exception("LocalEngine worker thread failed")
            self._fatal = exc
        finally:
            with self._cond:
                err = self._fatal or EngineError("LocalEngine: the engine was closed")
                for seq in [*self._pending, *self._active]:
                    if not seq.done.is_set() and seq.stop_reason is None and seq.error is None:
                        seq.error = err
                        self._notify(seq.done)
                self._pending.clear()
                self._active = []
                for ev in self._pause_waiters:
                    self._notify(ev)
                self._pause_waiters.clear()
            self._batch.clear()

    def _next_step(self) -> bool:
        """Wait for work, then run one admit + prefill and one decode. False means stop."""
        with self._cond:
            while True:
                if self._stopping:
                    return False
                self._drop_cancelled()
                if self._paused:
                    self._interrupt()
                    for ev in self._pause_waiters:
                        self._notify(ev)
                    self._pause_waiters.clear()
                elif self._pending or self._active:
                    break
                self._cond.wait()
            admitted = self._admit()
            version = self._version
        if admitted:
            self._forward_and_commit(admitted, version, prefill=True)
        with self._cond:
            if self._paused or self._stopping:
                return True  # stop at this boundary; the wait loop acknowledges
            self._drop_cancelled()
            version = self._version
        if self._active:
            self._forward_and_commit(self._active, version, prefill=False)
        return True

    def _admit(self) -> list[_Seq]:
        # Under the lock. Cap rows and cached tokens; a lone request always gets in.
        held = sum(len(s.prompt) + len(s.tokens) for s in self._active)
        rows = len(self._active)
        admitted: list[_Seq] = []
        while self._pending and rows < self._max_batch_size:
            nxt = len(self._pending[0].prompt) + len(self._pending[0].tokens)
            if rows > 0 and held + nxt > self._max_batch_tokens:
                break
            admitted.append(self._pending.popleft())
            held += nxt
            rows += 1
        return admitted

    def _interrupt(self) -> None:
        # Under the lock: drop the KV cache; in-flight requests go back to the front of the
        # queue and re-prefill prompt + tokens so far when admitted again.
        if self._active:
            self._interrupts += 1
            self._pending.extendleft(reversed(self._active))
            self._active = []
        self._batch.clear()

    def _drop_cancelled(self) -> None:
        # Under the lock.
        if any(s.cancelled for s in self._active):
            keep = [i for i, s in enumerate(self._active) if not s.cancelled]
            self._active = [self._active[i] for i in keep]
            self._batch.keep(keep)

    def _forward_and_commit(self, seqs: list[_Seq], version: int, *, prefill: bool) -> None:
        first_row = len(self._active) if prefill else 0
        try:
            if prefill:
                vision = [s.vision for s in seqs] if any(s.vision is not None for s in seqs) else None
                logits = self._batch.prefill([s.inputs() for s in seqs], vision)
            else:
                logits = self._batch.decode()
            masked = [s.stop_ids if len(s.tokens) < s.min_new else () for s in seqs]
            tokens, logprobs = sample_rows(logits, [s.sampling for s in seqs], masked, self._shared_gen)
        except Exception as exc:  # a failed step fails the requests in it; the engine goes on
            logger.exception("LocalEngine step failed")
            with self._cond:
                for s in seqs:
                    s.error = exc
                    self._notify(s.done)
                if prefill:
                    self._batch.keep(list(range(first_row)))
                else:
                    self._active = []
                    self._batch.clear()
            return
        now = time.perf_counter()
        self._batch.set_last(first_row, tokens)
        with self._cond:
            if prefill:
                self._active.extend(seqs)
            self._forward += 1
            if prefill:
                self._prefills += 1
            else:
                self._decodes += 1
                self._max_rows = max(self._max_rows, len(seqs))
            for s, tok, lp in zip(seqs, tokens, logprobs, strict=True):
                if s.cancelled:
                    continue
                s.tokens.append(tok)
                s.logprobs.append(lp)
                s.versions.append(version)
                self._generated += 1
                self._steps[s.rid] = self._steps.pop(s.rid, 0) + 1
                if len(self._steps) > _RID_HISTORY:
                    self._steps.popitem(last=False)
                if s.first_token_at is None:
                    s.first_token_at = now
                if tok in s.stop_ids:
                    s.stop_reason = "stop"
                elif len(s.tokens) >= s.budget:
                    s.stop_reason = "length"
                if s.stop_reason is not None:
                    self._notify(s.done)
            gone = [i for i, s in enumerate(self._active) if s.stop_reason is not None or s.cancelled]
            if gone:
                dead = set(gone)
                keep = [i for i in range(len(self._active)) if i not in dead]
                self._active = [self._active[i] for i in keep]
                self._batch.keep(keep)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(t for t in source if isinstance(t, int))
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(t for t in eos if isinstance(t, int))
    return frozenset(ids)
