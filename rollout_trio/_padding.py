"""Joining trajectories into one batch (right-padded) and splitting them apart again."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import torch

from ._errors import WorkflowContractError
from ._rollout_group import FLOAT32_MAX, RolloutGroup
from ._trajectory import KNOWN_KEYS, PAD_VALUES, Trajectory

__all__ = ["concat_trajectories", "join_packed", "join_slots", "split_trajectories"]

TrajectoryLike = Trajectory | Mapping[str, Any]


def _as_trajectory(item: TrajectoryLike, label: int) -> Trajectory:
    if isinstance(item, Trajectory):
        return item
    return Trajectory.from_dict(item, where=f"slot {label}: ")


def _join_one_row_dicts(items: Sequence[Any]) -> Trajectory | None:
    """Join plain dicts of one-row contract tensors, validating the batch once, in bulk.

    The common shape of a group's results. Each key's rows are joined into one flat row
    first: every value rule is checked there (one reduction per key, whatever G is), and
    the flat row is then scattered into the padded batch (padding keeps every rule). The
    result is built without a second validation. Returns None as soon as anything is not
    of that shape or breaks a rule: the general path then handles it and names the slot.
    """
    first = items[0]
    if type(first) is not dict:
        return None
    keys = first.keys()
    if not keys <= _FAST_KEYS or "input_ids" not in keys or "attention_mask" not in keys:
        return None
    if any(type(d) is not dict or d.keys() != keys for d in items):
        return None
    try:
        return _join_rows(items, keys)
    except (KeyError, AttributeError, TypeError, RuntimeError, ValueError, IndexError):
        # Not tensors, mixed devices, a broken rule: the general path decides and names the slot.
        return None


_FAST_KEYS = frozenset(KNOWN_KEYS) - {"rollout_group"}
# The keys of a packed batch, each with the kind of dtype it takes (see _trajectory).
_SEQ_KINDS = (("input_ids", "i"), ("attention_mask", "b"), ("loss_mask", "i"), ("logprobs", "f"), ("versions", "i"))
_ROW_KINDS = (("rewards", "f"), ("original_rewards", "f"), ("is_truncated", "b"))
_KIND_OK: dict[tuple[str, torch.dtype], bool] = {}
_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")
_flatten_dense = torch._C._nn.flatten_dense_tensors  # cat of t.contiguous().view(-1) for each t


def _kind_ok(kind: str, dtype: torch.dtype) -> bool:
    ok = _KIND_OK.get((kind, dtype))
    if ok is None:
        if kind == "f":
            ok = dtype.is_floating_point
        elif kind == "b":
            ok = dtype == torch.bool
        else:
            ok = dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex
        _KIND_OK[(kind, dtype)] = ok
    return ok


def _pack(items: Sequence[dict[str, Any]], key: str, kind: str, shapes: list[Any], dim: int) -> torch.Tensor | None:
    """Every item's ``key`` joined along ``dim`` in one op; None unless each has ``shapes``'
    shape and all share one dtype of ``kind`` (mixed dtypes are promoted by the general path)."""
    values = list(map(itemgetter(key), items))
    if list(map(_SHAPE, values)) != shapes:
        return None
    dtype = values[0].dtype
    if not _kind_ok(kind, dtype) or list(map(_DTYPE, values)).count(dtype) != len(values):
        return None
    if dim == 1 and kind != "f":
        # Rows of unequal widths joined into one flat row. torch.cat along dim 1 copies
        # integer and bool inputs one TensorIterator each (~1 us per row; floating ones take
        # a serial kernel at ~0.1 us), while flattening each row in C++ and joining along
        # dim 0 is one memcpy per row: the same values, 2-3x cheaper (always a copy: n >= 2).
        return _flatten_dense(values)  # one flat row (1-D): only the masked scatter reads it
    return torch.cat(values, dim=dim)


def _padding_mask(widths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """``mask[i, j] = j < widths[i]``: the real positions of the padded batch (3 ops)."""
    return torch.arange(width, device=device) < torch.tensor(widths, device=device).view(-1, 1)


def _join_rows(items: Sequence[dict[str, Any]], keys: Any) -> Trajectory | None:
    """The group packed: one ``cat`` per key over every row, the value rules checked once
    over each packed key, and (rows of unequal widths) one fill and one masked scatter per
    key into the padded batch, sharing one mask. None when anything does not fit."""
    n = len(items)
    shapes = [d["input_ids"].shape for d in items]
    widths = [s[1] if len(s) == 2 and s[0] == 1 else 0 for s in shapes]
    if 0 in widths:
        return None
    width = max(widths)
    padded = min(widths) != width
    # Equal widths: the rows stacked are the batch. Else each key's rows joined into one
    # flat row, scattered into the padded batch below.
    dim = 1 if padded else 0
    packed: dict[str, torch.Tensor] = {}
    for key, kind in _SEQ_KINDS:
        if key in keys:
            value = _pack(items, key, kind, shapes, dim)
            if value is None:
                return None
            packed[key] = value
    row_shape = [torch.Size((1,))] * n
    for key, kind in _ROW_KINDS:
        if key in keys:
            value = _pack(items, key, kind, row_shape, 0)
            if value is None:
                return None
            packed[key] = value
    ids_t = packed["input_ids"]
    device = ids_t.device
    if len({t.device for t in packed.values()}) != 1:
        return None
    # -- the value rules, once per packed key (see _trajectory._validate_values)
    mask_t = packed["attention_mask"]
    if not bool(mask_t.all()):
        return None  # a row with padding of its own: the general path checks it position by position
    if int(ids_t.min()) < 0:
        return None
    lp = packed.get("logprobs")
    if lp is not None:
        lo, hi = torch.aminmax(lp)
        if not (math.isfinite(float(lo)) and float(hi) <= 1e-6):
            return None
    for key in ("rewards", "original_rewards"):
        value = packed.get(key)
        if value is not None:  # one value per row: the Python floats are cheaper than a reduction
            row_values = value.tolist()
            # A finite sum rules out NaN and infinities (which min and max would skip).
            if not (math.isfinite(sum(row_values)) and -FLOAT32_MAX <= min(row_values) and max(row_values) <= FLOAT32_MAX):
                return None
    lm = packed.get("loss_mask")
    if lm is not None:
        lo, hi = torch.aminmax(lm)
        if int(lo) < 0 or int(hi) > 1:
            return None
        ver = packed.get("versions")
        if ver is not None and bool(ver.ne(-1).gt_(lm).any()):  # a version where loss_mask is 0
            return None
    if "rollout_reward" in keys:
        group = RolloutGroup((1,) * n, tuple(d["rollout_reward"] for d in items))  # checks each reference
    else:
        group = RolloutGroup.unchecked((1,) * n, (None,) * n)
    if padded:  # one fill and one masked scatter per key; padding keeps every rule
        mask = _padding_mask(widths, width, device)
        for key, _ in _SEQ_KINDS:
            value = packed.get(key)
            if value is None:
                continue
            if key == "attention_mask":
                packed[key] = mask  # every real position attends (checked above)
            else:
                out = torch.full((n, width), PAD_VALUES.get(key, 0), dtype=value.dtype, device=device)
                packed[key] = out.masked_scatter_(mask, value)
    return Trajectory._unchecked(**packed, rollout_group=group)


def _tensor_dicts(trajs: Sequence[Trajectory]) -> list[dict[str, Any]]:
    out = []
    for t in trajs:
        d = t.to_dict()
        d.pop("rollout_reward", None)
        d.pop("rollout_group", None)
        out.append(d)
    return out


class _RowLayout:
    """Where the rows of one-row items land in the padded batch, shared by every key.

    Joining the items along dim 1 gives their values in row-major order, which is the
    order in which the boolean mask selects the batch's real positions: one fill and one
    masked assignment per key, instead of one padding op per item.
    """

    def __init__(self, widths: list[int]) -> None:
        self.widths = widths
        self.width = max(widths)
        lengths = torch.tensor(widths)
        self.mask = torch.arange(self.width) < lengths[:, None]

    def place(self, values: list[torch.Tensor], pad: Any) -> torch.Tensor:
        first = values[0]
        if self.mask.device != first.device:
            self.mask = self.mask.to(first.device)
        out = torch.full((len(values), self.width), pad, dtype=first.dtype, device=first.device)
        return out.masked_scatter_(self.mask, torch.cat(values, dim=1))


def _concat_tensors(key: str, values: list[torch.Tensor], layout: _RowLayout | None = None) -> torch.Tensor:
    first = values[0]
    ndims = {v.ndim for v in values}
    if len(ndims) != 1:
        raise WorkflowContractError(f"{key!r}: dimension mismatch between slots; expected equal ndim, got {sorted(ndims)}")
    dtypes = {v.dtype for v in values}
    if len(dtypes) > 1:
        dtype = first.dtype
        for d in dtypes:
            dtype = torch.promote_types(dtype, d)  # integer dtypes widen
        values = [v.to(dtype) for v in values]
    if first.ndim == 1:
        return torch.cat(values)
    pad = PAD_VALUES.get(key, 0)
    if layout is not None and first.ndim == 2 and first.shape[1] == layout.widths[0] and all(
        v.shape[1] == w for v, w in zip(values, layout.widths)
    ):
        return layout.place(values, pad)
    shape = [sum(v.shape[0] for v in values)] + [max(v.shape[d] for v in values) for d in range(1, first.ndim)]
    out = torch.full(shape, pad, dtype=values[0].dtype, device=first.device)
    row = 0
    for v in values:
        out[(slice(row, row + v.shape[0]), *(slice(0, n) for n in v.shape[1:]))] = v
        row += v.shape[0]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # values whose == is not a bool (e.g. arrays) count as different
        return a is b


def _check_one_device(items: Sequence[TrajectoryLike], labels: Sequence[int]) -> None:
    """Every item's input_ids on the first item's device (checked before validation,
    which would otherwise fail on the foreign device with a raw torch error)."""
    devices = []
    for item in items:
        ids = item.input_ids if isinstance(item, Trajectory) else item.get("input_ids")
        devices.append(ids.device if isinstance(ids, torch.Tensor) else None)
    for label, device in zip(labels, devices):
        if device is not None and devices[0] is not None and device != devices[0]:
            raise WorkflowContractError(
                f"slot {label}: 'input_ids': every slot's tensors must be on one device; "
                f"expected {devices[0]} (slot {labels[0]}), got {device}"
            )


def concat_trajectories(items: Sequence[TrajectoryLike]) -> Trajectory:
    """Join trajectories row-wise into one, right-padding every non-batch dimension.

    Padding values: ``attention_mask`` False, ``versions`` -1, everything else 0.
    Integer dtypes are promoted to the widest present. Lists are concatenated;
    other values must be equal in every item. Each item stays (at least) one
    logical rollout: the result's ``rollout_group`` lists every item's rollouts.

    Args:
        items: trajectories, or tensor dicts :meth:`Trajectory.from_dict` accepts, in row order.

    Returns:
        One trajectory with every item's rows, padded to the widest.

    Raises:
        WorkflowContractError: an empty list, differing key sets (naming the slot and
            the keys), mixed ndim for a key, or differing non-tensor values.
    """
    return join_slots(items, range(len(items)))


def join_packed(items: Sequence[Any]) -> Trajectory | None:
    """The items joined in bulk, if they are plain dicts of one-row contract tensors that
    keep every rule (the common shape of a group's results): one packed op per key, the
    packed result checked once. None otherwise: :func:`join_slots` then handles them and
    names the slot that broke a rule."""
    try:
        return _join_one_row_dicts(items) if items else None
    except WorkflowContractError:
        return None  # the general path finds the item that broke the rule and names it


def join_slots(items: Sequence[TrajectoryLike], labels: Sequence[int], *, packed: bool = True) -> Trajectory:
    """:func:`concat_trajectories` whose errors name ``slot labels[i]`` for item ``i``.

    ``packed=False`` skips the bulk path (for a caller that tried :func:`join_packed`).
    """
    if not items:
        raise WorkflowContractError("concat_trajectories: needs at least one trajectory, got an empty list")
    if packed:
        joined = join_packed(items)
        if joined is not None:
            return joined
    _check_one_device(items, labels)
    trajs = [_as_trajectory(item, label) for item, label in zip(items, labels)]
    dicts = _tensor_dicts(trajs)
    keys = list(dicts[0])
    for label, d in zip(labels[1:], dicts[1:]):
        if set(d) != set(keys):
            missing = sorted(set(keys) - set(d))
            extra = sorted(set(d) - set(keys))
            raise WorkflowContractError(
                f"slot {label}: has different keys than slot {labels[0]}; expected {sorted(keys)}, "
                f"got missing {missing} and extra {extra}"
            )
    merged: dict[str, Any] = {}
    ids = [t.input_ids for t in trajs]
    layout = _RowLayout([v.shape[1] for v in ids]) if all(v.shape[0] == 1 for v in ids) else None
    for key in keys:
        values = [d[key] for d in dicts]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.ndim >= 1:
            if not all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in values):
                raise WorkflowContractError(f"{key!r}: a tensor in slot 0 but not in every slot")
            merged[key] = _concat_tensors(key, values, layout)
        elif isinstance(first, list):
            if not all(isinstance(v, list) for v in values):
                raise WorkflowContractError(f"{key!r}: a list in slot 0 but not in every slot")
            merged[key] = [x for v in values for x in v]
        else:
            for label, v in zip(labels[1:], values[1:]):
                if not _same(first, v):
                    raise WorkflowContractError(
                        f"{key!r}: non-tensor values must be equal in every slot; slot {labels[0]} has {first!r}, "
                        f"slot {label} has {v!r}"
                    )
            merged[key] = first
    counts: list[int] = []
    refs: list[float | None] = []
    for t in trajs:
        if t.rollout_group is not None:
            counts.extend(t.rollout_group.row_counts)
            refs.extend(t.rollout_group.rewards)
        else:
            counts.append(t.batch_size)
            refs.append(t.rollout_reward)
    # Every part was validated and joining keeps the rules, so the result is not checked again.
    known = {k: merged.pop(k) for k in KNOWN_KEYS if k in merged}
    return Trajectory._unchecked(**known, rollout_group=RolloutGroup(tuple(counts), tuple(refs)), extras=merged)


def split_trajectories(
    traj: Trajectory,
    row_counts: Sequence[int],
    *,
    widths: Sequence[int] | None = None,
) -> list[Trajectory]:
    """Split ``traj`` row-wise into pieces of ``row_counts`` rows: the inverse of concatenation.

    Each piece is trimmed to ``widths[i]`` positions along dimension 1 (every tensor
    whose dimension 1 is the batch's padded width); without ``widths``, to the last
    position any of its rows attends to. Logical rollouts are split with the rows.

    Args:
        traj: the joined trajectory.
        row_counts: rows of each piece, positive, summing to ``traj.batch_size``.
        widths: the width to trim each piece to (one per piece), or None.

    Returns:
        The pieces, in row order.

    Raises:
        WorkflowContractError: ``row_counts`` not positive or not summing to the rows,
            ``widths`` not one per piece, or a boundary inside a logical rollout.
    """
    counts = list(row_counts)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise WorkflowContractError(f"row_counts: must be positive integers; got {counts!r}")
    if sum(counts) != traj.batch_size:
        raise WorkflowContractError(f"row_counts: must sum to the rows; expected {traj.batch_size}, got {sum(counts)}")
    if widths is not None and len(widths) != len(counts):
        raise WorkflowContractError(f"widths: one per piece; expected {len(counts)}, got {len(widths)}")
    group = traj.logical_group()
    bounds = [0]
    for c in group.row_counts:
        bounds.append(bounds[-1] + c)
    data = traj.to_dict()
    data.pop("rollout_group", None)
    data.pop("rollout_reward", None)
    width = traj.seqlen
    pieces = []
    start = 0
    for i, n in enumerate(counts):
        stop = start + n
        if start not in bounds or stop not in bounds:
            raise WorkflowContractError(
                f"row_counts: piece {i} (rows {start}:{stop}) cuts a logical rollout; rollout boundaries are {bounds}"
            )
        if widths is not None:
            w = int(widths[i])
        else:
            cols = traj.attention_mask[start:stop].any(dim=0).nonzero()
            w = int(cols[-1]) + 1 if len(cols) else 0
        piece: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor) and value.ndim >= 1:
                value = value[start:stop]
                if value.ndim >= 2 and value.shape[1] == width:
                    value = value[:, :w]
            elif isinstance(value, list):
                value = value[start:stop]
            piece[key] = value
        k0, k1 = bounds.index(start), bounds.index(stop)
        sub = RolloutGroup(group.row_counts[k0:k1], group.rewards[k0:k1])
        if sub.n_rollouts == 1:
            piece["rollout_reward"] = sub.rewards[0]
        else:
            piece["rollout_group"] = sub
        pieces.append(Trajectory.from_dict(piece, where=f"piece {i}: "))
        start = stop
    return pieces

