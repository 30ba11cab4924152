"""torchvision for vLLM's vision models, as an overlay beside the vLLM environment.

vLLM 0.32's Qwen2-VL module (``vllm/model_executor/models/qwen2_vl.py``, line 43) imports
``smart_resize`` from transformers' ``image_processing_qwen2_vl``, which imports
``torchvision.transforms.v2``; and transformers 5's ``Qwen2VLProcessor`` wants a video
processor, which needs torchvision too. The vLLM environment (``bench/vllm_env.py``) has
no torchvision: the index's wheels are CUDA builds whose ``_C.so`` links
``libtorch_cuda.so``/``libc10_cuda.so``, absent next to torch+cpu, and ``import torchvision``
then fails in ``torchvision/_meta_registrations.py`` ("operator torchvision::nms does not
exist": it registers fake kernels for the ops ``_C.so`` would have defined).

This overlay is that wheel, unpacked with ``--no-deps`` into a directory of its own, with
``_meta_registrations.py`` emptied: the Python transforms (all a Qwen2-VL processor uses)
import and run on torch+cpu, and only torchvision's native ops (nms, roi_align, ...) are
missing. A vision server gets it on ``PYTHONPATH`` (:func:`env`); the vLLM environment
itself is unchanged, so the text servers never see it.

``python -m bench.vllm_vision`` builds it (seconds, from the package index).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

try:
    from . import vllm_env
except ImportError:  # run as a script
    import vllm_env  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
OVERLAY = Path(os.environ.get("VLLM_VISION_OVERLAY", HERE / ".vllm-vision-overlay"))
TORCHVISION = "torchvision==0.28.0"  # the release built for torch 2.13 (vllm_env.TORCH)
STUB = '"""Emptied by bench/vllm_vision.py: it registers fakes of _C.so ops, which need CUDA torch."""\n'
MARKER = "bench-vllm-vision.txt"


def ready() -> bool:
    """True when the vLLM environment and this overlay (for its torch) are both there."""
    marker = OVERLAY / MARKER
    return vllm_env.ready() and marker.exists() and marker.read_text() == f"{TORCHVISION}\n{vllm_env.TORCH}\n"


def ensure(log=print) -> Path:
    """Build the overlay if missing or stale; return its directory."""
    if ready():
        return OVERLAY
    python = vllm_env.ensure(log)
    log(f"unpacking {TORCHVISION} (no dependencies) into {OVERLAY}")
    shutil.rmtree(OVERLAY, ignore_errors=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target", str(OVERLAY), TORCHVISION],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    (OVERLAY / "torchvision" / "_meta_registrations.py").write_text(STUB)
    check = "import torchvision.transforms.v2.functional, vllm.model_executor.models.qwen2_vl"
    subprocess.run([str(python), "-c", check], check=True, env=dict(os.environ, **env()), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (OVERLAY / MARKER).write_text(f"{TORCHVISION}\n{vllm_env.TORCH}\n")
    return OVERLAY


def env() -> dict[str, str]:
    """The environment variables a vision server needs (the overlay on ``PYTHONPATH``)."""
    return {"PYTHONPATH": str(OVERLAY)}


if __name__ == "__main__":
    print(ensure())
