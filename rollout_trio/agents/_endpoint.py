"""``OpenAIEndpoint``: an OpenAI-compatible chat-completions app backed by an InferenceEngine.

The app is the package's one HTTP layer (:class:`~rollout_trio._http.HTTPApp`: limits,
bodies, disconnects), the same as ``rollout-trio serve``'s. In-process callers reach it
through :class:`~rollout_trio.agents.InProcessTransport` (no socket, no ASGI messages) or
:class:`~rollout_trio.agents.InProcessClient`; agents in other processes reach the same app
served by Hypercorn's Trio worker on loopback (:func:`~rollout_trio.agents.serve_app`).
Every completion is recorded as an :class:`~rollout_trio.Interaction` in the session
whose key the request carries as its api key.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from .._config import GenerationConfig
from .._errors import UnsupportedRequestError, WorkflowContractError
from .._http import HTTPApp, HTTPError, InProcessClient, InProcessTransport, Request, Response, ServerLimits, json_bytes
from .._images import DEFAULT_MAX_IMAGE_PIXELS, ImageInputError, image_token_id
from .._interaction import Interaction
from .._io import ModelRequest, ModelResponse
from ._schema import APIError, ChatCompletionRequest, Tool, parse_request
from ._session import AgentSession
from ._template import ChatTemplate, parse_tool_calls, prompt_chars
from ._vision import vision_prompt
from ._messages import MESSAGES_PATH, create_message
from ._sse import chat_events, sse_response
from ._responses import RESPONSES_PATH, create_response

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["OpenAIEndpoint"]

logger = logging.getLogger("rollout_trio.agents")

_FINISH = {"stop": "stop", "length": "length", "abort": "length", "tool_calls": "tool_calls"}

_CHAT_PATH = "/v1/chat/completions"
#: Distinct (max_tokens, temperature, top_p, stop) settings whose GenerationConfig is kept.
_GCONFIG_CACHE = 256
#: Completions with at most this many tokens are cut at a stop string on the event loop.
_INLINE_STOP_TOKENS = 256


class OpenAIEndpoint:
    """Serves ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/messages`` (Anthropic), ``GET /v1/models`` and ``GET /health``.

    Args:
        engine: any :class:`~rollout_trio.engines.InferenceEngine`.
        tokenizer: the engine's tokenizer (chat template, decoding); defaults to
            ``engine.tokenizer`` when the engine has one.
        gconfig: base sampling settings; a request's ``temperature``, ``top_p``,
            ``max_tokens`` and ``stop`` override them. The tokenizer's eos and pad ids
            are stop ids.
        model_name: the model id reported by ``/v1/models`` and in completions.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for (400 above).
        default_max_tokens: the budget of a request that sets no ``max_tokens``.
        max_body_bytes: request bodies above this size get a 413.
        body_timeout: seconds to receive a request body; a slower client gets a 408.
        max_prompt_chars: the most characters a conversation (messages and tools) may
            hold; a longer one is refused (400) before it is tokenized.
        processor: the model's image processor (a VLM's): user messages may then hold
            OpenAI ``image_url`` parts, as ``data:image/...;base64`` URLs or local files
            (``file://`` or an absolute path); nothing is fetched from the network. The
            images are recorded in the interaction (``multi_modal_input``).
        max_image_pixels: the pixel budget of one image.
        local_image_files: whether ``image_url`` may name a local file.

    Every route but ``/health`` needs ``Authorization: Bearer <session key>`` from
    :meth:`session`.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any = None,
        *,
        gconfig: GenerationConfig | None = None,
        model_name: str = "rollout-trio",
        max_tokens_limit: int = 32768,
        default_max_tokens: int = 1024,
        max_body_bytes: int = 8 * 1024 * 1024,
        body_timeout: float = 60.0,
        max_prompt_chars: int = 1024 * 1024,
        processor: Any = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        local_image_files: bool = True,
    ) -> None:
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("tokenizer: required (the engine has no .tokenizer to default to)")
        if not 1 <= default_max_tokens <= max_tokens_limit:
            raise ValueError(f"default_max_tokens: must be between 1 and max_tokens_limit={max_tokens_limit}, got {default_max_tokens}")
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes: must be > 0, got {max_body_bytes}")
        if not body_timeout > 0:
            raise ValueError(f"body_timeout: must be > 0 seconds, got {body_timeout}")
        if max_prompt_chars <= 0:
            raise ValueError(f"max_prompt_chars: must be > 0, got {max_prompt_chars}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.gconfig = (gconfig or GenerationConfig()).with_stop_and_pad_token_ids(tokenizer)
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.max_prompt_chars = max_prompt_chars
        self.processor = processor
        self.max_image_pixels = max_image_pixels
        self.local_image_files = local_image_files
        self.engine_takes_stop_strings = True  # until the engine refuses them once
        self._sessions: dict[str, AgentSession] = {}
        self._gconfigs: dict[tuple[int, float | None, float | None, tuple[str, ...]], GenerationConfig] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text in logprobs (bounded by the vocabulary)
        limits = ServerLimits(max_body_bytes=max_body_bytes, read_deadline=body_timeout, max_header_bytes=64 * 1024)
        self.app = self._app(limits, in_caller=False)
        self._in_process_app = self._app(limits, in_caller=True)

    def _app(self, limits: ServerLimits, *, in_caller: bool) -> HTTPApp:
        async def chat(request: Request) -> Response:
            return await self._answer(self._complete(request, in_caller))

        async def responses(request: Request) -> Response:
            return await self._answer(create_response(self, request, in_caller))

        async def messages(request: Request) -> Response:
            return await create_message(self, request, in_caller)

        routes = {
            ("POST", MESSAGES_PATH): messages,
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("POST", _CHAT_PATH): chat,
            ("POST", RESPONSES_PATH): responses,
        }
        return HTTPApp(routes, limits=limits, error_body=_error_body)

    def in_process_transport(self) -> InProcessTransport:
        """An ``httpx`` transport to this endpoint for callers in this Trio run (no socket).

        It runs the app in the calling task, so a cancelled caller cancels its generation
        directly: chat completions through it skip the client-disconnect watcher a served
        app needs. ``httpx.ASGITransport(app=endpoint.app)`` works too, only slower.

        Returns:
            A transport for ``httpx.AsyncClient(transport=...)``.
        """
        return InProcessTransport(self._in_process_app)

    def in_process_client(self, base_url: str = "http://agent/v1/", **kwargs: Any) -> InProcessClient:
        """An ``httpx.AsyncClient`` to this endpoint for callers in this Trio run: what inline agents get.

        Args:
            base_url: the client's base URL (any host: nothing is resolved).
            **kwargs: other ``httpx.AsyncClient`` arguments (headers, event hooks, ...).

        Returns:
            An :class:`InProcessClient` (an async context manager).
        """
        return InProcessClient(self._in_process_app, base_url=base_url, **kwargs)

    # ---------------------------------------------------------------- sessions

    @contextmanager
    def session(self, *, chat_template_type: Literal["hf", "concat"] = "hf", label: str = "") -> Iterator[AgentSession]:
        """Open a session for one episode; leaving the block ends it.

        Ending refuses the session's key from then on and cancels its in-flight
        generations (their engine calls abort).
        """
        s = AgentSession(chat_template_type=chat_template_type, label=label)
        self._sessions[s.key] = s
        try:
            yield s
        finally:
            s.end()
            del self._sessions[s.key]

    def _authorize(self, header: str) -> AgentSession:
        """The live session whose key the ``Authorization`` header value carries."""
        scheme, _, key = header.partition(" ")
        session = self._sessions.get(key.strip()) if scheme.lower() == "bearer" else None
        if session is None:
            raise APIError(
                401,
                "Authorization: expected 'Bearer <key>' with the api key of a live episode session",
                type="authentication_error",
                code="invalid_api_key",
            )
        return session

    # ---------------------------------------------------------------- routes

    async def _health(self, request: Request) -> Response:
        return Response(200, b'{"status":"ok"}')

    async def _models(self, request: Request) -> Response:
        try:
            self._authorize(request.header("authorization") or "")
        except APIError as exc:
            return Response(exc.status, json_bytes(exc.body()))
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollout-trio"}]
        return Response(200, json_bytes({"object": "list", "data": data}))

    async def _answer(self, answer: Awaitable[Response]) -> Response:
        """A route's answer, or its error as an OpenAI-shaped body with the error's status."""
        try:
            return await answer
        except APIError as exc:
            return Response(exc.status, json_bytes(exc.body()))
        except HTTPError:
            raise
        except Exception as exc:  # an engine failure: a 500 body, never a dropped connection
            logger.error("chat completion failed", exc_info=exc)
            return Response(500, json_bytes(APIError(500, f"{type(exc).__name__}: {exc}", type="server_error").body()))

    def parse_chat(self, body: Any) -> ChatCompletionRequest:
        """A chat completion request from a decoded JSON body, its size checked.

        Raises:
            APIError: 400 naming the field and the rule.
        """
        req = parse_request(body, max_tokens_limit=self.max_tokens_limit)
        size = prompt_chars(req.messages, _offered_tools(req))
        if size > self.max_prompt_chars:
            raise APIError(
                400,
                f"messages: the conversation holds {size} characters, over max_prompt_chars={self.max_prompt_chars}",
                param="messages",
                code="context_length_exceeded",
            )
        return req

    async def _complete(self, request: Request, in_caller: bool) -> Response:
        session = self._authorize(request.header("authorization") or "")
        req: ChatCompletionRequest = await request.json(self.parse_chat)
        completion_id, resp, message, finish, tokens = await self.run_chat(session, request, req, in_caller, prefix="chatcmpl-")
        created = int(time.time())
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [self._token_logprob(t, lp) for t, lp in zip(tokens, resp.output_logprobs, strict=False)]}
        completion = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": resp.input_len,
                "completion_tokens": len(tokens),
                "total_tokens": resp.input_len + len(tokens),
            },
        }
        if req.stream:
            return sse_response(chat_events(completion))
        # Encoded here, so a body JSON cannot hold (a NaN logprob) is a 500 like any failure.
        return Response(200, json_bytes(completion))

    async def run_chat(
        self, session: AgentSession, request: Request, req: ChatCompletionRequest, in_caller: bool, *, prefix: str
    ) -> tuple[str, ModelResponse, dict[str, Any], str, tuple[int, ...]]:
        """Generate one chat turn and record it; every API route (chat, responses) goes here.

        Returns:
            The interaction id (``prefix`` + request id), the engine's response, the
            assistant message in chat form, the finish reason and the kept output tokens.
        """
        rid = uuid.uuid4().hex
        vision: dict[str, Any] = {}
        if any(m.parts for m in req.messages):
            prompt, vision = await self._vision_prompt(req)
        else:
            prompt = await self.template.aprompt_ids(req.messages, _offered_tools(req))
        try:
            mreq = ModelRequest(input_ids=prompt, gconfig=self._gconfig(req), rid=rid, tokenizer=self.tokenizer, **vision)
        except ImageInputError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        resp = await self._generate(session, request, mreq, in_caller)
        message, finish, tokens = await self._output_message(req, resp)
        completion_id = f"{prefix}{rid}"
        messages = [m.as_openai_dict() for m in req.messages]
        session.record(
            Interaction(
                model_response=resp if len(tokens) == resp.output_len else _truncate(resp, len(tokens)),
                messages=messages,
                output_message_list=[message],
                interaction_id=completion_id,
                chat_template_type=session.chat_template_type,
                parent=session.find_parent(messages) if session.chat_template_type == "concat" else None,
                multi_modal_input=vision.get("multi_modal_input"),
                image_token_id=image_token_id(self.processor) if vision else None,
            )
        )
        return completion_id, resp, message, finish, tokens

    # ---------------------------------------------------------------- helpers

    async def _vision_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and image fields of a request with ``image_url`` parts (in a thread)."""
        if self.processor is None:
            raise APIError(400, "messages: image_url parts need a vision model (this endpoint has no processor)", param="messages")
        try:
            return await trio.to_thread.run_sync(
                lambda: vision_prompt(self.template, self.processor, req.messages, _offered_tools(req),
                                      max_pixels=self.max_image_pixels, local_files=self.local_image_files)  # fmt: skip
            )
        except ImageInputError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def _gconfig(self, req: ChatCompletionRequest) -> GenerationConfig:
        """The request's sampling settings over the base ones (built once per combination)."""
        max_new_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        stop = req.stop if self.engine_takes_stop_strings else ()
        key = (max_new_tokens, req.temperature, req.top_p, stop)
        gconfig = self._gconfigs.get(key)
        if gconfig is None:
            changes: dict[str, Any] = {"n_samples": 1, "max_new_tokens": max_new_tokens}
            if req.temperature is not None:
                changes["temperature"] = req.temperature
                changes["greedy"] = req.temperature == 0
            if req.top_p is not None:
                changes["top_p"] = req.top_p
            if stop:  # the engine stops there; the text is cut here as well (see _output_message)
                changes["stop"] = list(stop)
            gconfig = self.gconfig.new(**changes)
            if len(self._gconfigs) >= _GCONFIG_CACHE:
                self._gconfigs.clear()
            self._gconfigs[key] = gconfig
        return gconfig

    async def _generate(self, session: AgentSession, request: Request, mreq: ModelRequest, in_caller: bool) -> ModelResponse:
        """Run the engine call; a client disconnect or the session's end cancels (aborts) it."""
        error: Exception | None = None
        resp: ModelResponse | None = None

        async def generate() -> ModelResponse | None:
            nonlocal error, mreq
            try:
                try:
                    return await self.engine.agenerate(mreq)
                except UnsupportedRequestError as exc:
                    if not mreq.gconfig.stop or "stop" not in str(exc):
                        raise
                    # An engine without stop strings (LocalEngine): generate, then cut here.
                    logger.info("the engine takes no stop strings (%s); they are applied to the text only", exc)
                    self.engine_takes_stop_strings = False
                    mreq = attrs.evolve(mreq, gconfig=mreq.gconfig.new(stop=None))
                    return await self.engine.agenerate(mreq)
            except Exception as exc:  # re-raised below, outside any nursery's exception group
                error = exc
                return None

        with session.generation_scope():
            # In the caller's task its cancellation (the in-process "disconnect") reaches
            # the engine call directly; a served request watches for the disconnect.
            resp = await generate() if in_caller else await request.unless_disconnected(generate)
        if isinstance(error, ValueError) and not isinstance(error, WorkflowContractError):
            # UnsupportedRequestError included: a setting or prompt the engine cannot honour.
            raise APIError(400, f"the engine refused the request: {error}") from None
        if error is not None:
            raise error
        if resp is None:
            raise APIError(409, "the episode's session ended or the client went away before the completion finished", code="cancelled")
        return resp

    async def _output_message(self, req: ChatCompletionRequest, resp: ModelResponse) -> tuple[dict[str, Any], str, tuple[int, ...]]:
        tokens = resp.output_tokens
        finish = _FINISH[resp.stop_reason]
        if len(tokens) <= _INLINE_STOP_TOKENS:
            text, cut = _decode_and_cut(self.tokenizer, tokens, req.stop)
        else:
            text, cut = await trio.to_thread.run_sync(_decode_and_cut, self.tokenizer, tokens, req.stop)
        if cut is not None:
            tokens, text = cut
            finish = "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if _offered_tools(req):
            content, calls = parse_tool_calls(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls"
        return message, finish, tokens

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._token_texts.get(token)
        if text is None:  # one decode per vocabulary entry, not per token of every completion
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}

