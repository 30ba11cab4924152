"""A dump's image tensors: one safetensors file per group, beside the group's JSONL lines.

A vision row carries ``multi_modal_input`` (the processor's tensors of its images); the
slots of a group share one such dict (one preprocessing of the prompt's images). The
dumper writes each distinct dict of a trajectory once, into
``{task_id}.mm-{digest}.safetensors`` (``digest``: the first 16 hex digits of the file's
SHA-256, so a file is never rewritten with other content and a resumed run appending to
the same task writes a new one), and each row's line names it::

    "multi_modal_input": {"file": "12.mm-3f9c...safetensors", "index": 0}

Safetensors is a header of JSON and raw little-endian arrays, read without unpickling
anything; the reader bounds the file's size before reading it, checks the name against
its pattern (no path leaves the line's directory), opens it without following symlinks,
checks that the content's digest is the name's (a changed byte is an error, not other
pixels), and checks the tensors it loads with the same rules as a trajectory's.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_IMAGE_FILE_BYTES",
    "images_payload",
    "load_images",
    "sidecar_name_ok",
]

#: The largest image file :func:`load_images` reads, in bytes (a group's pixel values).
MAX_IMAGE_FILE_BYTES = 1 << 30

_NAME = re.compile(r"-?\d+\.mm-[0-9a-f]{16}\.safetensors")


def sidecar_name_ok(name: Any) -> bool:
    """Whether ``name`` is an image file name a dump line may refer to."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def images_payload(
    task_id: int, rows: Sequence[Mapping[str, Any] | None]
) -> tuple[str | None, bytes | None, list[int | None]]:
    """The file name, its bytes and each row's index into it (None: a text-only row).

    Rows whose dicts hold the same tensor objects (a group's slots) share one index; a dict holding
    a value that is not a tensor is an error naming the key (only tensors are stored).

    Raises:
        ValueError: a value of a row's ``multi_modal_input`` is not a tensor.
    """
    import torch
    from safetensors.torch import save

    distinct: dict[tuple[tuple[str, int], ...], int] = {}
    tensors: dict[str, Any] = {}
    indices: list[int | None] = []
    for row, item in enumerate(rows):
        if item is None:
            indices.append(None)
            continue
        same = tuple(sorted((key, id(value)) for key, value in item.items()))  # the same tensors: one entry
        k = distinct.get(same)
        if k is None:
            k = distinct[same] = len(distinct)
            for key, value in item.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"multi_modal_input[{row}][{key!r}]: must be a tensor to be dumped, got {type(value).__name__}"
                    )
                tensors[f"{k}/{key}"] = value.detach().to("cpu").contiguous()
        indices.append(k)
    if not distinct:
        return None, None, indices
    data = save(tensors)
    return f"{task_id}.mm-{hashlib.sha256(data).hexdigest()[:16]}.safetensors", data, indices


def load_images(directory: Path, name: str, *, max_bytes: int = MAX_IMAGE_FILE_BYTES) -> dict[int, dict[str, Any]]:
    """The dicts of one image file, by index (each dict keyed as the processor named them).

    Raises:
        ValueError: ``name`` is not an image file name, the file is missing, is not a
            regular file, is larger than ``max_bytes``, its content's SHA-256 is not the
            digest in its name (tampered or truncated), or it is not a safetensors file of
            ``index/key`` tensors.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not sidecar_name_ok(name):
        raise ValueError(f"multi_modal_input.file: must match {_NAME.pattern}, got {name!r}")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(directory / name, flags)
    except FileNotFoundError:
        raise ValueError(f"{directory / name}: the image file a dump line names is missing") from None
    except OSError as exc:  # ELOOP: a symlink
        raise ValueError(f"{directory / name}: cannot open the image file: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{directory / name}: not a regular file")
        if info.st_size > max_bytes:
            raise ValueError(f"{directory / name}: {info.st_size} bytes, more than max_image_bytes={max_bytes}")
        data = fh.read(max_bytes + 1)
    digest = hashlib.sha256(data).hexdigest()[:16]
    if name.partition(".mm-")[2] != f"{digest}.safetensors":  # the name is the content's digest
        raise ValueError(f"{directory / name}: its content does not match the digest in its name (sha256 {digest}...): tampered or truncated")
    try:
        flat = load(data)
    except (SafetensorError, ValueError, OverflowError) as exc:
        raise ValueError(f"{directory / name}: not a safetensors file: {exc}") from None
    out: dict[int, dict[str, Any]] = {}
    for full, tensor in flat.items():
        index, sep, key = full.partition("/")
        if not sep or not key or not index.isdigit():
            raise ValueError(f"{directory / name}: tensor name {full!r} is not 'index/key'")
        out.setdefault(int(index), {})[key] = tensor
    return out
