"""vLLM's HTTP protocols: token-in/token-out and OpenAI completions.

Two generation endpoints, chosen per server at start (see ``RemoteEngine``):

* ``POST /inference/v1/generate`` (vLLM >= 0.32 with ``--enable-scale-out``): token ids
  in, token ids out, and per-token ``weight_versions`` ranges. The server's request id is
  ours prefixed with ``generate-tokens-``; that is the id its abort endpoint
  ``POST /inference/v1/abort_requests`` needs (the client's own id is silently ignored,
  and the abort's 200 proves nothing).
* ``POST /v1/completions`` with a token-id ``prompt``, ``logprobs: 0`` and
  ``return_tokens_as_token_ids`` (older servers). Tokens come back as ``"token_id:N"``
  strings; there is no abort endpoint, so an abort is closing the connection.

Images: vLLM's token-in APIs take none; a vision request goes, as AReaL sends it, to
``POST /v1/chat/completions`` with the request's chat messages (``vision_msg_vllm``) whose
``image_url`` parts carry the request's images as ``data:`` URLs, ``logprobs: true`` and
``return_tokens_as_token_ids``. The server applies its own chat template, so the answer's
``prompt_token_ids`` (``return_token_ids``, vLLM >= 0.10.2) are checked against the
request's ``input_ids``: a prompt the server tokenized otherwise would misalign every
token the trainer sees, and is an error naming the first position that differs. Chat
messages cannot continue a partial answer, so an aborted vision answer is generated again
from the start (see ``Segments``).

Logprobs: vLLM reports what ``--logprobs-mode`` says (``raw_logprobs`` by default, before
temperature); run the server with ``--logprobs-mode processed_logprobs`` to get the
trainer's ``log_softmax(logits / T)``. With top-k or top-p active, the processed logprobs
are renormalised over the kept tokens and no longer match the trainer.
"""

from __future__ import annotations

from typing import Any

from .._config import GenerationConfig
from .._errors import EngineProtocolError, EngineServerError, UnsupportedRequestError
from ._remote_wire import (
    HttpCall,
    Segment,
    SegmentStop,
    field,
    int_list,
    logprob,
    logprob_list,
    parse_version,
    sampling_fields,
)

__all__ = ["CHAT_PATH", "RELOAD_RPC_PATH", "TITO_PATH", "VLLMBackend", "parse_chat", "parse_weight_versions", "server_request_id"]

TITO_PATH = "/inference/v1/generate"
TITO_ABORT_PATH = "/inference/v1/abort_requests"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
#: vLLM's dev-mode RPC route; ``reload_weights`` through it loads a checkpoint in place.
RELOAD_RPC_PATH = "/collective_rpc"

# "repetition" (vLLM's repetition detection) ends generation like a stop condition.
_STOPS: dict[str, SegmentStop] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "tool_calls": "tool_calls",
    "repetition": "stop",
}


def server_request_id(request_id: str) -> str:
    """The id a vLLM token-in/token-out server gives the request we sent as ``request_id``."""
    return f"generate-tokens-{request_id}"


