"""SGLang's native HTTP protocol: request bodies and response parsing.

Generation is ``POST /generate`` with ``input_ids``, every sampling field sent explicitly
(so the server's model-derived defaults never apply), ``return_logprob`` and a ``rid`` so
the request can be aborted with ``POST /abort_request``. Logprobs are SGLang's default:
``log_softmax(logits / T)`` of the sampled token, the trainer's convention.
"""

from __future__ import annotations

from math import isfinite
from typing import Any

from .._config import GenerationConfig
from .._errors import EngineProtocolError, UnsupportedRequestError
from ._remote_wire import HttpCall, Segment, SegmentStop, field, logprob, parse_version, sampling_fields

__all__ = ["SGLangBackend"]

_STOPS: dict[str, SegmentStop] = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "tool_calls"}


class SGLangBackend:
    """Builds and parses SGLang requests. Stateless."""

    name = "sglang"
    reports_token_versions = False

    def check(self, gconfig: GenerationConfig) -> None:
        """Reject settings SGLang cannot honour (beam search)."""
        if gconfig.use_beam_search:
            raise UnsupportedRequestError("GenerationConfig.use_beam_search: SGLang has no beam search")

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
        """The ``/generate`` call for one segment, seeded with ``seed`` (else ``gconfig.seed``)
        as ``sampling_seed``; ``image_data`` (base64 images, in placeholder order) goes as
        SGLang's ``image_data``."""
        sp: dict[str, Any] = {
            "max_new_tokens": max_new,
            "min_new_tokens": min_new,
            **sampling_fields(gconfig, top_k_off=-1),
        }
        if seed is None:
            seed = gconfig.seed
        if seed is not None:
            sp["sampling_seed"] = int(seed)
        body = {
            "rid": rid,
            "input_ids": list(input_ids),
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if image_data:
            body["image_data"] = list(image_data)
        return HttpCall("POST", "/generate", body)

    def parse(self, body: Any) -> Segment:
        """Parse a ``/generate`` answer.

        Raises:
            EngineProtocolError: a field is missing, mistyped or inconsistent.
        """
        where = "SGLang /generate"
        # The well-formed case looked up directly; anything else through field(), which
        # raises naming the JSON path.
        meta = body.get("meta_info") if type(body) is dict else None
        if type(meta) is not dict:
            meta = field(body, "meta_info", kind=dict, where=where)
        fr = meta.get("finish_reason")
        if type(fr) is not dict:
            fr = field(meta, "finish_reason", kind=dict, where=where + " meta_info")
        kind = fr.get("type")
        if type(kind) is not str:
            kind = field(fr, "type", kind=str, where=where + " meta_info.finish_reason")
        if kind not in _STOPS:
            raise EngineProtocolError(f"{where}: meta_info.finish_reason.type: unknown value {kind!r}")
        message = fr.get("message") or ""
        if not isinstance(message, str):
            message = str(message)
        raw = meta.get("output_token_logprobs")
        if raw is None:
            if kind != "abort":
                raise EngineProtocolError(f"{where}: meta_info.output_token_logprobs: missing in a {kind!r} answer")
            raw = []
        if not isinstance(raw, list):
            raise EngineProtocolError(f"{where}: meta_info.output_token_logprobs: must be a list")
        tokens: list[int] = []
        logprobs: list[float] = []
        for i, entry in enumerate(raw):
            if type(entry) is list and len(entry) >= 2:  # fast path: the well-formed case
                lp, tid = entry[0], entry[1]
                if type(tid) is int and tid >= 0 and type(lp) is float and isfinite(lp) and -9999.0 != lp <= 1e-6:
                    tokens.append(tid)
                    logprobs.append(lp)
                    continue
            what = f"{where}: meta_info.output_token_logprobs[{i}]"
            if not isinstance(entry, list) or len(entry) < 2:
                raise EngineProtocolError(f"{what}: must be [logprob, token_id, text]")
            tid = entry[1]
            if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0:
                raise EngineProtocolError(f"{what}[1]: must be a token id (int >= 0), got {tid!r}")
            tokens.append(tid)
            logprobs.append(logprob(entry[0], f"{what}[0]"))
        server_version = None
        wv = meta.get("weight_version")
        if wv is not None:  # a bad label is the server's disagreement (VersionLabelError): the engine takes it out
            server_version = parse_version(wv, f"{where}: meta_info.weight_version")
        return Segment(
            tokens=tokens, logprobs=logprobs, stop_reason=_STOPS[kind], server_version=server_version, message=message
        )

    def abort(self, rid: str) -> HttpCall:
        """Abort one request by its ``rid``."""
        return HttpCall("POST", "/abort_request", {"rid": rid})

    def pause(self) -> list[HttpCall]:
        """Pause generation in abort mode (in-flight requests return partial output)."""
        return [HttpCall("POST", "/pause_generation", {"mode": "abort"})]

    def resume(self) -> list[HttpCall]:
        """Continue generation."""
        return [HttpCall("POST", "/continue_generation", {})]

    def update_from_disk(self, path: str, version: int) -> list[HttpCall]:
        """Reload weights from ``path`` and label them ``str(version)``."""
        return [
            HttpCall(
                "POST",
                "/update_weights_from_disk",
                {"model_path": path, "abort_all_requests": True, "weight_version": str(version)},
            )
        ]

    def label(self, version: int) -> list[HttpCall]:
        """Label the weights the server holds ``str(version)`` (loads nothing)."""
        return [HttpCall("POST", "/update_weight_version", {"new_version": str(version), "abort_all_requests": False})]

    @property
    def can_reload(self) -> bool:
        """Whether this engine can load a checkpoint into the server over HTTP."""
        return True

    def health(self) -> HttpCall:
        """The health check."""
        return HttpCall("GET", "/health")

    def version(self) -> HttpCall:
        """Reads the server's weight version (``weight_version`` in ``/get_model_info``)."""
        return HttpCall("GET", "/get_model_info")
