"""What a workflow sends to an engine and what comes back."""

from __future__ import annotations

import itertools
import math
import os
import uuid
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from ._config import GenerationConfig
from ._errors import WorkflowContractError
from ._images import DEFAULT_MAX_IMAGE_PIXELS, check_request_images
from ._validate import int_list, is_int, is_real, only_type, rule

__all__ = ["ModelRequest", "ModelResponse", "StopReason"]

StopReason = Literal["stop", "length", "tool_calls", "abort"]
STOP_REASONS: tuple[str, ...] = ("stop", "length", "tool_calls", "abort")


_DEFAULT_GCONFIG = GenerationConfig()


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return value if type(value) is tuple else tuple(value)


def _images(value: Any) -> tuple[Any, ...]:
    # One image or a sequence of them (AReaL passes lists, or None for none).
    if type(value) is tuple:
        return value
    if value is None:
        return ()
    if isinstance(value, (list, Iterable)) and not isinstance(value, (str, bytes, bytearray, memoryview)) and not hasattr(value, "getpixel"):
        return tuple(value)
    return (value,)


def _floats(value: Iterable[float]) -> tuple[float, ...]:
    return value if type(value) is tuple else tuple(value)


class _RidSource:
    """Request ids unique across processes: a random per-process prefix and a counter.

    ``uuid4`` reads the OS's random source on every call (a system call per request);
    this costs a counter step. A forked child draws a new prefix.
    """

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = uuid.uuid4().hex[:20]
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):012x}"


_new_rid = _RidSource()


@attrs.frozen(kw_only=True)
class ModelRequest:
    """One generation request.

    ``rid`` identifies the request to the engine (affinity, and the id its abort uses);
    ``metadata`` is passed through untouched. The request is immutable: engines that
    resume after an interruption build their own copies.

    Args:
        input_ids: the prompt's token ids (ints >= 0).
        gconfig: the sampling settings.
        rid: the request id (default: a new unique one).
        tokenizer: decodes the answer where an engine or workflow needs text (not compared).
        metadata: anything the caller wants carried along (not compared).
        image_data: the prompt's images in placeholder order (``PIL`` images, encoded
            bytes, base64 strings or ``data:image/`` URLs, or file paths; stored decoded, as
            RGB ``PIL`` images); needs ``processor``.
        processor: the processor that made the image placeholders in ``input_ids``.
        multi_modal_input: that processor's tensors for these images (``pixel_values``,
            ``image_grid_thw``, ...), so that a local engine does not process them again.
        max_image_pixels: the pixel budget of one image.
        vision_msg_vllm: (AReaL's name) the chat messages a vLLM server is sent.

    Raises:
        WorkflowContractError: a field breaks its rule (a negative or non-int token id).
        ImageInputError: an image field breaks its rule (named in the message).
    """

    input_ids: tuple[int, ...] = attrs.field(converter=_ints)
    gconfig: GenerationConfig = attrs.field(default=_DEFAULT_GCONFIG)  # immutable: one shared default is safe
    rid: str = attrs.field(factory=_new_rid)
    tokenizer: Any = attrs.field(default=None, eq=False, repr=False)
    metadata: dict[str, Any] = attrs.field(factory=dict, eq=False)
    image_data: tuple[Any, ...] = attrs.field(default=(), converter=_images, eq=False, repr=False)
    processor: Any = attrs.field(default=None, eq=False, repr=False)
    multi_modal_input: dict[str, Any] | None = attrs.field(default=None, eq=False, repr=False)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    vision_msg_vllm: list[Any] | None = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # One check of every field; the per-field rules only run to name what failed.
        ids = self.input_ids
        if (not ids or _plain_token_ids(ids)) and type(self.gconfig) is GenerationConfig and type(self.rid) is str and self.rid:
            if not self.image_data and self.multi_modal_input is None and self.max_image_pixels is DEFAULT_MAX_IMAGE_PIXELS:
                return
        else:
            _REQUEST_RULES.check(self)
        images = check_request_images(self.image_data, ids, self.processor, self.multi_modal_input, self.max_image_pixels)
        object.__setattr__(self, "image_data", images)

    def copy(self, **changes: Any) -> ModelRequest:
        """A copy with ``changes`` applied (a fresh ``metadata`` dict)."""
        changes.setdefault("metadata", dict(self.metadata))
        return attrs.evolve(self, **changes)


