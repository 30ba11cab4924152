"""Trajectory dumps: one JSONL line per trajectory row, and the reader that loads them back.

Layout (DESIGN decision 9)::

    {fileroot}/{experiment_name}/{trial_name}/{rollout|eval-rollout}/{version}/{task_id}.jsonl

``version`` is the highest weight version in the trajectory. Each line holds the keys of
the reference's record, in its order (``task_id, sample_idx, seqlen, prompt_len,
head_version, tail_version, version_rle, reward, prompt, completion[, segments]
[, original_reward]``), then our extensions ``accepted`` and ``tokens`` (the row's
``input_ids``, ``loss_mask``, ``logprobs`` and ``versions`` over its ``seqlen``
positions) and, when the trajectory says so, ``is_truncated``. A vision row also names
its image tensors, which lie once per trajectory in a safetensors file beside the lines
(:mod:`rollout_trio.executor._dump_images`).

Writing is safe for several processes appending to one directory: each line is one
``write`` on an ``O_APPEND`` descriptor, under a per-file lock (a thread lock within the
process, ``flock`` across processes), and a failed write is cut back off the file.

No write leaves ``fileroot``, whatever else changes the tree meanwhile: ``fileroot`` is
opened once, and every directory below it is opened (or made) relative to its parent's
descriptor with ``O_NOFOLLOW``, so a symlink planted or swapped in anywhere below the
root is refused, never followed, and nothing is created through it. The file itself must
be a regular file with one link. A refused dump is logged and counted like an I/O error.
"""

from ._dump_images import MAX_IMAGE_FILE_BYTES
from ._dump_reader import MAX_LINE_BYTES, iter_dump, read_dump
from ._dump_records import (
    NAME_PATTERN,
    SCOPES,
    DumpLines,
    DumpRecord,
    DumpSegment,
    DumpSplit,
    DumpTokens,
    compute_output_versions,
    split_trajectory_for_dump,
    trajectory_dump,
    trajectory_lines,
    validate_name,
)
from ._dump_writer import DumpPathRefused, DumpStatistics, TrajectoryDumper

__all__ = [
    "MAX_IMAGE_FILE_BYTES",
    "MAX_LINE_BYTES",
    "NAME_PATTERN",
    "SCOPES",
    "DumpLines",
    "DumpPathRefused",
    "DumpRecord",
    "DumpSegment",
    "DumpSplit",
    "DumpStatistics",
    "DumpTokens",
    "TrajectoryDumper",
    "compute_output_versions",
    "iter_dump",
    "read_dump",
    "split_trajectory_for_dump",
    "trajectory_dump",
    "trajectory_lines",
    "validate_name",
]
