"""``OpenAIEndpoint``: an OpenAI-compatible chat-completions app backed by an InferenceEngine.

The app is plain ASGI (Starlette). In-process callers reach it through
``httpx.ASGITransport`` (no socket); agents in other processes reach the same app
served by Hypercorn's Trio worker on loopback (:meth:`OpenAIEndpoint.serve`).
Every completion is recorded as an :class:`~rollout_trio.Interaction` in the session
whose key the request carries as its api key.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import attrs
import httpx
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .._config import GenerationConfig
from .._errors import WorkflowContractError
from .._interaction import Interaction
from .._io import ModelRequest, ModelResponse
from ._schema import APIError, ChatCompletionRequest, Tool, parse_request
from ._session import AgentSession
from ._template import ChatTemplate, parse_tool_calls

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["OpenAIEndpoint"]

logger = logging.getLogger("rollout_trio.agents")

_FINISH = {"stop": "stop", "length": "length", "abort": "length", "tool_calls": "tool_calls"}

_CHAT_PATH = "/v1/chat/completions"
#: Distinct (max_tokens, temperature, top_p) settings whose GenerationConfig is kept.
_GCONFIG_CACHE = 256

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class OpenAIEndpoint:
    """Serves ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /health``.

    Args:
        engine: any :class:`~rollout_trio.engines.InferenceEngine`.
        tokenizer: the engine's tokenizer (chat template, decoding); defaults to
            ``engine.tokenizer`` when the engine has one.
        gconfig: base sampling settings; a request's ``temperature``, ``top_p`` and
            ``max_tokens`` override them. The tokenizer's eos and pad ids are stop ids.
        model_name: the model id reported by ``/v1/models`` and in completions.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for (400 above).
        default_max_tokens: the budget of a request that sets no ``max_tokens``.
        max_body_bytes: request bodies above this size get a 413.
        body_timeout: seconds to receive a request body; a slower client gets a 408.

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
    ) -> None:
        tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("tokenizer: required (the engine has no .tokenizer to default to)")
        if not 1 <= default_max_tokens <= max_tokens_limit:
            raise ValueError(f"default_max_tokens: must be between 1 and max_tokens_limit={max_tokens_limit}, got {default_max_tokens}")
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes: must be > 0, got {max_body_bytes}")
        if not body_timeout > 0:
            raise ValueError(f"body_timeout: must be > 0 seconds, got {body_timeout}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.gconfig = (gconfig or GenerationConfig()).with_stop_and_pad_token_ids(tokenizer)
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self._sessions: dict[str, AgentSession] = {}
        self._gconfigs: dict[tuple[int, float | None, float | None], GenerationConfig] = {}
        self._token_texts: dict[int, str] = {}  # token id -> its text in logprobs (bounded by the vocabulary)
        self.app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                # The hot route is plain ASGI (no Request/Response objects per completion).
                Route("/v1/chat/completions", _ASGIRoute(self._chat_completions), methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error},
        )

    def in_process_transport(self) -> httpx.ASGITransport:
        """An ``httpx`` transport to :attr:`app` for callers in this Trio run (no socket).

        ``httpx.ASGITransport`` runs the app in the calling task, so a cancelled caller
        cancels its generation directly: chat completions through this transport go
        straight to their handler and skip the client-disconnect watcher a served app
        needs. ``ASGITransport(app=endpoint.app)`` works too, only slower.
        """
        return httpx.ASGITransport(app=self._in_process_app)

    async def _in_process_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == _CHAT_PATH and not scope.get("root_path"):
            await self._chat_completions(scope, receive, send, in_caller=True)
        else:
            await self.app(scope, receive, send)

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

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request.headers.get("authorization", ""))
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollout-trio"}]}
        )

    async def _read_json(self, declared: str | None, receive: Receive) -> Any:
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise APIError(413, f"body: {declared} bytes is over the limit of {self.max_body_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.body_timeout) as deadline:
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":  # http.disconnect: nobody to answer
                    raise APIError(400, "body: the client disconnected before sending all of it")
                chunk = message.get("body", b"")
                more = message.get("more_body", False)
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise APIError(413, f"body: over the limit of {self.max_body_bytes} bytes")
                chunks.append(chunk)
        if deadline.cancelled_caught:
            raise APIError(408, f"body: not received within body_timeout={self.body_timeout} s")
        try:
            return json.loads(chunks[0] if len(chunks) == 1 else b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"body: not valid JSON ({exc})") from None

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send, *, in_caller: bool = False) -> None:
        body: bytes | dict[str, Any]
        try:
            status, body = 200, await self._complete(scope, receive, in_caller)
        except APIError as exc:
            status, body = exc.status, exc.body()
        except Exception as exc:  # an engine failure: a 500 body, never a dropped connection
            logger.error("chat completion failed", exc_info=exc)
            status, body = 500, APIError(500, f"{type(exc).__name__}: {exc}", type="server_error").body()
        await _send_json(send, status, body)

    async def _complete(self, scope: Scope, receive: Receive, in_caller: bool) -> bytes:
        authorization = ""
        declared = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                declared = value.decode("latin-1")
        session = self._authorize(authorization)
        req = parse_request(await self._read_json(declared, receive), max_tokens_limit=self.max_tokens_limit)
        prompt = await self.template.aprompt_ids(req.messages, _offered_tools(req))
        rid = uuid.uuid4().hex
        mreq = ModelRequest(input_ids=prompt, gconfig=self._gconfig(req), rid=rid, tokenizer=self.tokenizer)
        resp = await self._generate(session, receive, mreq, in_caller)
        created = int(time.time())
        message, finish, tokens = self._output_message(req, resp)
        completion_id = f"chatcmpl-{rid}"
        messages = [m.as_openai_dict() for m in req.messages]
        session.record(
            Interaction(
                model_response=resp if len(tokens) == resp.output_len else _truncate(resp, len(tokens)),
                messages=messages,
                output_message_list=[message],
                interaction_id=completion_id,
                chat_template_type=session.chat_template_type,
                parent=session.find_parent(messages) if session.chat_template_type == "concat" else None,
            )
        )
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [self._token_logprob(t, lp) for t, lp in zip(tokens, resp.output_logprobs, strict=False)]}
        # Encoded here, so a body JSON cannot hold (a NaN logprob) is a 500 like any failure.
        return _json_bytes(
            {
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
        )

    # ---------------------------------------------------------------- helpers

    def _gconfig(self, req: ChatCompletionRequest) -> GenerationConfig:
        """The request's sampling settings over the base ones (built once per combination)."""
        max_new_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        key = (max_new_tokens, req.temperature, req.top_p)
        gconfig = self._gconfigs.get(key)
        if gconfig is None:
            changes: dict[str, Any] = {"n_samples": 1, "max_new_tokens": max_new_tokens}
            if req.temperature is not None:
                changes["temperature"] = req.temperature
                changes["greedy"] = req.temperature == 0
            if req.top_p is not None:
                changes["top_p"] = req.top_p
            gconfig = self.gconfig.new(**changes)
            if len(self._gconfigs) >= _GCONFIG_CACHE:
                self._gconfigs.clear()
            self._gconfigs[key] = gconfig
        return gconfig

    async def _generate(self, session: AgentSession, receive: Receive, mreq: ModelRequest, in_caller: bool) -> ModelResponse:
        """Run the engine call; a client disconnect or the session's end cancels (aborts) it."""
        resp: ModelResponse | None = None

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        error: Exception | None = None
        with session.generation_scope():
            if in_caller:
                # Running in the caller's task: its cancellation (the in-process
                # "disconnect") reaches the engine call directly, no watcher needed.
                try:
                    resp = await self.engine.agenerate(mreq)
                except Exception as exc:
                    error = exc
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_disconnect, nursery.cancel_scope)
                    try:
                        resp = await self.engine.agenerate(mreq)
                    except Exception as exc:  # re-raised below, outside the nursery's exception group
                        error = exc
                    nursery.cancel_scope.cancel()
        if isinstance(error, ValueError) and not isinstance(error, WorkflowContractError):
            # UnsupportedRequestError included: a setting or prompt the engine cannot honour.
            raise APIError(400, f"the engine refused the request: {error}") from None
        if error is not None:
            raise error
        if resp is None:
            raise APIError(409, "the episode's session ended or the client went away before the completion finished", code="cancelled")
        return resp

    def _output_message(self, req: ChatCompletionRequest, resp: ModelResponse) -> tuple[dict[str, Any], str, tuple[int, ...]]:
        tokens = resp.output_tokens
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        finish = _FINISH[resp.stop_reason]
        if req.stop:
            cut = _stop_cut(self.tokenizer, tokens, text, req.stop)
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

    # ---------------------------------------------------------------- error bodies

    async def _http_error(self, request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(err.body(), status_code=exc.status_code)


class _ASGIRoute:
    """A plain ASGI callable, so Starlette's ``Route`` calls it as is (not as a request handler)."""

    def __init__(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def _json_bytes(body: Any) -> bytes:
    """JSON as Starlette's ``JSONResponse`` renders it (compact, UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


async def _send_json(send: Send, status: int, body: bytes | dict[str, Any]) -> None:
    data = body if isinstance(body, bytes) else _json_bytes(body)
    headers = [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _offered_tools(req: ChatCompletionRequest) -> tuple[Tool, ...]:
    """The tools the model is offered: none with ``tool_choice="none"``."""
    return () if req.tool_choice == "none" else req.tools


def _stop_cut(tokenizer: Any, tokens: tuple[int, ...], text: str, stops: tuple[str, ...]) -> tuple[tuple[int, ...], str] | None:
    """Cut at the first stop string: the tokens up to the one completing it, the text before it."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return None
    at = min(hits)
    for k in range(1, len(tokens) + 1):
        partial = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if any(s in partial for s in stops):
            return tokens[:k], text[:at]
    return tokens, text[:at]


def _truncate(resp: ModelResponse, n: int) -> ModelResponse:
    return attrs.evolve(
        resp,
        output_tokens=resp.output_tokens[:n],
        output_logprobs=resp.output_logprobs[:n],
        output_versions=resp.output_versions[:n],
        stop_reason="stop",
    )
