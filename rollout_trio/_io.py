"""What a workflow sends to an engine and what comes back."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from ._config import GenerationConfig
from ._errors import WorkflowContractError
from ._validate import int_list, is_int, is_real, only_type, rule

__all__ = ["ModelRequest", "ModelResponse", "StopReason"]

StopReason = Literal["stop", "length", "tool_calls", "abort"]
STOP_REASONS: tuple[str, ...] = ("stop", "length", "tool_calls", "abort")


_DEFAULT_GCONFIG = GenerationConfig()


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return value if type(value) is tuple else tuple(value)


def _floats(value: Iterable[float]) -> tuple[float, ...]:
    return value if type(value) is tuple else tuple(value)


def _new_rid() -> str:
    return uuid.uuid4().hex


@attrs.frozen(kw_only=True)
class ModelRequest:
    """One generation request.

    ``rid`` identifies the request to the engine (affinity, and the id its abort uses);
    ``metadata`` is passed through untouched. The request is immutable: engines that
    resume after an interruption build their own copies.
    """

    input_ids: tuple[int, ...] = attrs.field(converter=_ints, validator=int_list)
    gconfig: GenerationConfig = attrs.field(
        default=_DEFAULT_GCONFIG,  # immutable, so one shared default is safe
        validator=rule("a GenerationConfig", lambda v: isinstance(v, GenerationConfig)),
    )
    rid: str = attrs.field(factory=_new_rid, validator=rule("a non-empty str", lambda v: isinstance(v, str) and v != ""))
    tokenizer: Any = attrs.field(default=None, eq=False, repr=False)
    metadata: dict[str, Any] = attrs.field(factory=dict, eq=False)

    def copy(self, **changes: Any) -> ModelRequest:
        """A copy with ``changes`` applied (a fresh ``metadata`` dict)."""
        changes.setdefault("metadata", dict(self.metadata))
        return attrs.evolve(self, **changes)


def _version_list(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not value or only_type(value, int):
        return
    for i, v in enumerate(value):
        if not is_int(v):
            raise WorkflowContractError(
                f"{type(instance).__name__}.{attribute.name}[{i}]: must be an integer weight version, got {v!r}"
            )


def _logprob_list(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    # Fast path: plain finite floats <= 0 (the sum is finite only if every term is).
    if not value or (only_type(value, float) and max(value) <= 1e-6 and math.isfinite(sum(value))):
        return
    for i, v in enumerate(value):
        if not is_real(v) or v > 1e-6:
            raise WorkflowContractError(
                f"{type(instance).__name__}.{attribute.name}[{i}]: must be a finite log-probability <= 0, got {v!r}"
            )


@attrs.frozen(kw_only=True)
class ModelResponse:
    """The result of one (possibly resumed) generation.

    ``output_tokens``, ``output_logprobs`` and ``output_versions`` hold one entry per
    generated token; ``output_versions[i]`` is the weight version that produced token
    ``i``. ``latency`` is the wall time of the whole call and ``ttft`` the time to the
    first output token, both in seconds.
    """

    input_tokens: tuple[int, ...] = attrs.field(converter=_ints, validator=int_list)
    output_tokens: tuple[int, ...] = attrs.field(converter=_ints, validator=int_list)
    output_logprobs: tuple[float, ...] = attrs.field(converter=_floats, validator=_logprob_list)
    output_versions: tuple[int, ...] = attrs.field(converter=_ints, validator=_version_list)
    stop_reason: StopReason = attrs.field(
        default="stop", validator=rule(f"one of {STOP_REASONS}", lambda v: v in STOP_REASONS)
    )
    latency: float = attrs.field(default=0.0, validator=rule("latency >= 0", lambda v: is_real(v) and v >= 0))
    ttft: float = attrs.field(default=0.0, validator=rule("ttft >= 0", lambda v: is_real(v) and v >= 0))
    tokenizer: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        n = len(self.output_tokens)
        for name in ("output_logprobs", "output_versions"):
            got = len(getattr(self, name))
            if got != n:
                raise WorkflowContractError(
                    f"ModelResponse.{name}: must have one entry per output token "
                    f"(len(output_tokens) == {n}), got {got}"
                )

    @property
    def input_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        """Number of generated tokens."""
        return len(self.output_tokens)
