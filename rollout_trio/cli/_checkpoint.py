"""Devices, dtypes and checkpoints for the commands that load a model (``run``, ``serve``,
and ``fleet``'s workers).

What can be checked before torch is imported is (:func:`check_device`,
:func:`check_model_dir`), so that a wrong path or an absent GPU answers at once; the
loaders then run once the options parsed, and their failures are one-line
:class:`CommandError` lines naming the option.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._util import lacks_tokenizer
from ._common import CommandError, _one_line, _type

__all__ = [
    "DTYPES",
    "TINY_VLM",
    "add_model_options",
    "check_chat_template",
    "check_device",
    "check_model_dir",
    "describe_model",
    "device",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "load_vision_model",
    "resolve_device",
    "torch_dtype",
]

_DEVICE = re.compile(r"cpu|mps|cuda(:\d+)?")
device = _type(
    "device", lambda s: s if _DEVICE.fullmatch(s) else None, bool, "cpu, cuda, cuda:N or mps"
)
#: ``--dtype`` values; ``auto`` keeps the checkpoint's own (``dtype`` in its config.json).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_options(p: argparse.ArgumentParser, model_help: str) -> None:
    """``--model``, ``--device`` and ``--dtype``, worded the same for every command."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument(
        "--device", type=device, default=None, help="cpu, cuda, cuda:N or mps (default: cuda if present, else cpu)"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="parameter dtype; auto keeps the checkpoint's (a bfloat16 checkpoint stays bfloat16, on CPU too)",
    )


def torch_dtype(name: str) -> Any:
    """The torch dtype a ``--dtype`` value names; None for ``auto``."""
    import torch

    return None if name == "auto" else getattr(torch, name)


# ---------------------------------------------------------------------------- devices


def _torch_lib_files() -> list[str] | None:
    """The names of the installed torch's native libraries, found without importing torch
    (None when torch is not installed or its layout is unknown)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return os.listdir(os.path.join(next(iter(spec.submodule_search_locations)), "lib"))
    except OSError:
        return None


def _cuda_device_count() -> int | str:
    """How many CUDA devices the NVIDIA driver shows this process (``CUDA_VISIBLE_DEVICES``
    applies), or why none can be used; asked of ``libcuda`` directly, without torch."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "CUDA is not available on this machine (no NVIDIA driver: libcuda.so.1 not found)"
    if driver.cuInit(0) != 0:
        return "CUDA is not available on this machine (the NVIDIA driver found no usable device)"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return "CUDA is not available on this machine (the NVIDIA driver cannot count its devices)"
    return count.value


