"""The AReaL 1.0.4 side's own virtual environment, created and filled on first use.

AReaL's wheel declares ~80 dependencies (ray, vLLM helpers, litellm, wandb, ...), nearly
all for parts the benchmarks never touch, and pins torch < 2.11. So it is installed with
``--no-deps``, next to exactly what the imported modules need (see areal_import.py for
which modules): the CPU build of torch (pinned, so pip can never pull a CUDA build),
transformers within AReaL's range, aiohttp, numpy, and the small pure packages its
imports pull in, each pinned to the version this list was checked with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    from ._venv import PinnedVenv
except ImportError:  # run as a script
    from _venv import PinnedVenv  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
VENV = Path(os.environ.get("AREAL_BENCH_VENV", HERE / ".areal-venv"))
AREAL = "areal==1.0.4"

# Resolved with their dependencies (checked with `pip install --dry-run`: no CUDA package).
WITH_DEPS = [
    "torch==2.13.0+cpu",  # the CPU build; an unpinned torch would pull the CUDA one
    "transformers==5.3.0",  # AReaL 1.0.4 wants >=5.0,<=5.3
    "aiohttp==3.14.5",
    "numpy==2.4.6",
    "httpx==0.28.1",
]

# Installed with --no-deps: what AReaL's imported modules import, and nothing they don't.
NO_DEPS = [
    AREAL,
    "einops==0.8.2",  # utils/data.py
    "torchdata==0.11.0",  # utils/data.py, api/engine_api.py (StatefulDataLoader)
    "uvloop==0.23.0",  # api/cli_args.py; AReaL runs rollouts on uvloop
    "hydra-core==1.4.0.dev1",  # api/cli_args.py (AReaL's own pin)
    "omegaconf==2.4.0.dev2",  # hydra, api/cli_args.py (AReaL's own pin)
    "antlr4-python3-runtime==4.11.1",  # hydra's override parser
    "colorlog==6.12.0",  # utils/logging.py
    "numba==0.68.1",  # utils/seqpack.py (imported by utils/data.py)
    "llvmlite==0.50.0",  # numba
    "tenacity==9.2.1",  # infra/utils/http.py
    "pybase64==1.5.1",  # engine/sglang_remote.py
    "lark==1.3.1",  # api/alloc_mode.py
    "requests==2.34.2",  # infra/remote_inf_engine.py (health checks)
    "urllib3==2.8.0",
    "charset-normalizer==3.5.3",
    "psutil==7.2.2",  # utils/fs.py
    "orjson==3.13.0",  # utils/perf_tracer.py
    "aiofiles==25.1.0",  # infra/workflow_executor.py
    "pillow==12.3.0",  # api/io_struct.py
    "openai==2.54.0",  # experimental/openai (GroupedRolloutWorkflow imports it per call)
    "distro==1.9.0",
    "jiter==0.19.0",
    "sniffio==1.3.1",
    "flask==3.1.3",  # infra/controller (sglang_remote imports RolloutController by name)
    "werkzeug==3.1.9",
    "blinker==1.9.0",
    "itsdangerous==2.2.0",
]

ENV = PinnedVenv(VENV, "bench-areal-env.txt", [["install", *WITH_DEPS], ["install", "--no-deps", *NO_DEPS]])


def python() -> Path:
    """The AReaL environment's interpreter."""
    return ENV.python()


def ready() -> bool:
    """True when the environment exists and holds exactly the pinned list."""
    return ENV.ready()


def ensure(log=print) -> Path:
    """Create and fill the environment if it is missing or stale; return its interpreter."""
    if not ready():
        ENV.build("AReaL 1.0.4", log, hint="; torch==2.13.0+cpu must be reachable (a local wheel or a CPU index)")
        ENV.mark()
    return python()


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
