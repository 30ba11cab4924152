"""``Trajectory``: the tensor-dict contract between workflows and trainers.

Shapes and dtypes (B rows, L padded positions):

================  ===========  =====================================================
key               shape        dtype
================  ===========  =====================================================
input_ids         [B, L]       any integer (required), L >= 1, all tensors on its device
attention_mask    [B, L]       bool (required), a True in every row; integer 0/1 is cast
loss_mask         [B, L]       any integer, values 0/1, 0 wherever attention is off
logprobs          [B, L]       floating, finite, <= 0
versions          [B, L]       any integer, -1 wherever loss_mask is 0 (no output token)
rewards           [B]          floating, finite, within float32's range
is_truncated      [B]          bool
original_rewards  [B]          floating, finite, within float32's range
rollout_reward    scalar       one finite real (Python, NumPy or 0-d tensor), never bool
rollout_group     RolloutGroup row counts per logical rollout, summing to B
================  ===========  =====================================================

Any other key is an *extra*: a tensor with a leading dimension of B, a list of B
items, or any other value (kept as is). Nothing but the attention-mask cast is coerced.

Vision rows (AReaL's layout): ``multi_modal_input`` is a list of B items, each None (a
text-only row) or the dict of processor tensors of that row's images (``pixel_values``,
``image_grid_thw``, and whatever else the processor returns); ``mm_token_type_ids``
[B, L] marks the image placeholder positions with 1. A row's ``pixel_values`` must have
the rows its ``image_grid_thw`` makes, and, where ``mm_token_type_ids`` is given, its
image placeholder runs the tokens those pixel rows make (``t*h*w / 4``, Qwen-VL's 2x2
spatial merge).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ._errors import RewardValueError, WorkflowContractError
from ._images import check_multi_modal_input, placeholder_runs
from ._io import ModelResponse
from ._rollout_group import FLOAT32_MAX, RolloutGroup, as_reward_scalar
from ._util import LazyModule

if TYPE_CHECKING:
    import torch
else:  # torch loads when a tensor is checked or made, not when the name is imported
    torch = LazyModule("torch", globals())

__all__ = ["Trajectory"]

SEQUENCE_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")
ROW_KEYS = ("rewards", "is_truncated", "original_rewards")
SCALAR_KEYS = ("rollout_reward", "rollout_group")
KNOWN_KEYS = SEQUENCE_KEYS + ROW_KEYS + SCALAR_KEYS

#: Value each key is right-padded with when trajectories of different lengths are joined.
PAD_VALUES: dict[str, Any] = {"attention_mask": False, "versions": -1}

_INTEGER = "an integer dtype"
_FLOAT = "a floating dtype"
_BOOL = "torch.bool"


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _dtype_ok(kind: str, dtype: torch.dtype) -> bool:
    if kind == _INTEGER:
        return _is_integer_dtype(dtype)
    if kind == _FLOAT:
        return dtype.is_floating_point
    return dtype == torch.bool


_DTYPES = {
    "input_ids": _INTEGER,
    "attention_mask": _BOOL,
    "loss_mask": _INTEGER,
    "logprobs": _FLOAT,
    "versions": _INTEGER,
    "rewards": _FLOAT,
    "is_truncated": _BOOL,
    "original_rewards": _FLOAT,
}


# (key, dtype kind, one value per position?) for every tensor key, in validation order.
_TENSOR_KEYS = tuple((key, _DTYPES[key], key in SEQUENCE_KEYS) for key in SEQUENCE_KEYS + ROW_KEYS)
_DTYPE_OK: dict[tuple[str, torch.dtype], bool] = {}


_REWARD_KEYS = frozenset({"rewards", "original_rewards"})


def _fail(where: str, key: str, rule: str, expected: str, got: str) -> WorkflowContractError:
    # A bad reward (a string, a value float32 cannot hold, a wrong shape) is that episode's
    # bad luck: the executor rejects the task instead of stopping (RewardValueError).
    kind = RewardValueError if key in _REWARD_KEYS else WorkflowContractError
    return kind(f"{where}{key!r}: {rule}; expected {expected}, got {got}")


def _tensor(where: str, key: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _fail(where, key, "must be a torch.Tensor", "a tensor", f"{type(value).__name__}")
    return value


def _bounds(value: torch.Tensor) -> tuple[float, float]:
    # One reduction for min and max; NaN propagates into both, so it fails any bound check.
    if value.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(value)
    return float(lo), float(hi)


def _validate_values(t: Trajectory, where: str) -> None:
    """Value rules, with as few tensor reductions as possible (this runs once per slot)."""
    lo, _ = _bounds(t.input_ids)
    if lo < 0:
        raise _fail(where, "input_ids", "token ids must be non-negative", "ids >= 0", f"min {int(lo)}")
    for key in ("logprobs", "rewards", "original_rewards"):
        value = getattr(t, key)
        if value is None:
            continue
        lo, hi = _bounds(value)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            error = _fail(where, key, "values must be finite", "finite values", "NaN or inf")
            if key == "logprobs":
                raise error
            raise RewardValueError(str(error))
        if key != "logprobs" and max(-lo, hi) > FLOAT32_MAX:
            raise _fail(where, key, "rewards must fit in float32", f"|values| <= {FLOAT32_MAX:.7g}", f"min {lo}, max {hi}")
        if key == "logprobs" and hi > 1e-6:
            raise _fail(where, key, "log-probabilities must be <= 0", "values <= 0", f"max {hi}")
    if t.loss_mask is not None:
        lm = t.loss_mask
        lo, hi = _bounds(lm)
        if lo < 0 or hi > 1:
            raise _fail(where, "loss_mask", "values must be 0 or 1", "0/1", f"values {sorted(set(lm.unique().tolist()))[:5]}")
        # loss_mask is 0/1 here, so "1 where attention_mask is False" is lm > mask (2 ops).
        if hi > 0 and bool(torch.any(lm > t.attention_mask)):
            raise _fail(where, "loss_mask", "must be 0 wherever attention_mask is False", "0 on padding", "1 on a padded position")
        if t.versions is not None and bool(torch.any((t.versions != -1) > lm)):
            bad = t.versions[(lm == 0) & (t.versions != -1)]
            raise _fail(
                where, "versions", "must be -1 wherever loss_mask is 0 (no output token there)",
                "-1 on prompt, context and padding", f"version {int(bad[0])} on a position with loss_mask 0",
            )
    if not bool(t.attention_mask.any(dim=1).all()):
        empty = int((~t.attention_mask.any(dim=1)).nonzero()[0])
        raise _fail(where, "attention_mask", "every row must attend to at least one position (a 0-length sequence is no rollout)",
                    "a True position in each row", f"row {empty} with none")


def _validate_fields(t: Trajectory, where: str = "") -> None:
    ids = _tensor(where, "input_ids", t.input_ids)
    if ids.ndim != 2:
        raise _fail(where, "input_ids", "must be 2-D [batch, seqlen]", "ndim 2", f"shape {tuple(ids.shape)}")
    rows, width = ids.shape
    if rows < 1:
        raise _fail(where, "input_ids", "must hold at least one row", "B >= 1", f"shape {tuple(ids.shape)}")
    if width < 1:
        raise _fail(where, "input_ids", "must hold at least one position (a 0-length sequence is no rollout)",
                    "L >= 1", f"shape {tuple(ids.shape)}")
    device = ids.device
    seq_shape, row_shape = (rows, width), (rows,)
    for key, kind, per_position in _TENSOR_KEYS:
        value = getattr(t, key)
        if value is None:
            continue
        if type(value) is not torch.Tensor:
            value = _tensor(where, key, value)
        ok = _DTYPE_OK.get((kind, value.dtype))
        if ok is None:
            ok = _DTYPE_OK[(kind, value.dtype)] = _dtype_ok(kind, value.dtype)
        if not ok:
            raise _fail(where, key, "wrong dtype", kind, str(value.dtype))
        if value.device != device:
            raise _fail(where, key, "must be on the same device as input_ids", str(device), str(value.device))
        expected_shape = seq_shape if per_position else row_shape
        if value.shape != expected_shape:
            raise _fail(where, key, "shape must match input_ids", f"shape {list(expected_shape)}", f"shape {list(value.shape)}")
    _validate_values(t, where)
    if t.rollout_group is not None:
        if not isinstance(t.rollout_group, RolloutGroup):
            raise _fail(where, "rollout_group", "must be a RolloutGroup", "RolloutGroup", type(t.rollout_group).__name__)
        if t.rollout_group.n_rows != rows:
            raise _fail(where, "rollout_group", "row counts must sum to the number of rows", f"sum {rows}", f"sum {t.rollout_group.n_rows}")
        if t.rollout_reward is not None:
            raise _fail(where, "rollout_reward", "give either rollout_reward or rollout_group, not both", "one of them", "both")
    for key, value in t.extras.items():
        if not isinstance(key, str) or key in KNOWN_KEYS:
            raise _fail(where, str(key), "extra keys must be strings other than the contract's keys", "a new str key", repr(key))
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] != rows:
            raise _fail(where, key, "extra tensors must have one entry per row", f"leading dim {rows}", f"shape {list(value.shape)}")
        if isinstance(value, list) and len(value) != rows:
            raise _fail(where, key, "extra lists must have one item per row", f"length {rows}", f"length {len(value)}")
    mm = t.extras.get("multi_modal_input")
    if mm is not None:
        _validate_multi_modal(t, mm, where)


def _validate_multi_modal(t: Trajectory, mm: Any, where: str) -> None:
    """Each row's processor tensors against its image placeholders (see the module docstring)."""
    if not isinstance(mm, list):
        raise _fail(where, "multi_modal_input", "must be a list of one dict (or None) per row", "a list", type(mm).__name__)
    types = t.extras.get("mm_token_type_ids")
    if not (isinstance(types, torch.Tensor) and types.shape == t.input_ids.shape):
        types = None
    for row, item in enumerate(mm):
        runs = None
        if types is not None:
            attended = types[row][t.attention_mask[row]]
            runs = placeholder_runs(attended.tolist(), 1) if bool((attended == 1).any()) else []
            if runs:  # the placeholder token (the ids under type 1) must appear nowhere else
                ids = t.input_ids[row][t.attention_mask[row]]
                stray = torch.isin(ids[attended != 1], torch.unique(ids[attended == 1]))
                if bool(stray.any()):
                    raise _fail(where, "mm_token_type_ids", f"row {row}: an image placeholder token outside the image placeholders "
                                "(one generated in the completion?) would take image features the row does not have",
                                "placeholder tokens only under mm_token_type_ids == 1", f"{int(stray.sum())} more")  # fmt: skip
        if item is None or (isinstance(item, dict) and not item):
            if runs:
                raise _fail(where, f"multi_modal_input[{row}]", "image placeholders need their pixel values",
                            "a dict with pixel_values and image_grid_thw", f"None for {len(runs)} placeholders")  # fmt: skip
            continue
        check_multi_modal_input(item, where=f"{where}'multi_modal_input'[{row}]", n_images=None if runs is None else len(runs), runs=runs)
        pixels = item.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.device != t.input_ids.device:
            raise _fail(where, f"multi_modal_input[{row}]", "pixel_values must be on the same device as input_ids",
                        str(t.input_ids.device), str(pixels.device))  # fmt: skip