def sampling_params(
    gconfig: GenerationConfig, *, max_new: int, min_new: int, seed: int | None = None
) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields, every one explicit (no server defaults apply);
    ``seed`` (else ``gconfig.seed``) as ``seed``."""
    sp: dict[str, Any] = {
        "max_tokens": max_new,
        "min_tokens": min_new,
        **sampling_fields(gconfig, top_k_off=0),
        "logprobs": 0,
    }
    if seed is None:
        seed = gconfig.seed
    if seed is not None:
        sp["seed"] = int(seed)
    return sp


def parse_weight_versions(ranges: Any, n_tokens: int, where: str) -> list[int]:
    """Expand ``[{version, start, end}, ...]`` into one int version per output token.

    Raises:
        EngineProtocolError: the ranges do not tile ``[0, n_tokens)`` in order, or a
            version is neither ``"default"`` (= 0) nor an integer string.
    """
    if not isinstance(ranges, list):
        raise EngineProtocolError(f"{where}: weight_versions: must be a list of ranges, got {type(ranges).__name__}")
    out: list[int] = []
    for i, r in enumerate(ranges):
        what = f"{where}: weight_versions[{i}]"
        start = field(r, "start", kind=int, where=what)
        end = field(r, "end", kind=int, where=what)
        version = parse_version(field(r, "version", where=what), what + ".version")
        if start != len(out) or not start <= end <= n_tokens:
            raise EngineProtocolError(
                f"{what}: ranges must tile the output ({n_tokens} tokens) in order; "
                f"expected start {len(out)}, got [{start}, {end})"
            )
        out.extend([version] * (end - start))
    if len(out) != n_tokens:
        raise EngineProtocolError(f"{where}: weight_versions: cover {len(out)} tokens, the output has {n_tokens}")
    return out


class VLLMBackend:
    """Builds and parses vLLM requests for one API flavour (``"tito"`` or ``"completions"``)."""

    name = "vllm"

    def __init__(self, api: str = "tito") -> None:
        if api not in ("tito", "completions"):
            raise ValueError(f"VLLMBackend.api: must be 'tito' or 'completions', got {api!r}")
        self.api = api

    @property
    def reports_token_versions(self) -> bool:
        """Whether answers carry per-token weight versions."""
        return self.api == "tito"

    @property
    def can_abort(self) -> bool:
        """Whether the server has an abort endpoint (else closing the connection aborts)."""
        return self.api == "tito"

    def check(self, gconfig: GenerationConfig) -> None:
        """Nothing vLLM refuses up front."""

    def generate(
        self,
        input_ids: list[int],
        gconfig: GenerationConfig,
        *,
        max_new: int,
        min_new: int,
        rid: str,
        seed: int | None = None,
        image_data: list[str] | None = None,
        messages: list[Any] | None = None,
    ) -> HttpCall:
        """The generation call for one segment (``seed``: see :func:`sampling_params`).

        With ``image_data`` (base64 images, in placeholder order) it is a chat call of
        ``messages`` (AReaL's ``vision_msg_vllm``) with the images in its ``image_url``
        parts (see the module's docstring).

        Raises:
            UnsupportedRequestError: ``image_data`` without ``messages``, or messages whose
                ``image_url`` parts are not as many as the images.
        """
        sp = sampling_params(gconfig, max_new=max_new, min_new=min_new, seed=seed)
        if image_data:
            return self._chat(sp, image_data, messages)
        if self.api == "tito":
            return HttpCall("POST", TITO_PATH, {"request_id": rid, "token_ids": list(input_ids), "sampling_params": sp})
        body = dict(sp)
        body.update(
            prompt=list(input_ids),
            return_tokens_as_token_ids=True,
            return_token_ids=True,
            use_beam_search=gconfig.use_beam_search,
            stream=False,
        )
        return HttpCall("POST", COMPLETIONS_PATH, body)

    def _chat(self, sp: dict[str, Any], images: list[str], messages: list[Any] | None) -> HttpCall:
        if not messages:
            raise UnsupportedRequestError(
                "ModelRequest.vision_msg_vllm: vLLM takes images only in chat messages; give the request's chat "
                "messages (with one image_url part per image), or serve a vision model with SGLang"
            )
        if isinstance(messages[0], list):  # AReaL's layout: [messages]
            messages = messages[0]
        filled = _with_images(messages, images)
        body = {k: v for k, v in sp.items() if k != "logprobs"}
        body.update(
            messages=filled,
            logprobs=True,
            top_logprobs=0,
            return_tokens_as_token_ids=True,
            return_token_ids=True,
            add_generation_prompt=True,
            stream=False,
        )
        return HttpCall("POST", CHAT_PATH, body)

    def parse(self, body: Any) -> Segment:
        """Parse a generation answer of this backend's flavour (or a chat answer, for images)."""
        if isinstance(body, dict) and body.get("object") == "chat.completion":
            return parse_chat(body)
        return parse_tito(body) if self.api == "tito" else parse_completions(body)

    def abort(self, rid: str) -> HttpCall | None:
        """Abort one request (token-in/token-out only; completions abort by disconnecting)."""
        if self.api != "tito":
            return None
        return HttpCall("POST", TITO_ABORT_PATH, {"request_ids": [server_request_id(rid)]})

    def pause(self) -> list[HttpCall]:
        """Pause in abort mode (needs ``VLLM_SERVER_DEV_MODE=1``)."""
        return [HttpCall("POST", "/pause", None, {"mode": "abort"})]

    def resume(self) -> list[HttpCall]:
        """Resume generation."""
        return [HttpCall("POST", "/resume")]

    def update_from_disk(self, path: str, version: int, reload_path: str | None) -> list[HttpCall]:
        """Reload weights (through ``reload_path``, when set) and label them ``str(version)``.

        ``/collective_rpc`` (vLLM's dev-mode route, ``VLLM_SERVER_DEV_MODE=1``) runs the
        workers' ``reload_weights`` with ``weights_path``: the checkpoint loads in place,
        into the running server, on the CPU build too. Any other path gets AReaL's body,
        ``{"model_path": path}``.
        """
        calls = []
        if reload_path == RELOAD_RPC_PATH:
            calls.append(HttpCall("POST", reload_path, {"method": "reload_weights", "kwargs": {"weights_path": path}}))
        elif reload_path is not None:
            calls.append(HttpCall("POST", reload_path, {"model_path": path}))
        return [*calls, *self.label(version)]

    def label(self, version: int) -> list[HttpCall]:
        """Label the weights the server holds ``str(version)`` (loads nothing)."""
        return [HttpCall("POST", "/update_weight_version", {"new_version": str(version)})]

    def health(self) -> HttpCall:
        """The health check."""
        return HttpCall("GET", "/health")

    def version(self) -> HttpCall:
        """Reads the server's weight version (``/weight_info``, with ``VLLM_SERVER_DEV_MODE=1``)."""
        return HttpCall("GET", "/weight_info")


def _stop(value: Any, where: str) -> SegmentStop:
    if value == "error":
        raise EngineServerError(f"{where}: the server ended the request with finish_reason 'error'", status_code=500)
    if not isinstance(value, str) or value not in _STOPS:
        raise EngineProtocolError(f"{where}: finish_reason: unknown value {value!r}")
    return _STOPS[value]


def parse_tito(body: Any) -> Segment:
    """Parse a ``/inference/v1/generate`` answer (one choice).

    Raises:
        EngineProtocolError: missing or mistyped fields, token ids that disagree with
            ``logprobs.content``, or ``weight_versions`` that do not cover the output.
    """
    where = "vLLM /inference/v1/generate"
    choice = field(body, "choices", 0, kind=dict, where=where)
    stop = _stop(choice.get("finish_reason"), where + " choices[0]")
    tokens = int_list(field(choice, "token_ids", where=where + " choices[0]"), where + ": choices[0].token_ids")
    content = field(choice, "logprobs", "content", kind=list, where=where + " choices[0]")
    if len(content) != len(tokens):
        raise EngineProtocolError(
            f"{where}: choices[0].logprobs.content has {len(content)} entries for {len(tokens)} token_ids"
        )
    logprobs: list[float] = []
    for i, (entry, tid) in enumerate(zip(content, tokens, strict=True)):
        what = f"{where}: choices[0].logprobs.content[{i}]"
        got = field(entry, "token_id", kind=int, where=what)
        if got != tid:
            raise EngineProtocolError(f"{what}.token_id: {got} disagrees with token_ids[{i}] = {tid}")
        logprobs.append(logprob(field(entry, "logprob", where=what), what + ".logprob"))
    if "weight_versions" not in choice or choice["weight_versions"] is None:
        raise EngineProtocolError(f"{where}: choices[0].weight_versions: missing")
    versions = parse_weight_versions(choice["weight_versions"], len(tokens), where + " choices[0]")
    return Segment(tokens=tokens, logprobs=logprobs, stop_reason=stop, versions=versions)


def parse_completions(body: Any) -> Segment:
    """Parse a ``/v1/completions`` answer (one choice, token-id strings or ``token_ids``).

    Raises:
        EngineProtocolError: missing or mistyped fields, unparsable ``"token_id:N"``
            strings, or token and logprob counts that differ.
    """
    where = "vLLM /v1/completions"
    choice = field(body, "choices", 0, kind=dict, where=where)
    stop = _stop(choice.get("finish_reason"), where + " choices[0]")
    lp = choice.get("logprobs")
    if lp is None:
        if stop == "abort" and not choice.get("token_ids"):
            return Segment(tokens=[], logprobs=[], stop_reason="abort")
        raise EngineProtocolError(f"{where}: choices[0].logprobs: missing (send logprobs: 0)")
    strings = field(lp, "tokens", kind=list, where=where + " choices[0].logprobs")
    values = logprob_list(
        field(lp, "token_logprobs", where=where + " choices[0].logprobs"),
        where + ": choices[0].logprobs.token_logprobs",
    )
    parsed: list[int] = []
    for i, s in enumerate(strings):
        what = f"{where}: choices[0].logprobs.tokens[{i}]"
        if not isinstance(s, str) or not s.startswith("token_id:"):
            raise EngineProtocolError(f"{what}: must be 'token_id:N' (send return_tokens_as_token_ids), got {s!r}")
        try:
            tid = int(s[len("token_id:") :])
        except ValueError:
            raise EngineProtocolError(f"{what}: must be 'token_id:N', got {s!r}") from None
        if tid < 0:
            raise EngineProtocolError(f"{what}: negative token id {tid}")
        parsed.append(tid)
    ids = choice.get("token_ids")
    if ids is not None:
        ids = int_list(ids, where + ": choices[0].token_ids")
        if ids != parsed:
            raise EngineProtocolError(f"{where}: choices[0].token_ids disagrees with choices[0].logprobs.tokens")
    if len(values) != len(parsed):
        raise EngineProtocolError(
            f"{where}: choices[0].logprobs: {len(parsed)} tokens but {len(values)} token_logprobs"
        )
    return Segment(tokens=parsed, logprobs=values, stop_reason=stop)


def _with_images(messages: list[Any], images: list[str]) -> list[Any]:
    """A copy of ``messages`` whose ``image_url`` parts carry ``images`` as data URLs, in order."""
    out: list[Any] = []
    n = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UnsupportedRequestError(f"ModelRequest.vision_msg_vllm[{i}]: must be a message object, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in ("image_url", "image"):
                    if n >= len(images):
                        raise UnsupportedRequestError(
                            f"ModelRequest.vision_msg_vllm: more image parts than the request's {len(images)} images"
                        )
                    url = f"data:image/png;base64,{images[n]}"  # what encode_image_base64 makes
                    part = {"type": "image_url", "image_url": {"url": url}}
                    n += 1
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    if n != len(images):
        raise UnsupportedRequestError(
            f"ModelRequest.vision_msg_vllm: {n} image parts for the request's {len(images)} images"
        )
    return out


def parse_chat(body: Any) -> Segment:
    """Parse a ``/v1/chat/completions`` answer sent with ``logprobs`` and token-id strings.

    ``prompt_tokens`` is the server's tokenization of the messages (``prompt_token_ids``),
    when it reports it.

    Raises:
        EngineProtocolError: missing or mistyped fields, unparsable ``"token_id:N"``
            strings, or ``token_ids`` that disagree with the logprobs' tokens.
    """
    where = "vLLM /v1/chat/completions"
    choice = field(body, "choices", 0, kind=dict, where=where)
    stop = _stop(choice.get("finish_reason"), where + " choices[0]")
    lp = choice.get("logprobs")
    if lp is None:
        if stop == "abort":
            return Segment(tokens=[], logprobs=[], stop_reason="abort")
        raise EngineProtocolError(f"{where}: choices[0].logprobs: missing (send logprobs: true)")
    content = field(lp, "content", kind=list, where=where + " choices[0].logprobs")
    tokens: list[int] = []
    logprobs: list[float] = []
    for i, entry in enumerate(content):
        what = f"{where}: choices[0].logprobs.content[{i}]"
        s = field(entry, "token", where=what)
        if not isinstance(s, str) or not s.startswith("token_id:") or not s[len("token_id:") :].isdigit():
            raise EngineProtocolError(f"{what}.token: must be 'token_id:N' (send return_tokens_as_token_ids), got {s!r}")
        tokens.append(int(s[len("token_id:") :]))
        logprobs.append(logprob(field(entry, "logprob", where=what), what + ".logprob"))
    ids = choice.get("token_ids")
    if ids is not None and int_list(ids, where + ": choices[0].token_ids") != tokens:
        raise EngineProtocolError(f"{where}: choices[0].token_ids disagrees with choices[0].logprobs.content")
    prompt = body.get("prompt_token_ids")
    return Segment(
        tokens=tokens,
        logprobs=logprobs,
        stop_reason=stop,
        prompt_tokens=None if prompt is None else int_list(prompt, where + ": prompt_token_ids"),
    )
