"""Images in requests: decoding (PIL, bytes, base64, data URLs, paths), bounds, mode conversion.

Every image a request carries becomes a loaded RGB ``PIL.Image`` here, or a typed
:class:`ImageInputError` naming the image's index and the rule it broke: decodable (not
truncated), non-empty, within the pixel budget the caller sets and PIL's decompression-bomb
limit (both checked from the header, before any pixel is decoded). Grayscale, palette,
CMYK and alpha modes are converted to RGB (alpha composited on white).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from ._errors import WorkflowContractError

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageInputError",
    "decode_image",
    "decode_images",
    "encode_image_base64",
    "placeholder_runs",
]

#: The default pixel budget of one image (width x height): 16.7M, a 4096x4096 image.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096

#: Longest string taken for a file path (anything longer is base64).
_MAX_PATH_CHARS = 4096


class ImageInputError(WorkflowContractError):
    """An image a request carries breaks a rule; ``rule`` names it (``"decodable"``,
    ``"non-empty"``, ``"pixel budget"``, ``"decompression bomb"``, ``"mode"``,
    ``"processor"``, ``"placeholders"``, ``"placeholder length"``, ``"local files"``)."""

    def __init__(self, message: str, *, rule: str = "") -> None:
        super().__init__(message)
        self.rule = rule


def _fail(where: str, rule: str, detail: str) -> ImageInputError:
    return ImageInputError(f"{where}: {rule}: {detail}", rule=rule)


def _source_bytes(item: Any, where: str, allow_paths: bool) -> tuple[bytes | None, str | None]:
    """``(encoded bytes, None)`` or ``(None, path)`` for a non-PIL item."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item), None
    if isinstance(item, os.PathLike):
        return None, os.fspath(item)
    if not isinstance(item, str):
        raise _fail(where, "decodable", f"must be a PIL image, encoded bytes, a base64 str or a file path; got {type(item).__name__}")
    if item.startswith("data:"):
        header, sep, payload = item.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise _fail(where, "decodable", f"a data URL must be data:image/...;base64,<data>; got {header[:60]!r}")
        item = payload
    elif len(item) <= _MAX_PATH_CHARS and (allow_paths and os.path.isfile(item)):
        return None, item
    try:
        return base64.b64decode(item, validate=True), None
    except (binascii.Error, ValueError):
        pass
    if not allow_paths:
        raise _fail(where, "decodable", "a str must be base64 or a data:image/... URL (this endpoint reads no local files)")
    raise _fail(where, "decodable", f"a str must be an existing file or base64; {item[:60]!r} is neither")


def _to_rgb(img: Any) -> Any:
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if img.mode == "RGB":
        return img
    return img.convert("RGB")


def decode_image(item: Any, *, where: str = "image", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, allow_paths: bool = True) -> Any:
    """One image as a loaded RGB ``PIL.Image``.

    Args:
        item: a ``PIL.Image``, encoded bytes, a base64 str or ``data:image/...;base64,`` URL,
            or a file path (str or ``os.PathLike``).
        where: names the image in errors (e.g. ``"ModelRequest.image_data[1]"``).
        max_pixels: the pixel budget (width x height).
        allow_paths: whether a str or path may name a local file (False for data from
            other processes).

    Returns:
        A loaded RGB image (``item`` itself when it already is one).

    Raises:
        ImageInputError: naming the rule broken.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        img = item
    else:
        data, path = _source_bytes(item, where, allow_paths)
        if path is not None and not allow_paths:
            raise _fail(where, "local files", "this endpoint reads no local files")
        try:
            img = Image.open(io.BytesIO(data) if data is not None else path)  # type: ignore[arg-type]
        except Image.DecompressionBombError as exc:
            raise _fail(where, "decompression bomb", f"PIL refuses it: {exc}") from None
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise _fail(where, "decodable", f"PIL cannot identify it ({type(exc).__name__}: {str(exc)[:120]})") from None
    width, height = img.size
    if width < 1 or height < 1:
        raise _fail(where, "non-empty", f"size {width}x{height} has no pixels")
    pil_limit = Image.MAX_IMAGE_PIXELS
    if pil_limit is not None and width * height > pil_limit:
        raise _fail(where, "decompression bomb", f"{width}x{height} = {width * height} pixels exceeds PIL's limit {pil_limit}")
    if width * height > max_pixels:
        raise _fail(where, "pixel budget", f"{width}x{height} = {width * height} pixels exceeds the budget of {max_pixels}")
    try:
        img.load()
        return _to_rgb(img)
    except (OSError, ValueError, SyntaxError) as exc:
        raise _fail(where, "decodable", f"decoding failed, truncated or corrupt ({type(exc).__name__}: {str(exc)[:120]})") from None


def decode_images(items: Sequence[Any], *, where: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, allow_paths: bool = True) -> tuple[Any, ...]:
    """:func:`decode_image` of each item, ``where[i]`` naming the ith in errors."""
    return tuple(decode_image(item, where=f"{where}[{i}]", max_pixels=max_pixels, allow_paths=allow_paths) for i, item in enumerate(items))


def placeholder_runs(ids: Sequence[int], token_id: int) -> list[int]:
    """Lengths of the runs of ``token_id`` in ``ids`` (one run per image placeholder)."""
    runs: list[int] = []
    previous = False
    for t in ids:
        if t == token_id:
            if previous:
                runs[-1] += 1
            else:
                runs.append(1)
            previous = True
        else:
            previous = False
    return runs


_B64_CACHE: dict[int, str] = {}
_B64_LOCK = threading.Lock()


def encode_image_base64(img: Any) -> str:
    """``img`` as base64 PNG (what SGLang's ``image_data`` takes), computed once per image
    object however many requests send it."""
    key = id(img)
    with _B64_LOCK:
        cached = _B64_CACHE.get(key)
    if cached is not None:
        return cached
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    encoded = base64.b64encode(buf.getvalue()).decode("ascii")
    with _B64_LOCK:
        if key not in _B64_CACHE:
            _B64_CACHE[key] = encoded
            weakref.finalize(img, _B64_CACHE.pop, key, None)
    return encoded


def image_token_id(processor: Any) -> int | None:
    """The id of the processor's image placeholder token (None where it has none)."""
    tid = getattr(processor, "image_token_id", None)
    if isinstance(tid, int):
        return tid
    token, tokenizer = getattr(processor, "image_token", None), getattr(processor, "tokenizer", None)
    if isinstance(token, str) and tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) else None
    return None


