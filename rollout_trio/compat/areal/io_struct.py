"""``areal.api.io_struct``: ``ModelRequest`` (ours) and a list-typed ``ModelResponse``.

AReaL workflows build sequences with list arithmetic (``[0.0] * n + resp.output_logprobs``)
and compare slices with lists (``resp.input_tokens[:-n] == seq``); our responses hold
tuples, so the compat engine (:mod:`.engine_api`) hands workflows this list-typed copy.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..._io import ModelRequest
from ..._io import ModelResponse as NativeResponse

__all__ = ["ModelRequest", "ModelResponse"]


@attrs.define(kw_only=True)
class ModelResponse:
    """AReaL's ``ModelResponse``: the same fields as ours, with ``list`` sequences."""

    input_tokens: list[int] = attrs.field(factory=list)
    output_tokens: list[int] = attrs.field(factory=list)
    output_logprobs: list[float] = attrs.field(factory=list)
    output_versions: list[int] = attrs.field(factory=list)
    stop_reason: str = "stop"
    latency: float = 0.0
    ttft: float = 0.0
    tokenizer: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def input_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        """Number of generated tokens."""
        return len(self.output_tokens)

    @classmethod
    def from_native(cls, resp: NativeResponse) -> ModelResponse:
        """A list-typed copy of our response."""
        return cls(
            input_tokens=list(resp.input_tokens), output_tokens=list(resp.output_tokens),
            output_logprobs=list(resp.output_logprobs), output_versions=list(resp.output_versions),
            stop_reason=resp.stop_reason, latency=resp.latency, ttft=resp.ttft, tokenizer=resp.tokenizer,
        )  # fmt: skip

    def to_native(self) -> NativeResponse:
        """Our (checked, tuple-typed) response with these values.

        Raises:
            WorkflowContractError: a field breaks ``ModelResponse``'s rules.
        """
        return NativeResponse(
            input_tokens=self.input_tokens, output_tokens=self.output_tokens, output_logprobs=self.output_logprobs,
            output_versions=self.output_versions, stop_reason=self.stop_reason,  # type: ignore[arg-type]
            latency=self.latency, ttft=self.ttft, tokenizer=self.tokenizer,
        )  # fmt: skip