def _plain_token_ids(values: tuple[Any, ...]) -> bool:
    """Non-empty ``values`` are all plain ``int`` s >= 0 (two passes in C)."""
    return set(map(type, values)) == _INT and min(values) >= 0


_INT = {int}
_FLOAT = {float}


class _Rules:
    """attrs-style validators of a class, run one by one to name the field that fails."""

    def __init__(self, cls: type, rules: dict[str, Any]) -> None:
        self.rules = [(attribute, rules[attribute.name]) for attribute in attrs.fields(cls) if attribute.name in rules]

    def check(self, instance: Any) -> None:
        for attribute, validate in self.rules:
            validate(instance, attribute, getattr(instance, attribute.name))


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

    Args:
        input_tokens: the prompt's token ids.
        output_tokens: the generated token ids.
        output_logprobs: one finite log-probability <= 0 per generated token.
        output_versions: one integer weight version per generated token.
        stop_reason: why it ended: ``"stop"``, ``"length"``, ``"tool_calls"`` or ``"abort"``.
        latency: seconds the whole call took (finite, >= 0).
        ttft: seconds to the first output token (finite, >= 0).
        tokenizer: decodes the tokens where text is needed (not compared).

    Raises:
        WorkflowContractError: a field breaks its rule, or the per-token lists differ in length.
    """

    input_tokens: tuple[int, ...] = attrs.field(converter=_ints)
    output_tokens: tuple[int, ...] = attrs.field(converter=_ints)
    output_logprobs: tuple[float, ...] = attrs.field(converter=_floats)
    output_versions: tuple[int, ...] = attrs.field(converter=_ints)
    stop_reason: StopReason = "stop"
    latency: float = 0.0
    ttft: float = 0.0
    tokenizer: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # One check of every field (a few passes in C over each list); the per-field rules
        # only run to name what failed.
        out, lps, vers = self.output_tokens, self.output_logprobs, self.output_versions
        n = len(out)
        if (
            len(lps) == n
            and len(vers) == n
            and (not self.input_tokens or _plain_token_ids(self.input_tokens))
            and (not n or (_plain_token_ids(out) and set(map(type, vers)) == _INT))
            and (not n or (set(map(type, lps)) == _FLOAT and max(lps) <= 1e-6 and math.isfinite(sum(lps))))
            and self.stop_reason in STOP_REASONS
            and type(self.latency) is float and 0.0 <= self.latency < math.inf
            and type(self.ttft) is float and 0.0 <= self.ttft < math.inf
        ):
            return
        _RESPONSE_RULES.check(self)
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

    @classmethod
    def from_engine(
        cls,
        *,
        input_tokens: tuple[int, ...],
        output_tokens: tuple[int, ...],
        output_logprobs: tuple[float, ...],
        output_versions: tuple[int, ...],
        stop_reason: StopReason = "stop",
        latency: float = 0.0,
        ttft: float = 0.0,
        tokenizer: Any = None,
    ) -> ModelResponse:
        """A response an engine built from values it has already checked, without checking again.

        For engines only (a server's answer is checked where it is parsed): the fields
        must already be tuples obeying the class's rules. Costs what a plain dataclass
        costs; user code builds responses with the checking constructor.
        """
        self = object.__new__(cls)
        setattr_ = object.__setattr__
        setattr_(self, "input_tokens", input_tokens)
        setattr_(self, "output_tokens", output_tokens)
        setattr_(self, "output_logprobs", output_logprobs)
        setattr_(self, "output_versions", output_versions)
        setattr_(self, "stop_reason", stop_reason)
        setattr_(self, "latency", latency)
        setattr_(self, "ttft", ttft)
        setattr_(self, "tokenizer", tokenizer)
        return self


_REQUEST_RULES = _Rules(
    ModelRequest,
    {
        "input_ids": int_list,
        "gconfig": rule("a GenerationConfig", lambda v: isinstance(v, GenerationConfig)),
        "rid": rule("a non-empty str", lambda v: isinstance(v, str) and v != ""),
    },
)
_RESPONSE_RULES = _Rules(
    ModelResponse,
    {
        "input_tokens": int_list,
        "output_tokens": int_list,
        "output_logprobs": _logprob_list,
        "output_versions": _version_list,
        "stop_reason": rule(f"one of {STOP_REASONS}", lambda v: v in STOP_REASONS),
        "latency": rule("latency >= 0", lambda v: is_real(v) and v >= 0),
        "ttft": rule("ttft >= 0", lambda v: is_real(v) and v >= 0),
    },
)
