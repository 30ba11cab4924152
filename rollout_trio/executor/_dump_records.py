"""Dump records: the row a dump line holds, and how a trajectory becomes those lines.

The layout and the line's keys are described in :mod:`rollout_trio.executor._dump`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from .._trajectory import Trajectory

logger = logging.getLogger("rollout_trio.dump")

#: What ``experiment_name`` and ``trial_name`` must match: no separators, no ``..``, no leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SCOPES = {"rollout": False, "eval-rollout": True}
_MISSING = "missing required tensor fields: input_ids, rewards, attention_mask, or loss_mask"


# ---------------------------------------------------------------------------- records


@attrs.frozen
class DumpSegment:
    """One run of equal ``loss_mask`` values in a multi-generation row."""

    role: Literal["prompt", "gen", "context"]
    len: int
    text: str


@attrs.frozen(kw_only=True)
class DumpTokens:
    """A row's attended positions (``seqlen`` of each); ``logprobs`` is None if the row had none."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    versions: tuple[int, ...]
    mm_token_type_ids: tuple[int, ...] | None = None


@attrs.frozen(kw_only=True)
class DumpRecord:
    """One dumped row, as :func:`read_dump` loads it.

    The fields are the JSONL keys, plus ``version`` and ``is_eval`` taken from the
    file's path. ``tokens`` is None for dumps written without it (e.g. by AReaL), and
    ``is_truncated`` is None when the trajectory did not say.
    """

    task_id: int
    sample_idx: int
    seqlen: int
    prompt_len: int
    head_version: int
    tail_version: int
    version_rle: tuple[tuple[int, int], ...]
    reward: float
    prompt: str
    completion: str
    segments: tuple[DumpSegment, ...] | None = None
    original_reward: float | None = None
    accepted: bool = True
    tokens: DumpTokens | None = None
    is_truncated: bool | None = None
    multi_modal_input: dict[str, Any] | None = attrs.field(default=None, eq=False, repr=False)
    version: int
    is_eval: bool

    @property
    def raw_reward(self) -> float:
        """The reward before normalization (``original_reward`` if recorded, else ``reward``)."""
        return self.reward if self.original_reward is None else self.original_reward

    def to_trajectory(self) -> Trajectory:
        """This row as a one-row :class:`Trajectory`, e.g. to re-run a trainer step on a dump."""
        import torch

        if self.tokens is None:
            raise ValueError(f"task {self.task_id} sample {self.sample_idx}: the record has no 'tokens'; cannot rebuild it")
        t = self.tokens

        def row(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([list(values)], dtype=dtype)

        n = len(t.input_ids)
        return Trajectory(
            input_ids=row(t.input_ids, torch.int64),
            attention_mask=torch.ones(1, n, dtype=torch.bool),
            loss_mask=row(t.loss_mask, torch.int64),
            logprobs=None if t.logprobs is None else row(t.logprobs, torch.float32),
            versions=row(t.versions, torch.int64),
            rewards=torch.tensor([self.reward], dtype=torch.float32),
            original_rewards=None if self.original_reward is None else torch.tensor([self.original_reward], dtype=torch.float32),
            is_truncated=None if self.is_truncated is None else torch.tensor([self.is_truncated]),
            extras=self._vision_extras(),
        )

    def _vision_extras(self) -> dict[str, Any]:
        import torch

        if self.multi_modal_input is None:
            return {}
        extras: dict[str, Any] = {"multi_modal_input": [self.multi_modal_input]}
        if self.tokens is not None and self.tokens.mm_token_type_ids is not None:
            extras["mm_token_type_ids"] = torch.tensor([list(self.tokens.mm_token_type_ids)], dtype=torch.int64)
        return extras


# ---------------------------------------------------------------------------- pure helpers


def compute_output_versions(versions: Sequence[int], mask: Sequence[int]) -> tuple[int, int, list[list[int]]]:
    """``(head, tail, rle)`` of the versions at ``mask == 1`` positions, in token order.

    ``head``/``tail`` are the min/max (-1 when no position is masked in); ``rle`` merges
    adjacent equal versions into ``[version, count]`` runs.
    """
    out = [v for v, m in zip(versions, mask, strict=True) if m == 1]
    if not out:
        return -1, -1, []
    rle: list[list[int]] = []
    for v in out:
        if rle and rle[-1][0] == v:
            rle[-1][1] += 1
        else:
            rle.append([v, 1])
    return min(out), max(out), rle


def _runs(mask: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of equal values: ``(value, start, end)``."""
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            yield mask[start], start, i
            start = i


@attrs.frozen
class DumpSplit:
    """What :func:`split_trajectory_for_dump` returns."""

    prompt_end: int
    prompt_text: str
    completion_text: str
    segments: list[DumpSegment] | None


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=False))


def split_trajectory_for_dump(ids: Sequence[int], mask: Sequence[int], tokenizer: Any) -> DumpSplit:
    """Split a row at its first generated token, and into segments if it has several generations.

    Segments (only with two or more ``mask == 1`` runs) are ``gen`` for generated runs,
    ``prompt`` for a non-generated run starting at index 0 and ``context`` for every
    other non-generated run (DESIGN: unlike the reference, a run between generations is
    never called the prompt).
    """
    if len(ids) != len(mask):
        raise ValueError(f"ids length {len(ids)} != mask length {len(mask)}")
    prompt_end = next((i for i, m in enumerate(mask) if m == 1), len(ids))
    runs = list(_runs(mask))
    segments = None
    if sum(1 for value, _, _ in runs if value == 1) > 1:
        segments = [
            DumpSegment("gen" if value == 1 else ("prompt" if start == 0 else "context"), end - start, _decode(tokenizer, ids[start:end]))
            for value, start, end in runs
        ]
    return DumpSplit(prompt_end, _decode(tokenizer, ids[:prompt_end]), _decode(tokenizer, ids[prompt_end:]), segments)


def _as_trajectory(traj: Trajectory | Mapping[str, Any]) -> Trajectory:
    return traj if isinstance(traj, Trajectory) else Trajectory.from_dict(traj)


@attrs.frozen
class DumpLines:
    """What one trajectory dumps: its version directory, its lines, and its image file
    (``image_name`` and ``image_bytes``, both None for a text-only trajectory)."""

    tail: int
    lines: list[str]
    image_name: str | None = None
    image_bytes: bytes | None = None


def trajectory_lines(
    traj: Trajectory | Mapping[str, Any],
    *,
    task_id: int,
    tokenizer: Any,
    accepted: bool = True,
    version: int | None = None,
) -> tuple[int, list[str]]:
    """The version directory and the JSONL lines of one trajectory (see :func:`trajectory_dump`)."""
    out = trajectory_dump(traj, task_id=task_id, tokenizer=tokenizer, accepted=accepted, version=version)
    return out.tail, out.lines


def trajectory_dump(
    traj: Trajectory | Mapping[str, Any],
    *,
    task_id: int,
    tokenizer: Any,
    accepted: bool = True,
    version: int | None = None,
) -> DumpLines:
    """The version directory, the JSONL lines (each ending in a newline) and the image file of one trajectory.

    Vision rows (``multi_modal_input``) name the image file and their index in it; the
    file holds each distinct dict of the trajectory once (a group's shared preprocessing
    once, whatever its size). ``mm_token_type_ids`` goes in the row's ``tokens``.

    Rows with no attended token, or whose last attended token was not generated, are
    skipped (their ``sample_idx`` leaves a gap). Raises ``ValueError`` when a required
    tensor is missing.

    A trajectory without ``versions`` says nothing about the weights that generated it:
    its generated tokens and its directory get ``version`` when the caller gives one (the
    reference passes the engine's version at dump time), else -1, "unknown". Either way a
    warning says which it was, and that it was not read from the trajectory.
    """
    t = _as_trajectory(traj)
    if t.rewards is None or t.loss_mask is None:
        raise ValueError(_MISSING)
    attn = t.attention_mask.sum(dim=1).tolist()
    ids_rows = t.input_ids.tolist()
    mask_rows = t.loss_mask.tolist()
    rewards = t.rewards.tolist()
    originals = None if t.original_rewards is None else t.original_rewards.tolist()
    truncated = None if t.is_truncated is None else t.is_truncated.tolist()
    logprob_rows = None if t.logprobs is None else t.logprobs.tolist()
    mm_rows = t.extras.get("multi_modal_input")
    image_name = image_bytes = None
    image_index: list[int | None] = []
    if isinstance(mm_rows, list) and any(item is not None for item in mm_rows):
        from ._dump_images import images_payload

        image_name, image_bytes, image_index = images_payload(task_id, mm_rows)
    types = t.extras.get("mm_token_type_ids")
    type_rows = types.tolist() if types is not None and hasattr(types, "tolist") else None
    if t.versions is not None:
        version_rows = t.versions.tolist()
        global_tail = int(t.versions.max())
    else:
        if version is None:
            logger.warning(
                "task %d: the trajectory has no 'versions'; dumped under version -1 (unknown); pass dump(version=...) "
                "to record one",
                task_id,
            )
        else:
            logger.warning(
                "task %d: the trajectory has no 'versions'; dumped under version %d, given by the caller (not read "
                "from the trajectory)",
                task_id,
                version,
            )
        fallback = -1 if version is None else int(version)
        version_rows = [[fallback if m == 1 else -1 for m in row] for row in mask_rows]
        global_tail = fallback
    lines = []
    for i, seqlen in enumerate(attn):
        if seqlen == 0:
            continue
        ids, mask = ids_rows[i][:seqlen], mask_rows[i][:seqlen]
        if mask[-1] != 1:
            continue
        versions = version_rows[i][:seqlen]
        head, tail, rle = compute_output_versions(versions, mask)
        split = split_trajectory_for_dump(ids, mask, tokenizer)
        record: dict[str, Any] = {
            "task_id": task_id,
            "sample_idx": i,
            "seqlen": seqlen,
            "prompt_len": split.prompt_end,
            "head_version": head,
            "tail_version": tail,
            "version_rle": rle,
            "reward": rewards[i],
            "prompt": split.prompt_text,
            "completion": split.completion_text,
        }
        if split.segments is not None:
            record["segments"] = [{"role": s.role, "len": s.len, "text": s.text} for s in split.segments]
        if originals is not None:
            record["original_reward"] = originals[i]
        record["accepted"] = accepted
        record["tokens"] = {
            "input_ids": ids,
            "loss_mask": mask,
            "logprobs": None if logprob_rows is None else logprob_rows[i][:seqlen],
            "versions": versions,
        }
        if type_rows is not None:
            record["tokens"]["mm_token_type_ids"] = type_rows[i][:seqlen]
        if truncated is not None:
            record["is_truncated"] = truncated[i]
        if image_index and image_index[i] is not None:
            record["multi_modal_input"] = {"file": image_name, "index": image_index[i]}
        lines.append(json.dumps(record) + "\n")
    return DumpLines(global_tail, lines, image_name, image_bytes)


def validate_name(field: str, value: Any) -> str:
    """``value`` if it is a safe single path component, else ``ValueError`` naming ``field``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: required for dumps; expected a non-empty name, got {value!r}")
    if NAME_PATTERN.fullmatch(value) is None:
        raise ValueError(
            f"{field}: must match {NAME_PATTERN.pattern} (a single path component, no separators or "
            f"leading dot), got {value!r}"
        )
    return value


