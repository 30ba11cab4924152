"""The dump reader: :func:`read_dump` and :func:`iter_dump` load dump lines back as
:class:`DumpRecord` objects, every field checked against its JSON type, every line bounded.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Container, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from .._limits import MAX_DUMP_LINE_BYTES
from ._dump_images import MAX_IMAGE_FILE_BYTES, load_images, sidecar_name_ok
from ._dump_records import SCOPES, DumpRecord, DumpSegment, DumpTokens

#: The longest dump line :func:`read_dump` reads, in bytes (about 1M tokens with their texts).
#: A line is parsed whole, so this bounds the memory one record may take.
MAX_LINE_BYTES = MAX_DUMP_LINE_BYTES

_ROLES = ("prompt", "gen", "context")


class _Rule(ValueError):
    """A field of a dump line that breaks its rule: ``field: rule, got value``."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _broken(field: str, rule: str, value: Any) -> _Rule:
    return _Rule(f"{field}: must be {rule}, got {_shown(value)} ({type(value).__name__})")


def _get(obj: Mapping[str, Any], field: str) -> Any:
    if field not in obj:
        raise _Rule(f"{field}: missing")
    return obj[field]


def _int(value: Any, field: str) -> int:
    if type(value) is not int:  # JSON has no other integers; never a bool, a float or a string
        raise _broken(field, "an integer", value)
    return value


def _float(value: Any, field: str) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        try:
            return float(value)
        except OverflowError:
            raise _Rule(f"{field}: must be a number a float can hold, got an integer of {value.bit_length()} bits") from None
    raise _broken(field, "a number", value)


def _str(value: Any, field: str) -> str:
    if type(value) is not str:
        raise _broken(field, "a string", value)
    return value


def _bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise _broken(field, "true or false", value)
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise _broken(field, "an object", value)
    return value


def _ints(value: Any, field: str) -> tuple[int, ...]:
    if type(value) is not list or not set(map(type, value)) <= {int}:
        raise _broken(field, "a list of integers", value)
    return tuple(value)


def _floats(value: Any, field: str) -> tuple[float, ...]:
    if type(value) is not list or not set(map(type, value)) <= {float, int}:
        raise _broken(field, "a list of numbers", value)
    return tuple(_float(v, f"{field}[{i}]") for i, v in enumerate(value))


def _rle(value: Any) -> tuple[tuple[int, int], ...]:
    if type(value) is not list:
        raise _broken("version_rle", "a list of [version, count] pairs", value)
    runs = []
    for i, run in enumerate(value):
        if type(run) is not list or len(run) != 2:
            raise _broken(f"version_rle[{i}]", "a [version, count] pair", run)
        runs.append((_int(run[0], f"version_rle[{i}][0]"), _int(run[1], f"version_rle[{i}][1]")))
    return tuple(runs)


def _segments(value: Any) -> tuple[DumpSegment, ...] | None:
    if value is None:
        return None
    if type(value) is not list:
        raise _broken("segments", "a list of objects", value)
    segments = []
    for i, item in enumerate(value):
        seg = _object(item, f"segments[{i}]")
        role = _get(seg, "role")
        if role not in _ROLES:
            raise _broken(f"segments[{i}].role", f"one of {list(_ROLES)}", role)
        segments.append(
            DumpSegment(role, _int(_get(seg, "len"), f"segments[{i}].len"), _str(_get(seg, "text"), f"segments[{i}].text"))
        )
    return tuple(segments)


def _tokens(value: Any) -> DumpTokens | None:
    if value is None:
        return None
    tokens = _object(value, "tokens")
    logprobs = tokens.get("logprobs")
    types = tokens.get("mm_token_type_ids")
    return DumpTokens(
        input_ids=_ints(_get(tokens, "input_ids"), "tokens.input_ids"),
        loss_mask=_ints(_get(tokens, "loss_mask"), "tokens.loss_mask"),
        logprobs=None if logprobs is None else _floats(logprobs, "tokens.logprobs"),
        versions=_ints(_get(tokens, "versions"), "tokens.versions"),
        mm_token_type_ids=None if types is None else _ints(types, "tokens.mm_token_type_ids"),
    )


