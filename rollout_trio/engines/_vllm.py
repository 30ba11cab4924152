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

__all__ = ["TITO_PATH", "VLLMBackend", "parse_weight_versions", "server_request_id"]

TITO_PATH = "/inference/v1/generate"
TITO_ABORT_PATH = "/inference/v1/abort_requests"
COMPLETIONS_PATH = "/v1/completions"

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
    ) -> HttpCall:
        """The generation call for one segment (``seed``: see :func:`sampling_params`).

        Raises:
            UnsupportedRequestError: ``image_data`` given (vLLM takes images only in chat
                messages, which carry no token ids; serve a VLM with SGLang).
        """
        if image_data:
            raise UnsupportedRequestError(
                "ModelRequest.image_data: vLLM's token-in APIs take no images (only chat messages do, without "
                "token ids or per-token logprobs of a given prompt); serve a vision model with SGLang"
            )
        sp = sampling_params(gconfig, max_new=max_new, min_new=min_new, seed=seed)
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

    def parse(self, body: Any) -> Segment:
        """Parse a generation answer of this backend's flavour."""
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
        """Reload weights (through ``reload_path``, when set) and label them ``str(version)``."""
        calls = []
        if reload_path is not None:
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
