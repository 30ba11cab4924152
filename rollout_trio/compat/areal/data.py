"""``areal.utils.data``: ``concat_padded_tensors`` on our :func:`~rollout_trio.concat_trajectories`."""

from __future__ import annotations

from typing import Any

from ..._padding import concat_trajectories

__all__ = ["concat_padded_tensors"]


def concat_padded_tensors(tensor_dicts: list[dict[str, Any]], pad_value: float = 0.0) -> dict[str, Any]:
    """Concatenate ``[1, L]`` tensor dicts along the batch, right-padding to the longest.

    Raises:
        ArealCompatError: ``pad_value`` is not 0 (ours pads with zeros).
    """
    from ._errors import ArealCompatError

    if pad_value != 0.0:
        raise ArealCompatError(f"concat_padded_tensors(pad_value={pad_value!r}): rollout_trio pads with 0 only")
    if not tensor_dicts:
        return {}
    return concat_trajectories(tensor_dicts).to_dict()
