"""The vision side of ``rollout-trio replay``: a rebuilt row's ``multi_modal_input`` against
the dumped one (bit for bit), and the vision main job's defaults (workflow, tasks, processor).

A vision row's prompt tokens say how many image placeholders it has, not what the image
shows: two images of one size give equal tokens, so the engine answers either. The
processor's tensors (``pixel_values``, ``image_grid_thw``, ...) are what tell them apart,
and they are compared exactly: same keys, dtype, shape and bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["compare_multi_modal", "default_vision_data", "default_vision_workflow", "load_processor"]

_SAME_SIZE_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _shape(t: Any) -> list[int]:
    return list(t.shape)


def _at(flat_index: int, shape: list[int]) -> list[int]:
    where = []
    for size in reversed(shape):
        where.append(flat_index % size if size else 0)
        flat_index //= max(size, 1)
    return where[::-1]


def _differing(a: Any, b: Any) -> Any:
    """A flat bool tensor: where ``a`` and ``b`` (same dtype and shape) differ in their bits."""
    import torch

    x, y = a.reshape(-1), b.reshape(-1)
    as_int = _SAME_SIZE_INT.get(x.element_size())
    if as_int is not None and x.dtype != torch.bool:
        return x.contiguous().view(getattr(torch, as_int)) != y.contiguous().view(getattr(torch, as_int))
    return x != y


def _item(t: Any, i: list[int]) -> Any:
    value = t[tuple(i)].item() if i else t.item()
    return f"{value:.6g}" if isinstance(value, float) else value


def compare_multi_modal(where: str, got: Mapping[str, Any] | None, dumped: Mapping[str, Any] | None) -> list[str]:
    """How a rebuilt row's ``multi_modal_input`` differs from the dumped one (empty when
    every tensor is the same, bit for bit: keys, dtypes, shapes and bytes).

    Args:
        where: how the problems name the row (``"row #3"``).
        got: the workflow's row's dict (None: a text row).
        dumped: the dump record's dict (None: a text row).

    Returns:
        One line per key that differs.
    """
    import torch

    if got is None and dumped is None:
        return []
    if got is None:
        return [f"{where}: multi_modal_input: the workflow's row has none; the dump has {', '.join(sorted(dumped or {}))}"]
    if dumped is None:
        return [f"{where}: multi_modal_input: the dump has none; the workflow's row has {', '.join(sorted(got))}"]
    problems = []
    for key in sorted(set(got) | set(dumped)):
        name = f"{where}: multi_modal_input.{key}"
        if key not in dumped:
            problems.append(f"{name}: not in the dump")
            continue
        if key not in got:
            problems.append(f"{name}: the workflow's row has none")
            continue
        a, b = got[key], dumped[key]
        if not isinstance(a, torch.Tensor):
            problems.append(f"{name}: the workflow's row holds a {type(a).__name__}, not a tensor")
            continue
        a = a.detach().cpu()
        if a.dtype != b.dtype:
            problems.append(f"{name}: dtype {a.dtype} vs dumped {b.dtype}")
        elif a.shape != b.shape:
            problems.append(f"{name}: shape {_shape(a)} vs dumped {_shape(b)}")
        else:
            diff = _differing(a, b)
            n = int(diff.sum())
            if n:
                first = _at(int(diff.nonzero()[0, 0]), _shape(a))
                problems.append(
                    f"{name} differ in {n} of {diff.numel()} values "
                    f"(first at {first}: {_item(a, first)} vs dumped {_item(b, first)})"
                )
    return problems


def load_processor(path: str | None) -> Any:
    """The processor of a vision dump's replay: the one in ``path`` (``--tokenizer DIR``),
    or the built-in tiny VLM's (the vision main job's)."""
    from ..models_vision import load_vlm_processor, tiny_vlm_processor
    from ._common import CommandError, _one_line

    if path is None:
        return tiny_vlm_processor()
    try:
        return load_vlm_processor(path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--tokenizer {path}: cannot load an image processor and tokenizer from it: {_one_line(str(exc))}") from exc


def default_vision_workflow(processor: Any, max_new_tokens: int) -> Any:
    """The vision main job's workflow (``rollout-trio run --task vision``): the image's colour."""
    from .._config import GenerationConfig
    from ..workflows import VisionRLVRWorkflow, colour_reward

    return VisionRLVRWorkflow(colour_reward, GenerationConfig(max_new_tokens=max_new_tokens), processor=processor)


def default_vision_data(n: int, seed: int) -> list[Any]:
    """The vision main job's ``n`` tasks for ``seed``."""
    from ..workflows import colour_prompts

    return colour_prompts(n, seed=seed)
