"""The cattrs converter: contract types to and from JSON-ready dicts and config files.

Tensors become ``{"__tensor__": dtype, "shape": [...], "data": [...flat values...]}``,
which round-trips exactly (float32 values survive as Python floats). Unknown keys in
a config dict are an error, so a typo never passes silently.
"""

from __future__ import annotations

import json
from typing import Any

import cattrs
import torch
from cattrs.preconf.json import make_converter

from ._errors import WorkflowContractError
from ._io import ModelRequest, ModelResponse
from ._rollout_group import RolloutGroup
from ._trajectory import Trajectory

__all__ = ["converter", "from_json", "to_json"]

_TAG = "__tensor__"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WorkflowContractError(f"{_TAG}: unknown tensor dtype; expected a torch dtype name, got {name!r}")
    return dtype


def unstructure_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as a JSON-ready dict."""
    return {_TAG: str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.detach().cpu().flatten().tolist()}


def structure_tensor(d: Any, _: Any = None) -> torch.Tensor:
    """The inverse of :func:`unstructure_tensor`."""
    if isinstance(d, torch.Tensor):
        return d
    if not isinstance(d, dict) or _TAG not in d:
        raise WorkflowContractError(f"tensor: expected a dict with {_TAG!r}, 'shape' and 'data', got {type(d).__name__}")
    return torch.tensor(d["data"], dtype=_dtype(d[_TAG])).reshape(d["shape"])


def _encode_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return unstructure_tensor(v)
    if isinstance(v, RolloutGroup):
        return {"__rollout_group__": converter.unstructure(v)}
    return converter.unstructure(v)


def _decode_value(v: Any) -> Any:
    if isinstance(v, dict) and _TAG in v:
        return structure_tensor(v)
    if isinstance(v, dict) and "__rollout_group__" in v:
        return converter.structure(v["__rollout_group__"], RolloutGroup)
    return v


def _unstructure_trajectory(t: Trajectory) -> dict[str, Any]:
    return {k: _encode_value(v) for k, v in t.to_dict().items()}


def _structure_trajectory(d: Any, _: Any) -> Trajectory:
    if not isinstance(d, dict):
        raise WorkflowContractError(f"trajectory: expected a dict, got {type(d).__name__}")
    return Trajectory.from_dict({k: _decode_value(v) for k, v in d.items()})


def _make() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, detailed_validation=False)
    conv.register_unstructure_hook(torch.Tensor, unstructure_tensor)
    conv.register_structure_hook(torch.Tensor, structure_tensor)
    conv.register_unstructure_hook(Trajectory, _unstructure_trajectory)
    conv.register_structure_hook(Trajectory, _structure_trajectory)
    for cls in (ModelRequest, ModelResponse):
        # The tokenizer is a live object, never serialized; so is a request's processor, and
        # its processor tensors are what the processor makes again from the images, which
        # travel as base64 PNG (a request read back needs its processor given again).
        live: dict[str, Any] = {"tokenizer": cattrs.gen.override(omit=True)}
        if cls is ModelRequest:
            live |= {"processor": cattrs.gen.override(omit=True), "multi_modal_input": cattrs.gen.override(omit=True)}
            live_out: dict[str, Any] = {**live, "image_data": cattrs.gen.override(unstruct_hook=_images_base64)}
        else:
            live_out = live
        conv.register_unstructure_hook(cls, cattrs.gen.make_dict_unstructure_fn(cls, conv, **live_out))
        conv.register_structure_hook(
            cls, cattrs.gen.make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True, **live)
        )
    return conv


def _images_base64(images: tuple[Any, ...]) -> list[str]:
    from ._images import encode_image_base64

    return [encode_image_base64(img) for img in images]


#: The converter for every contract type (``converter.unstructure`` / ``converter.structure``).
converter: cattrs.Converter = _make()


def to_json(value: Any) -> str:
    """``value`` (a contract type) as a JSON string.

    Args:
        value: a contract type (:class:`ModelRequest`, :class:`ModelResponse`,
            :class:`Trajectory`, ...), or lists and dicts of them.

    Returns:
        Its JSON text, which :func:`from_json` reads back.

    Raises:
        TypeError: ``value`` holds something JSON cannot carry (an arbitrary object).
    """
    return json.dumps(converter.unstructure(value))


def from_json(text: str | bytes, cls: type[Any]) -> Any:
    """Parse JSON made by :func:`to_json` back into ``cls``.

    Args:
        text: the JSON text.
        cls: the contract type to build (:class:`ModelRequest`, ...).

    Returns:
        An instance of ``cls``.

    Raises:
        ValueError: ``text`` is not JSON (``json.JSONDecodeError``).
        cattrs.errors.CattrsError: the JSON does not describe a ``cls`` (an unknown field:
            ``ForbiddenExtraKeysError``; a field of the wrong type: ``ClassValidationError``).
        AttributeError: the JSON is not an object where ``cls`` needs one.
    """
    return converter.structure(json.loads(text), cls)