def _error_body(status: int, message: str) -> bytes:
    return json_bytes(APIError(status, message).body())


def _offered_tools(req: ChatCompletionRequest) -> tuple[Tool, ...]:
    """The tools the model is offered: none with ``tool_choice="none"``."""
    return () if req.tool_choice == "none" else req.tools


def _decode_and_cut(
    tokenizer: Any, tokens: tuple[int, ...], stops: tuple[str, ...]
) -> tuple[str, tuple[tuple[int, ...], str] | None]:
    """The text of ``tokens``, and the cut at the first stop string if one occurs.

    The cut keeps the tokens up to the one completing the stop string and the text before
    it. That token is found by bisection (a decoded prefix contains a stop string from
    some length on): O(log n) decodes, not one per prefix.
    """
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return text, None
    at = min(hits)

    def has_stop(k: int) -> bool:
        partial = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        return any(s in partial for s in stops)

    lo, hi = 1, len(tokens)  # has_stop(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(mid):
            hi = mid
        else:
            lo = mid + 1
    return text, (tokens[:hi], text[:at])


def _truncate(resp: ModelResponse, n: int) -> ModelResponse:
    return attrs.evolve(
        resp,
        output_tokens=resp.output_tokens[:n],
        output_logprobs=resp.output_logprobs[:n],
        output_versions=resp.output_versions[:n],
        stop_reason="stop",
    )