def _cast_attention_mask(value: Any) -> Any:
    # The one documented conversion: an integer tensor holding only 0/1 becomes bool.
    if isinstance(value, torch.Tensor) and _is_integer_dtype(value.dtype):
        if bool(((value == 0) | (value == 1)).all()):
            return value.bool()
        raise WorkflowContractError(
            "'attention_mask': an integer attention mask may hold only 0 and 1; "
            f"expected 0/1, got values {sorted(set(value.unique().tolist()))[:5]}"
        )
    return value


def _extras(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


def _rollout_reward(value: Any) -> float | None:
    return None if value is None else as_reward_scalar(value, what="'rollout_reward'")


@attrs.frozen(kw_only=True, eq=False)
class Trajectory:
    """The tensor dict a workflow returns for training (see the module docstring).

    Construction validates every field and raises :class:`WorkflowContractError`
    naming the key, the rule, and the expected and actual dtype, shape or value.
    ``to_dict()`` gives the plain dict AReaL-style trainers consume.

    Args:
        input_ids: ``[B, L]`` integer token ids.
        attention_mask: ``[B, L]`` bool (or 0/1 integers, cast to bool).
        loss_mask: ``[B, L]`` integer, 1 on generated tokens.
        logprobs: ``[B, L]`` floating log-probabilities of the generated tokens.
        versions: ``[B, L]`` integer weight versions, -1 wherever ``loss_mask`` is 0.
        rewards: ``[B]`` floating rewards (normalized ones, when normalization ran).
        is_truncated: ``[B]`` bool, rows cut by the length limit.
        original_rewards: ``[B]`` floating rewards before normalization.
        rollout_reward: the one reward of a single logical rollout (a finite real, not a bool).
        rollout_group: the logical rollouts the rows belong to.
        extras: further per-row tensors or values, carried along.

    Raises:
        WorkflowContractError: a field breaks the contract (dtype, shape, value), named
            with the key and the rule.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor = attrs.field(converter=_cast_attention_mask)
    loss_mask: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    versions: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    is_truncated: torch.Tensor | None = None
    original_rewards: torch.Tensor | None = None
    rollout_reward: float | None = attrs.field(default=None, converter=_rollout_reward)
    rollout_group: RolloutGroup | None = None
    extras: Mapping[str, Any] = attrs.field(factory=dict, converter=_extras)

    def __attrs_post_init__(self) -> None:
        _validate_fields(self)

    @classmethod
    def _unchecked(cls, **fields: Any) -> Trajectory:
        """Build without validation, for results assembled from already validated parts."""
        obj = object.__new__(cls)
        setattr_ = object.__setattr__
        for name in _FIELD_NAMES:
            setattr_(obj, name, fields.get(name))
        if obj.extras is None:
            setattr_(obj, "extras", {})
        return obj

    def _replace_unchecked(self, **changes: Any) -> Trajectory:
        """A copy with ``changes``, without validation (the caller guarantees them)."""
        fields = {name: getattr(self, name) for name in _FIELD_NAMES}
        fields.update(changes)
        return type(self)._unchecked(**fields)

    @property
    def batch_size(self) -> int:
        """Number of rows (B)."""
        return int(self.input_ids.shape[0])

    @property
    def seqlen(self) -> int:
        """Padded sequence length (L)."""
        return int(self.input_ids.shape[1])

    def logical_group(self) -> RolloutGroup:
        """The logical rollouts of this trajectory.

        The explicit ``rollout_group`` if set, else one rollout of all rows whose
        reference is ``rollout_reward``.
        """
        if self.rollout_group is not None:
            return self.rollout_group
        return RolloutGroup((self.batch_size,), (self.rollout_reward,))

    def to_dict(self) -> dict[str, Any]:
        """The plain dict (contract keys that are set, then extras)."""
        out: dict[str, Any] = {}
        for key in KNOWN_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out.update(self.extras)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "") -> Trajectory:
        """Validate a plain dict (e.g. a workflow's result) and build a Trajectory.

        ``where`` prefixes error messages (e.g. ``"slot 2: "``).
        """
        if not isinstance(data, Mapping):
            raise WorkflowContractError(f"{where}trajectory: must be a dict of tensors, got {type(data).__name__}")
        missing = [k for k in ("input_ids", "attention_mask") if k not in data]
        if missing:
            raise WorkflowContractError(
                f"{where}trajectory: missing required keys {missing}; expected input_ids [B, L] and "
                f"attention_mask [B, L], got keys {sorted(map(str, data))}"
            )
        known = {k: data[k] for k in KNOWN_KEYS if k in data}
        extras = {k: v for k, v in data.items() if k not in KNOWN_KEYS}
        try:
            return cls(**known, extras=extras)
        except WorkflowContractError as exc:
            if where:
                raise type(exc)(f"{where}{exc}") from None  # a RewardValueError stays one
            raise

    @classmethod
    def from_response(
        cls,
        resp: ModelResponse,
        reward: float,
        *,
        rollout_reward: Any = None,
        **extras: Any,
    ) -> Trajectory:
        """The standard single-turn row: prompt then completion.

        Prompt positions get loss_mask 0, logprob 0.0 and version -1; completion
        positions loss_mask 1, their logprob and the version that produced them.
        ``is_truncated`` is ``stop_reason == "length"``.
        """
        n_in, n_out = resp.input_len, resp.output_len
        lps = resp.output_logprobs
        row = lambda values, dtype: torch.tensor([list(values)], dtype=dtype)  # noqa: E731
        fields: dict[str, Any] = {
            "input_ids": row([*resp.input_tokens, *resp.output_tokens], torch.int32),
            "attention_mask": torch.ones(1, n_in + n_out, dtype=torch.bool),
            "loss_mask": row([0] * n_in + [1] * n_out, torch.int32),
            "logprobs": row([0.0] * n_in + list(lps), torch.float32),
            "versions": row([-1] * n_in + list(resp.output_versions), torch.int32),
            "rewards": torch.tensor([float(as_reward_scalar(reward, what="reward"))], dtype=torch.float32),
            "is_truncated": torch.tensor([resp.stop_reason == "length"]),
        }
        if extras or type(resp) is not ModelResponse or n_in + n_out == 0 or (lps and min(lps) < -FLOAT32_MAX):
            # Extras are the caller's, a look-alike response was never checked, an empty row
            # and a logprob float32 cannot hold break a rule: the checking constructor names
            # what is wrong.
            return cls(**fields, rollout_reward=rollout_reward, extras=extras)
        # Everything else holds by construction: the response's own checks (ids >= 0,
        # logprobs finite and <= 0) and the layout (loss_mask 0/1, -1 versions on the
        # prompt, every position attended), so the tensors are not validated again.
        return cls._unchecked(**fields, rollout_reward=_rollout_reward(rollout_reward))


# Every field but ``extras`` defaults to None (checked at import, used by ``_unchecked``).
_FIELD_NAMES = tuple(a.name for a in attrs.fields(Trajectory))
assert all(a.default is None for a in attrs.fields(Trajectory) if a.name not in ("input_ids", "attention_mask", "extras"))