def _image_ref(value: Any) -> tuple[str, int] | None:
    """A line's ``multi_modal_input`` reference: ``(file name, index)``."""
    if value is None:
        return None
    ref = _object(value, "multi_modal_input")
    name = _str(_get(ref, "file"), "multi_modal_input.file")
    if not sidecar_name_ok(name):
        raise _broken("multi_modal_input.file", "an image file name of this dump ({task_id}.mm-{digest}.safetensors)", name)
    index = _int(_get(ref, "index"), "multi_modal_input.index")
    if index < 0:
        raise _broken("multi_modal_input.index", ">= 0", index)
    return name, index


class _Images:
    """The image files of one dump directory, each loaded once (a group's rows share one)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.loaded: dict[tuple[Path, str], dict[int, dict[str, Any]]] = {}

    def get(self, directory: Path, ref: tuple[str, int], tokens: DumpTokens | None) -> dict[str, Any]:
        """Row ``ref``'s tensors, checked against its placeholder runs (``mm_token_type_ids``)."""
        from .._images import check_multi_modal_input, placeholder_runs

        name, index = ref
        key = (directory, name)
        if key not in self.loaded:
            if len(self.loaded) >= 8:  # a dump read in order needs one file at a time
                self.loaded.pop(next(iter(self.loaded)))
            self.loaded[key] = load_images(directory, name, max_bytes=self.max_bytes)
        item = self.loaded[key].get(index)
        if item is None:
            raise _Rule(f"multi_modal_input.index: {index} is not in {name} (it holds {sorted(self.loaded[key])})")
        runs = None
        if tokens is not None and tokens.mm_token_type_ids is not None:
            runs = placeholder_runs(tokens.mm_token_type_ids, 1)
        try:
            check_multi_modal_input(item, where=f"{name}[{index}]", n_images=None if runs is None else len(runs), runs=runs)
        except ValueError as exc:
            raise _Rule(str(exc)) from None
        return item


def _record(obj: Any, version: int, is_eval: bool, images: Any = None) -> DumpRecord:
    """``obj`` (a parsed line) as a record; every value must have its field's JSON type.

    ``images(ref, tokens)`` loads the row's image tensors (None: references are checked, not loaded)."""
    obj = _object(obj, "the line")
    truncated = obj.get("is_truncated")
    original = obj.get("original_reward")
    tokens = _tokens(obj.get("tokens"))
    ref = _image_ref(obj.get("multi_modal_input"))
    return DumpRecord(
        task_id=_int(_get(obj, "task_id"), "task_id"),
        sample_idx=_int(_get(obj, "sample_idx"), "sample_idx"),
        seqlen=_int(_get(obj, "seqlen"), "seqlen"),
        prompt_len=_int(_get(obj, "prompt_len"), "prompt_len"),
        head_version=_int(_get(obj, "head_version"), "head_version"),
        tail_version=_int(_get(obj, "tail_version"), "tail_version"),
        version_rle=_rle(_get(obj, "version_rle")),
        reward=_float(_get(obj, "reward"), "reward"),
        prompt=_str(_get(obj, "prompt"), "prompt"),
        completion=_str(_get(obj, "completion"), "completion"),
        segments=_segments(obj.get("segments")),
        original_reward=None if original is None else _float(original, "original_reward"),
        accepted=_bool(obj.get("accepted", True), "accepted"),
        tokens=tokens,
        is_truncated=None if truncated is None else _bool(truncated, "is_truncated"),
        multi_modal_input=None if ref is None or images is None else images(ref, tokens),
        version=version,
        is_eval=is_eval,
    )


def _dump_file_key(path: Path) -> tuple[bool, int, int] | None:
    """``(is_eval, version, task_id)`` from ``…/{scope}/{version}/{task_id}.jsonl``, or None."""
    scope, version, task = path.parent.parent.name, path.parent.name, path.stem
    if scope not in SCOPES or not re.fullmatch(r"-?\d+", version) or not re.fullmatch(r"-?\d+", task):
        return None
    return SCOPES[scope], int(version), int(task)


