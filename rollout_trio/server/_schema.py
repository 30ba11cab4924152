"""The request bodies ``rollout-trio serve`` accepts: one schema, attrs classes built by cattrs.

Scalars are structured strictly (``"8"`` is not an integer, ``true`` is not a number), and
the value rules are :class:`~rollout_trio.GenerationConfig`'s own validators, so the server
and the command line refuse the same values (``temperature: -1``, ``NaN``, ...).
:func:`parse_body` turns every failure into one :class:`BadRequest` whose message names
the field by its JSON path and the rule it broke.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, get_args, get_origin

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn
from cattrs.v import transform_error

from .._config import GenerationConfig
from .._errors import WorkflowContractError
from .._http import TypeRule, strict_converter
from .._validate import int_list, is_int, only_type, rule
from ..engines._version_policy import parse_version_label

__all__ = [
    "AbortBody",
    "BadRequest",
    "GenerateBody",
    "PauseBody",
    "SamplingParams",
    "UpdateFromDiskBody",
    "UpdateVersionBody",
    "parse_body",
]

T = TypeVar("T")

_rules: dict[str, Any] = {a.name: a.validator for a in attrs.fields(GenerationConfig)}


class BadRequest(Exception):
    """A request the server refuses with HTTP 400; the message names the field and rule."""


#: Client strings the server keeps (request ids, in /stats and its counters) or echoes in
#: every answer (version labels) are bounded: a client must not grow the server's memory.
MAX_RID_CHARS = 256
MAX_LABEL_CHARS = 128
MAX_PATH_CHARS = 4096
#: Images one /generate request may carry (each base64 or a data:image/ URL; no files, no URLs).
MAX_IMAGES = 32


def _non_empty_str(text: str, most: int) -> Any:
    return rule(f"{text} of at most {most} characters", lambda v: isinstance(v, str) and 0 < len(v) <= most)


def _optional_str(most: int) -> Any:
    return rule(f"null or a string of at most {most} characters", lambda v: v is None or len(v) <= most)


def _is_label(v: Any) -> bool:
    try:
        parse_version_label(v, "label")
    except ValueError:
        return False
    return True


#: A weight-version label: the engine's rules (rollout_trio.engines._version_policy).
_LABEL_RULE = "'default' or a canonical decimal integer in [0, 2**63 - 1] (ASCII digits, no sign, no leading zero, no space, no '_')"


def _label(optional: bool) -> Any:
    text = ("null or " if optional else "") + _LABEL_RULE
    return rule(text, lambda v: (optional and v is None) or (isinstance(v, str) and _is_label(v)))


def _ids(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        int_list(instance, attribute, value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """SGLang ``sampling_params``. The neutral-only fields accept their neutral value alone."""

    max_new_tokens: int = attrs.field(default=128, validator=_rules["max_new_tokens"])
    min_new_tokens: int = attrs.field(default=0, validator=_rules["min_new_tokens"])
    temperature: float = attrs.field(default=1.0, validator=_rules["temperature"])
    top_p: float = attrs.field(default=1.0, validator=_rules["top_p"])
    # SGLang's "off" is -1 (0 is accepted too); from 1 up, GenerationConfig's rule.
    top_k: int = attrs.field(default=-1, validator=rule("top_k == -1, 0 or >= 1", lambda v: is_int(v) and v >= -1))
    stop_token_ids: list[int] | None = attrs.field(default=None, validator=_ids)
    stop: Any = attrs.field(
        default=None,
        validator=rule(
            "None, a string or a list of strings",
            lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
        ),
    )
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    frequency_penalty: float = attrs.field(default=0.0, validator=_rules["frequency_penalty"])
    sampling_seed: int | None = None
    min_p: float = attrs.field(default=0.0, validator=rule("min_p == 0 (only 0 is supported)", lambda v: v == 0))
    presence_penalty: float = attrs.field(
        default=0.0, validator=rule("presence_penalty == 0 (only 0 is supported)", lambda v: v == 0)
    )
    repetition_penalty: float = attrs.field(
        default=1.0, validator=rule("repetition_penalty == 1 (only 1 is supported)", lambda v: v == 1)
    )
    n: int = attrs.field(default=1, validator=rule("n == 1 (batches are not supported)", lambda v: v == 1))

    def gconfig(self) -> GenerationConfig:
        """The equivalent :class:`GenerationConfig` (``temperature <= 1e-5`` means greedy)."""
        greedy = self.temperature <= 1e-5
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=1.0 if greedy else self.temperature,
            greedy=greedy,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k >= 1 else GenerationConfig().top_k,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=self.stop or None,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            frequency_penalty=self.frequency_penalty,
            seed=self.sampling_seed,
        )


@attrs.frozen(kw_only=True)
class GenerateBody:
    """``POST /generate``: token ids in (text and batches are not supported)."""

    input_ids: list[int] = attrs.field(
        validator=[rule("a non-empty list of token ids", lambda v: len(v) > 0), _rules["stop_token_ids"]]
    )
    rid: str | None = attrs.field(default=None, validator=_optional_str(MAX_RID_CHARS))
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    stream: bool = attrs.field(default=False, validator=rule("false (streaming is not supported)", lambda v: not v))
    #: SGLang's ``image_data``: one image or a list, each base64 or a ``data:image/...;base64,`` URL.
    image_data: Any = attrs.field(
        default=None,
        validator=rule(
            f"null, a base64 string or a list of at most {MAX_IMAGES} of them",
            lambda v: v is None or isinstance(v, str)
            or (isinstance(v, list) and len(v) <= MAX_IMAGES and all(isinstance(s, str) for s in v)),
        ),
    )

    def images(self) -> list[str]:
        """``image_data`` as a list."""
        if self.image_data is None:
            return []
        return [self.image_data] if isinstance(self.image_data, str) else list(self.image_data)


@attrs.frozen(kw_only=True)
class AbortBody:
    """``POST /abort_request``: one ``rid``, or ``abort_all``."""

    rid: str | None = attrs.field(default=None, validator=_optional_str(MAX_RID_CHARS))
    abort_all: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.abort_all and not self.rid:
            raise WorkflowContractError("AbortBody.rid: must satisfy a non-empty string (or send abort_all: true)")


@attrs.frozen(kw_only=True)
class PauseBody:
    """``POST /pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