def merge_size(processor: Any) -> int:
    """Pixel rows per placeholder token are ``merge_size ** 2`` (Qwen-VL's spatial merge; 2 by default)."""
    value = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    return value if isinstance(value, int) and value > 0 else 2


def image_token_counts(processor: Any, sizes: Sequence[tuple[int, int]]) -> list[int] | None:
    """How many placeholder tokens ``processor`` makes for images of ``(height, width)``;
    None where the processor cannot say."""
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if count is None:
        return None
    try:
        return [int(n) for n in count(image_sizes=[list(s) for s in sizes])["num_image_tokens"]]
    except Exception:  # noqa: BLE001 - a processor without this arithmetic
        return None


def check_multi_modal_input(mm: Any, *, where: str, n_images: int | None = None, runs: Sequence[int] | None = None, merge: int = 2) -> None:
    """Rules of one row's processor tensors: a dict of str keys; ``pixel_values`` rows match
    ``image_grid_thw``; one grid row per image; each image's placeholder run holds
    ``t*h*w / merge**2`` tokens.

    Raises:
        ImageInputError: naming the key and rule.
    """
    import torch

    if not isinstance(mm, dict) or not all(isinstance(k, str) for k in mm):
        raise _fail(where, "multi_modal_input", f"must be a dict of str keys to processor tensors, got {type(mm).__name__}")
    pixels, grid = mm.get("pixel_values"), mm.get("image_grid_thw")
    if pixels is None or grid is None:
        if n_images:
            raise _fail(where, "multi_modal_input", "needs pixel_values and image_grid_thw for its images")
        return
    if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
        raise _fail(where, "multi_modal_input", "pixel_values and image_grid_thw must be tensors")
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point:
        raise _fail(where, "multi_modal_input", f"image_grid_thw must be integer [n_images, 3], got {grid.dtype} {list(grid.shape)}")
    if pixels.ndim < 1:
        raise _fail(where, "multi_modal_input", "pixel_values must have a row dimension")
    per_image = [int(t) * int(h) * int(w) for t, h, w in grid.tolist()]
    if pixels.shape[0] != sum(per_image):
        raise _fail(where, "pixel rows", f"pixel_values has {pixels.shape[0]} rows, image_grid_thw {grid.tolist()} makes {sum(per_image)}")
    if n_images is not None and len(per_image) != n_images:
        raise _fail(where, "placeholders", f"{n_images} images but image_grid_thw holds {len(per_image)} rows")
    if runs is not None:
        want = [n // (merge * merge) for n in per_image]
        if list(runs) != want:
            raise _fail(where, "image tokens", f"the prompt's image placeholder runs hold {list(runs)} tokens, the pixel rows make {want}")


def check_request_images(
    images: Sequence[Any],
    input_ids: Sequence[int],
    processor: Any,
    multi_modal_input: Any,
    max_pixels: Any,
    *,
    where: str = "ModelRequest",
) -> tuple[Any, ...]:
    """The vision rules of a request; returns its images decoded (see :func:`decode_image`).

    Raises:
        ImageInputError: naming the field and rule.
    """
    if type(max_pixels) is not int or max_pixels < 1:
        raise _fail(f"{where}.max_image_pixels", "pixel budget", f"must be an int >= 1, got {max_pixels!r}")
    if multi_modal_input is not None and not images:
        raise _fail(f"{where}.multi_modal_input", "processor", "needs the image_data it was computed from")
    if not images:
        return ()
    if processor is None:
        raise _fail(f"{where}.processor", "processor", f"{len(images)} images need the processor that makes their placeholders (got none)")
    decoded = decode_images(images, where=f"{where}.image_data", max_pixels=max_pixels)
    tid = image_token_id(processor)
    if tid is None:
        raise _fail(f"{where}.processor", "processor", f"{type(processor).__name__} names no image placeholder token (image_token_id)")
    runs = placeholder_runs(input_ids, tid)
    if len(runs) != len(decoded):
        raise _fail(
            f"{where}.image_data", "placeholders",
            f"{len(decoded)} images but input_ids hold {len(runs)} image placeholders (runs of token {tid})",
        )  # fmt: skip
    if multi_modal_input is not None:
        check_multi_modal_input(multi_modal_input, where=f"{where}.multi_modal_input", n_images=len(decoded), runs=runs, merge=merge_size(processor))
        return decoded
    want = image_token_counts(processor, [(img.height, img.width) for img in decoded])
    if want is not None:
        for i, (got, n) in enumerate(zip(runs, want, strict=True)):
            if got != n:
                raise _fail(
                    f"{where}.image_data[{i}]", "placeholder length",
                    f"its placeholder holds {got} tokens, the processor makes {n} for a {decoded[i].width}x{decoded[i].height} image",
                )  # fmt: skip
    return decoded