def check_device(requested: str | None) -> None:
    """Refuse a ``--device`` this machine cannot have, before torch is imported (torch takes
    seconds to import): a :class:`CommandError` worded as :func:`resolve_device`'s.

    Only what is certain is refused: ``cuda`` with a torch built without CUDA, or on Linux
    without an NVIDIA driver or device; ``mps`` off macOS. Anything else is left to
    :func:`resolve_device`, once torch is loaded.

    Args:
        requested: the ``--device`` value (already checked by :data:`device`), or None.

    Raises:
        CommandError: the device cannot exist on this machine.
    """
    if requested is None or requested == "cpu":
        return
    if requested == "mps":
        if sys.platform != "darwin":
            raise CommandError("--device mps: MPS is not available on this machine")
        return
    libs = _torch_lib_files()
    if libs is None or any("hip" in name for name in libs):  # unknown layout, or ROCm's torch: torch decides
        return
    if not any("torch_cuda" in name for name in libs):
        raise CommandError(f"--device {requested}: CUDA is not available on this machine (this torch is built without CUDA)")
    if not sys.platform.startswith("linux"):
        return
    count = _cuda_device_count()
    if isinstance(count, str):
        raise CommandError(f"--device {requested}: {count}")
    index = int(requested.partition(":")[2] or 0)
    if count == 0:
        raise CommandError(f"--device {requested}: CUDA is not available on this machine")
    if index >= count:
        raise CommandError(f"--device {requested}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


# ---------------------------------------------------------------------------- checkpoints


#: ``--model tiny-vlm``: the built-in tiny vision-language model (rollout_trio.models_vision).
TINY_VLM = "tiny-vlm"


def check_model_dir(path: str | None, flag: str = "--model") -> None:
    """Refuse a checkpoint directory that does not exist or holds no tokenizer, before torch is imported.

    Args:
        path: the ``--model`` value, or None (the built-in tiny model), or ``tiny-vlm``.
        flag: the option named in the message.

    Raises:
        CommandError: ``path`` is not a directory, or has no tokenizer files in it.
    """
    if path is not None and path != TINY_VLM and not os.path.isdir(path):
        raise CommandError(f"{flag} {path}: no such checkpoint directory")
    if path is not None and path != TINY_VLM and (why := lacks_tokenizer(path)) is not None:
        raise CommandError(f"{flag} {path}: {why}")


def resolve_device(requested: str | None) -> str:
    """The torch device to use: ``requested`` if this machine has it, else a :class:`CommandError`.

    None picks ``cuda`` when a GPU is present, else ``cpu`` (as ``LocalEngine.from_pretrained``).
    """
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CommandError(f"--device {requested}: CUDA is not available on this machine")
        index = int(requested.partition(":")[2] or 0)
        count = torch.cuda.device_count()
        if index >= count:
            raise CommandError(f"--device {requested}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    elif requested == "mps" and not torch.backends.mps.is_available():
        raise CommandError("--device mps: MPS is not available on this machine")
    return requested


def _out_of_memory() -> type[Exception]:
    """torch's out-of-memory error (a RuntimeError: caught before :func:`_load_errors`, since
    the checkpoint is not at fault)."""
    import torch

    return torch.OutOfMemoryError


def _load_errors() -> tuple[type[Exception], ...]:
    """What loading a checkpoint raises when the checkpoint is at fault: a missing file, a
    config transformers does not know, weights of the wrong shape, safetensors cut short."""
    from safetensors import SafetensorError

    return (OSError, ValueError, RuntimeError, SafetensorError)


@contextmanager
def _loading(path: str, where: str, what: str) -> Iterator[None]:
    """A load's failure as one line naming ``--model``: a device too small, or a checkpoint
    at fault (out-of-memory first: it is a RuntimeError, and the checkpoint is not to blame)."""
    try:
        yield
    except _out_of_memory() as exc:
        raise CommandError(f"--model {path}: does not fit on {where}: {_one_line(str(exc))}") from exc
    except _load_errors() as exc:
        raise CommandError(f"--model {path}: cannot load {what} from it: {_one_line(str(exc))}") from exc


def load_model_and_tokenizer(
    path: str | None, requested_device: str | None, dtype: str = "auto"
) -> tuple[Any, Any, str]:
    """``(model, tokenizer, name)`` for ``--model``, ``--device`` and ``--dtype``, the same way
    for every command.

    ``path`` None is the built-in tiny model (a fixed one: ``--seed`` seeds sampling, not weights).
    """
    from ..models import load_model, tiny_model

    _quiet_transformers()
    where = resolve_device(requested_device)
    if path is None:
        import torch

        model, tokenizer = tiny_model(device=where, dtype=torch_dtype(dtype) or torch.float32)
        return model, tokenizer, "tiny"
    if not os.path.isdir(path):
        raise CommandError(f"--model {path}: no such checkpoint directory")
    with _loading(path, where, "a model and tokenizer"):
        model, tokenizer = load_model(path, device=where, dtype=torch_dtype(dtype))
    return model, tokenizer, path


def load_vision_model(path: str | None, requested_device: str | None, dtype: str = "auto") -> tuple[Any, Any, str] | None:
    """``(model, processor, name)`` when ``--model`` names a vision-language model, else None."""
    import json

    if path != TINY_VLM:
        try:
            with open(os.path.join(path or "", "config.json"), encoding="utf-8") as f:
                if not isinstance(json.load(f).get("vision_config"), dict):
                    return None
        except (OSError, ValueError, AttributeError):
            return None  # not a vision checkpoint: the text loader reports what is wrong
    from ..models_vision import load_vlm, tiny_vlm

    where = resolve_device(requested_device)
    if path == TINY_VLM:
        import torch

        model, processor = tiny_vlm(device=where, dtype=torch_dtype(dtype) or torch.float32)
        return model, processor, TINY_VLM
    assert path is not None
    with _loading(path, where, "a vision model and processor"):
        model, processor = load_vlm(path, device=where, dtype=torch_dtype(dtype))
    return model, processor, path


def check_chat_template(tokenizer: Any, path: str | None) -> None:
    """Refuse a tokenizer without a chat template where a command formats chat prompts.

    Raises:
        CommandError: naming the checkpoint (a base model's tokenizer often has none).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise CommandError(
            f"--model {path}: its tokenizer has no chat template, and the task's prompts are chat messages "
            "(use an instruct checkpoint, or add one: docs/real_model.md)"
        )


def describe_model(model: Any) -> str:
    """``bfloat16 on cuda:0``: where a loaded model's parameters are, for a command's status line."""
    parameter = next(model.parameters())
    return f"{str(parameter.dtype).removeprefix('torch.')} on {parameter.device}"


def load_tokenizer(path: str, flag: str = "--tokenizer") -> Any:
    """A tokenizer from a local directory, or a :class:`CommandError` naming ``flag``."""
    if not os.path.isdir(path):
        raise CommandError(f"{flag} {path}: no such tokenizer directory")
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CommandError(f"{flag} {path}: cannot load a tokenizer from it: {_one_line(str(exc))}") from exc


def _quiet_transformers() -> None:
    """No progress bars from transformers ("Loading weights ...") among a command's own lines."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