@attrs.frozen(kw_only=True)
class UpdateFromDiskBody:
    """``POST /update_weights_from_disk``."""

    model_path: str = attrs.field(validator=_non_empty_str("a non-empty string", MAX_PATH_CHARS))
    weight_version: str | None = attrs.field(default=None, validator=_label(optional=True))
    abort_all_requests: bool = False
    load_format: str | None = attrs.field(default=None, validator=_optional_str(MAX_LABEL_CHARS))
    flush_cache: bool = True


@attrs.frozen(kw_only=True)
class UpdateVersionBody:
    """``POST /update_weight_version``."""

    new_version: str = attrs.field(validator=_label(optional=False))
    abort_all_requests: bool = False


def _make_converter() -> cattrs.Converter:
    conv = strict_converter()
    conv.register_structure_hook_func(lambda t: t == list[int], lambda v, _t: _strict_ids(v))
    # Unknown sampling settings are refused (they would be silently ignored otherwise);
    # unknown top-level keys are ignored, as SGLang does.
    conv.register_structure_hook(
        SamplingParams, make_dict_structure_fn(SamplingParams, conv, _cattrs_forbid_extra_keys=True)
    )
    return conv


def _strict_ids(value: Any) -> list[int]:
    """A list of ints (element rules, such as >= 0, are the field's validator)."""
    if not isinstance(value, list):
        raise TypeRule(f"must be a list of token ids, got {_clip(repr(value))} ({type(value).__name__})")
    if only_type(value, int):  # the common case, checked in C
        return value
    for i, v in enumerate(value):
        if not is_int(v):
            raise TypeRule(f"[{i}]: must be an integer token id, got {_clip(repr(v))} ({type(v).__name__})")
    return [int(v) for v in value]


_converter = _make_converter()


def _format(exc: BaseException, t: Any) -> str:
    if isinstance(exc, (TypeRule, WorkflowContractError)):
        return str(exc)
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unsupported keys {sorted(exc.extra_fields)}"
    if get_origin(t) is Literal:
        return f"must be one of {list(get_args(t))}"
    if isinstance(exc, AttributeError) and attrs.has(t):  # not a mapping
        return "must be a JSON object"
    return f"invalid value ({type(exc).__name__} {exc})"


def parse_body(cls: type[T], data: Any, where: str) -> T:
    """Structure ``data`` (decoded JSON) as ``cls``.

    Raises:
        BadRequest: ``where: path.to.field: rule, got value`` for every broken rule.
    """
    if isinstance(data, cls):  # structured already (off the event loop, by the HTTP layer)
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadRequest(f"{where}: the body must be a JSON object, got {type(data).__name__}")
    try:
        return _converter.structure(data, cls)
    except WorkflowContractError as exc:  # a class-level rule (raised by cls's __init__)
        raise BadRequest(f"{where}: {_clip(_strip_class(str(exc)))}") from None
    except (cattrs.BaseValidationError, TypeRule) as exc:
        messages = transform_error(exc, path="$", format_exception=_format)
        raise BadRequest(f"{where}: " + "; ".join(_clip(_reword(m)) for m in messages)) from None


_MESSAGE_CHARS = 400


def _clip(message: str) -> str:
    """A message quoting at most a few hundred characters of a client's value."""
    return message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS] + "... (cut)"


def _strip_class(message: str) -> str:
    """``SamplingParams.temperature: ...`` -> ``temperature: ...`` (the class is ours, not the client's)."""
    head, sep, rest = message.partition(": ")
    if sep and "." in head and " " not in head:
        return head.split(".", 1)[1] + sep + rest
    return message


def _reword(message: str) -> str:
    """cattrs' ``rule @ $.a.b`` as ``a.b: rule`` (a validator's own field name is not repeated)."""
    text, _, path = message.rpartition(" @ ")
    path = path.removeprefix("$").removeprefix(".")
    text = _strip_class(text)
    head, sep, rest = text.partition(": ")
    if sep and " " not in head and not head.startswith("["):  # "temperature: must ..." from a validator
        path = f"{path}.{head}" if path else head
        text = rest
    if text.startswith("["):  # an element of a list: "[2]: must ..."
        index, _, text = text.partition(": ")
        path += index
    path = path.replace(".[", "[")
    return f"{path}: {text}" if path else text