def read_dump(
    path: str | os.PathLike[str], *, max_line_bytes: int = MAX_LINE_BYTES, max_image_bytes: int = MAX_IMAGE_FILE_BYTES
) -> list[DumpRecord]:
    """Load a dump (a directory at any level of the layout, or one ``.jsonl`` file) into records.

    Records come ordered by scope (training first), version, task id, then line order.
    Every value must have its field's JSON type (``"accepted": "false"`` is an error, not
    True); a line longer than ``max_line_bytes`` is an error, found without reading it whole.

    Args:
        path: a dump directory (any level of the layout) or one ``.jsonl`` file.
        max_line_bytes: the longest line accepted, in bytes.
        max_image_bytes: the largest image file (a group's ``multi_modal_input``
            tensors, in safetensors) read, in bytes.

    Returns:
        The records, as :class:`DumpRecord` objects.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: naming the file and line, for a line that is not a dump record; naming
            the file, for a dump file that is not a regular file (a FIFO, a directory).
    """
    return list(iter_dump(path, max_line_bytes=max_line_bytes, max_image_bytes=max_image_bytes))


def iter_dump(
    path: str | os.PathLike[str],
    *,
    light: bool = False,
    only: Container[int] | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
    max_image_bytes: int = MAX_IMAGE_FILE_BYTES,
) -> Iterator[DumpRecord]:
    """:func:`read_dump`, one record at a time, for dumps too big to hold.

    ``light`` drops ``tokens``, ``segments`` and the texts (the bulk of a line) unchecked;
    ``only`` parses just the records at these positions (in read order) and skips the
    other lines unparsed.
    """
    if type(max_line_bytes) is not int or max_line_bytes < 1:
        raise ValueError(f"max_line_bytes: must be an integer >= 1, got {max_line_bytes!r}")
    root = Path(path)
    try:
        mode = root.stat().st_mode  # stat, not open: a FIFO given here must not block
    except FileNotFoundError:
        raise FileNotFoundError(f"dump path {str(root)!r} does not exist") from None
    if stat.S_ISREG(mode):
        key = _dump_file_key(root.absolute())
        if key is None:
            raise ValueError(f"{root}: not a dump file; expected …/rollout|eval-rollout/<version>/<task_id>.jsonl")
        keyed = [(key, root)]
    elif stat.S_ISDIR(mode):  # other JSON-lines files beside a dump (a trainer's logs) are not dump files: skip them
        found = ((_dump_file_key(f.absolute()), f) for f in root.rglob("*.jsonl"))
        keyed = sorted((key, f) for key, f in found if key is not None)
    else:
        raise ValueError(f"{root}: not a regular file or a directory; expected a dump directory or a .jsonl file")
    if type(max_image_bytes) is not int or max_image_bytes < 1:
        raise ValueError(f"max_image_bytes: must be an integer >= 1, got {max_image_bytes!r}")
    return _iter_records(keyed, light, only, max_line_bytes, None if light else _Images(max_image_bytes))


def _open_regular(file: Path) -> Any:
    """``file`` opened for binary reading, if it is a regular file (checked on the open descriptor)."""
    # O_NONBLOCK: opening a FIFO for reading would wait for a writer.
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{file}: not a regular file; a dump file is a regular .jsonl file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _iter_records(
    keyed: list[tuple[tuple[bool, int, int], Path]],
    light: bool,
    only: Container[int] | None,
    max_line_bytes: int,
    images: _Images | None,
) -> Iterator[DumpRecord]:
    index = -1
    for (is_eval, version, _), file in keyed:
        with _open_regular(file) as fh:
            lineno = 0
            while line := fh.readline(max_line_bytes + 1):  # never more than the bound in memory
                lineno += 1
                if len(line.rstrip(b"\n")) > max_line_bytes:
                    raise ValueError(
                        f"{file}:{lineno}: line longer than {max_line_bytes} bytes (max_line_bytes); not read"
                    )
                if not line.strip():
                    continue
                index += 1
                if only is not None and index not in only:
                    continue
                try:
                    obj = json.loads(line)
                    if light and isinstance(obj, dict):
                        obj.update(prompt="", completion="", tokens=None, segments=None)
                    load = None if images is None else partial(images.get, file.parent)
                    record = _record(obj, version, is_eval, load)
                except (ValueError, RecursionError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
                    detail = str(exc) if isinstance(exc, _Rule) else f"{type(exc).__name__}: {exc}"
                    raise ValueError(f"{file}:{lineno}: not a dump record: {detail}") from None
                yield record
