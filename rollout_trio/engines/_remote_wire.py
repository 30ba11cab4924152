"""Wire-level types and body validators shared by the SGLang and vLLM backends.

A backend turns one generation *segment* into an :class:`HttpCall` and parses the
server's JSON answer into a :class:`Segment`. The validators here raise
:class:`~rollout_trio.EngineProtocolError` naming the JSON path and the rule broken, so
a malformed body never surfaces as an ``IndexError`` or ``KeyError`` deep inside.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal

import attrs

from .._config import GenerationConfig
from .._errors import EngineProtocolError
from ._version_policy import parse_version_label

__all__ = [
    "HttpCall",
    "Segment",
    "SegmentStop",
    "field",
    "int_list",
    "logprob",
    "logprob_list",
    "parse_version",
    "sampling_fields",
    "segment_seed",
]

SegmentStop = Literal["stop", "length", "tool_calls", "abort"]


@attrs.frozen
class HttpCall:
    """One HTTP request to a server: method, path, JSON body and query params."""

    method: str
    path: str
    json: Any = None
    params: dict[str, str] | None = None


@attrs.frozen(kw_only=True)
class Segment:
    """What one generation request (one segment) returned.

    ``versions`` holds one int per token when the server reports per-token weight
    versions (vLLM ``weight_versions``), else ``None``. ``server_version`` is a single
    version the server reported for the whole answer (SGLang ``meta_info.weight_version``),
    or ``None``. ``prompt_tokens`` is the server's own tokenization of a prompt it was sent
    as chat messages (vLLM images), when it reports it.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: SegmentStop
    versions: list[int] | None = None
    server_version: int | None = None
    message: str = ""
    prompt_tokens: list[int] | None = None


def sampling_fields(gconfig: GenerationConfig, *, top_k_off: int) -> dict[str, Any]:
    """The sampling fields SGLang and vLLM name alike, every one explicit.

    Sent in full so a server's model-derived defaults never apply. ``top_k_off`` is the
    server's "no top-k" value (SGLang ``-1``, vLLM ``0``). The token budget, the seed and
    anything else whose name differs is the backend's to add.
    """
    return {
        "temperature": gconfig.effective_temperature,
        "top_p": float(gconfig.top_p),
        "top_k": int(gconfig.top_k) if gconfig.top_k_active else top_k_off,
        "min_p": 0.0,
        "frequency_penalty": float(gconfig.frequency_penalty),
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": list(gconfig.stop_token_ids),
        "stop": list(gconfig.stop or ()),
        "ignore_eos": gconfig.ignore_eos,
        "skip_special_tokens": gconfig.skip_special_tokens,
        "n": 1,
    }


def segment_seed(seed: int, position: int) -> int:
    """The seed of the segment that continues a request after ``position`` output tokens.

    The first segment sends the request's own seed; a segment resumed after a pause (or a
    retry after partial output) gets a seed derived from ``(seed, position)``, so it never
    replays the first segment's random draws, and the same split gives the same samples.
    Fits a signed 64-bit integer (SGLang ``sampling_seed``, vLLM ``seed``).
    """
    if position == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def field(body: Any, *path: str | int, kind: type | tuple[type, ...] | None = None, where: str = "") -> Any:
    """``body[path[0]][path[1]]...``, checked at every step.

    Raises:
        EngineProtocolError: a step is missing or has the wrong type; the message names
            the JSON path (``where`` prefixes it, e.g. the endpoint).
    """
    cur = body
    walked = ""
    for step in path:
        walked += f"[{step!r}]"
        if isinstance(step, int):
            if not isinstance(cur, list) or not -len(cur) <= step < len(cur):
                raise EngineProtocolError(f"{where}: response{walked}: missing (expected a list with index {step})")
            cur = cur[step]
        else:
            if not isinstance(cur, dict) or step not in cur:
                raise EngineProtocolError(f"{where}: response{walked}: missing (expected an object with key {step!r})")
            cur = cur[step]
    if kind is not None and not isinstance(cur, kind):
        raise EngineProtocolError(
            f"{where}: response{walked}: must be {_kind_name(kind)}, got {type(cur).__name__} {_short(cur)}"
        )
    return cur


def int_list(value: Any, what: str) -> list[int]:
    """``value`` as a list of non-negative ints (token ids), else :class:`EngineProtocolError`."""
    if not isinstance(value, list):
        raise EngineProtocolError(f"{what}: must be a list of token ids, got {type(value).__name__}")
    for i, v in enumerate(value):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise EngineProtocolError(f"{what}[{i}]: must be a token id (int >= 0), got {_short(v)}")
    return value


def logprob_list(value: Any, what: str) -> list[float]:
    """``value`` as a list of finite log-probabilities.

    ``null``, NaN, infinities, positive values and vLLM's ``-9999.0`` (its marker for both
    "missing" and "clamped") are rejected with :class:`EngineProtocolError`.
    """
    if not isinstance(value, list):
        raise EngineProtocolError(f"{what}: must be a list of logprobs, got {type(value).__name__}")
    out: list[float] = []
    for i, v in enumerate(value):
        out.append(logprob(v, f"{what}[{i}]"))
    return out


def logprob(v: Any, what: str) -> float:
    """One finite log-probability (see :func:`logprob_list`)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise EngineProtocolError(f"{what}: must be a finite logprob, got {_short(v)}")
    f = float(v)
    if not math.isfinite(f) or f > 1e-6 or f == -9999.0:
        raise EngineProtocolError(f"{what}: must be a finite logprob <= 0 (not -9999.0), got {f!r}")
    return f


def parse_version(value: Any, what: str) -> int:
    """A server's weight-version label as an int; ``"default"`` is version 0.

    The rules are :func:`~rollout_trio.engines._version_policy.parse_version_label`'s: a
    canonical decimal integer in ``[0, 2**63 - 1]``.

    Raises:
        VersionLabelError: naming ``what`` and the rule broken (the engine takes a server
            answering such a label out of service).
    """
    return parse_version_label(value, what)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."
