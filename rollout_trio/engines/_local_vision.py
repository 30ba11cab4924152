"""What LocalEngine needs to serve image-text-to-text models: which models and checkpoints
are vision ones, whether a request's images fit the model, and their processor tensors."""

from __future__ import annotations

import json
import os
from typing import Any

import trio

from .._errors import UnsupportedRequestError
from .._images import image_token_id
from .._io import ModelRequest

__all__ = ["check_takes_images", "is_vlm", "is_vlm_checkpoint", "vision_tensors"]


def is_vlm(model: Any) -> bool:
    """The model has a vision tower (its config has a ``vision_config``)."""
    return getattr(model.config, "vision_config", None) is not None


def is_vlm_checkpoint(path: str | os.PathLike[str]) -> bool:
    """The directory's config describes an image-text-to-text model (it has a vision config)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return isinstance(json.load(f).get("vision_config"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def check_takes_images(model: Any, req: ModelRequest) -> None:
    """Refuse an image request the model cannot serve.

    Raises:
        UnsupportedRequestError: a text model, or a processor whose image token is not the model's.
    """
    image_token = getattr(model.config, "image_token_id", None)
    if not isinstance(image_token, int) or not hasattr(getattr(model, "model", None), "get_rope_index"):
        raise UnsupportedRequestError(f"ModelRequest.image_data: this engine's model ({type(model).__name__}) takes no images")
    if image_token_id(req.processor) != image_token:
        raise UnsupportedRequestError(
            f"ModelRequest.processor: its image token {image_token_id(req.processor)} is not the model's ({image_token})"
        )


async def vision_tensors(req: ModelRequest) -> dict[str, Any]:
    """The processor tensors of ``req``'s images: the request's own, or made here (in a thread)."""
    mm: dict[str, Any]
    if req.multi_modal_input is not None:
        mm = req.multi_modal_input
    else:
        processor = req.processor
        images = list(req.image_data)
        mm = await trio.to_thread.run_sync(lambda: dict(processor.image_processor(images=images, return_tensors="pt")))
    return {"pixel_values": mm["pixel_values"], "image_grid_thw": mm["image_grid_thw"]}
