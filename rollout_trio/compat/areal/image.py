"""``areal.utils.image``: ``image2base64`` and ``pad_images_batch_to_max_size``, as AReaL 1.0.4 has them."""

from __future__ import annotations

from typing import Any

from ..._images import encode_image_base64

__all__ = ["image2base64", "pad_images_batch_to_max_size"]


def image2base64(images: Any) -> list[str]:
    """One ``PIL`` image or a list of them as base64 PNG strings (each encoded once per image object)."""
    from PIL import Image

    if isinstance(images, Image.Image):
        images = [images]
    return [encode_image_base64(image) for image in images]


def pad_images_batch_to_max_size(images: list[Any]) -> list[Any]:
    """Each image centred on a black RGB canvas of the batch's largest width and height."""
    from PIL import Image

    max_width = max(image.size[0] for image in images)
    max_height = max(image.size[1] for image in images)
    padded = []
    for image in images:
        width, height = image.size
        canvas = Image.new("RGB", (max_width, max_height), (0, 0, 0))
        canvas.paste(image, ((max_width - width) // 2, (max_height - height) // 2))
        padded.append(canvas)
    return padded
