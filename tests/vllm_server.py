"""A real vLLM server for the live tests: started from bench/.vllm-venv on loopback, with
the flags docs/remote.md names, serving a tiny model saved from a config.

``ROLLOUT_TRIO_VLLM_URL`` names a server someone else runs instead (then nothing here is
started, and the tests that kill and restart the server skip). The fixtures at the end give
every live module one server per test session (tests/conftest.py imports them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import vllm_env

from .own_deadline import own_deadline

START_DEADLINE_S = 600.0  # vLLM's CPU start (compile and warm-up) takes 60-120 s on 2 idle cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The text server's context: 4 requests of 16,000 tokens take seconds even on a fast CPU, so
#: the abort tests see the server hold them (its gauges refresh every 0.5 s) before they end.
MAX_MODEL_LEN = 16384


def save_tiny_checkpoint(path: Path, *, perturb_seed: int | None = None) -> Path:
    """The tiny Llama saved as a checkpoint; ``perturb_seed`` gives other weights (same shapes)."""
    import torch

    from rollout_trio.models import tiny_model

    model, tokenizer = tiny_model()
    # Room for the abort tests' long requests (tests/test_vllm_live.py, LONGEST); the default
    # RoPE does not depend on it, so answers within 2,048 positions are the local model's.
    model.config.max_position_embeddings = MAX_MODEL_LEN
    if perturb_seed is not None:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class VLLMServer:
    """One ``vllm`` OpenAI server process (token-in/out routes, dev-mode control routes)."""

    def __init__(
        self, model: Path, log: Path, port: int | None = None, *, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
        max_model_len: int = MAX_MODEL_LEN,
    ) -> None:
        self.model, self.log = model, log
        self.extra_env, self.extra_args = dict(env or {}), tuple(args)
        self.max_model_len = max_model_len
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers 200 (or raise, with its log's end)."""
        # VLLM_LOG_STATS_INTERVAL: its /metrics gauges (requests running, waiting) are refreshed
        # when it logs its stats, every 10 s by default: the abort test waits on them.
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE: idle connections stay open 60 s (uvicorn's default, 5 s),
        # so the ones a live test opens before it acts are still there when it acts.
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
                   VLLM_LOG_STATS_INTERVAL="0.5", VLLM_HTTP_TIMEOUT_KEEP_ALIVE="60", **self.extra_env)
        argv = [
            str(vllm_env.python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs", "--max-model-len", str(self.max_model_len), "--dtype", "float32",
            # On CPU this is the share of the machine's memory vLLM reserves (0.92 by default): a
            # tiny model needs little, and other processes on a test machine need the rest.
            "--gpu-memory-utilization", "0.15", *self.extra_args,
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"vLLM did not answer /health within {START_DEADLINE_S:g} s: {self.tail()}")

    def kill(self) -> None:
        """SIGKILL the server's whole process group (its engine core and workers too), and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=60)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


URL_ENV = "ROLLOUT_TRIO_VLLM_URL"


def available() -> bool:
    """Whether a live server can be had: one named by ROLLOUT_TRIO_VLLM_URL, or the environment to start one."""
    return bool(os.environ.get(URL_ENV)) or vllm_env.ready()


SKIP_REASON = f"no real vLLM server: set {URL_ENV}, or build one with `python -m bench.vllm_env`"


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model's base checkpoint, and one with other weights of the same shapes."""
    root = tmp_path_factory.mktemp("vllm-ckpt")
    return save_tiny_checkpoint(root / "base"), save_tiny_checkpoint(root / "other", perturb_seed=5)


@pytest.fixture(scope="session")
def vllm_server(  # type: ignore[no-untyped-def]
    vllm_checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
):
    """The session's server: None when ROLLOUT_TRIO_VLLM_URL names one, else one started here
    on the base checkpoint (killed at the end of the session)."""
    if os.environ.get(URL_ENV):
        yield None
        return
    srv = VLLMServer(vllm_checkpoints[0], tmp_path_factory.mktemp("vllm-log") / "vllm.log")
    with own_deadline(pytestconfig):  # START_DEADLINE_S
        srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="session")
def vllm_url(vllm_server: VLLMServer | None) -> str:
    """The base URL of the server the live tests talk to."""
    return vllm_server.url if vllm_server is not None else os.environ[URL_ENV]


VISION_URL_ENV = "ROLLOUT_TRIO_VLLM_VISION_URL"


def vision_available() -> bool:
    """Whether a vision server can be had: one named by ROLLOUT_TRIO_VLLM_VISION_URL, or the
    vLLM environment with bench/vllm_vision.py's torchvision overlay to start one."""
    from bench import vllm_vision

    return bool(os.environ.get(VISION_URL_ENV)) or vllm_vision.ready()


VISION_SKIP_REASON = (
    f"no real vLLM server for the tiny VLM: set {VISION_URL_ENV}, or build the environment and its "
    "torchvision overlay with `python -m bench.vllm_env && python -m bench.vllm_vision`"
)


@pytest.fixture(scope="session")
def vllm_vision_url(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config):  # type: ignore[no-untyped-def]
    """A second server, on the tiny VLM saved as a checkpoint (rollout_trio.models_vision),
    with the torchvision overlay on its PYTHONPATH; or the one ROLLOUT_TRIO_VLLM_VISION_URL names."""
    if os.environ.get(VISION_URL_ENV):
        yield os.environ[VISION_URL_ENV]
        return
    from bench import vllm_vision
    from rollout_trio.models_vision import save_vlm, tiny_vlm

    checkpoint = tmp_path_factory.mktemp("vllm-vlm") / "tiny-vlm"
    save_vlm(*tiny_vlm(), checkpoint)
    srv = VLLMServer(
        checkpoint, tmp_path_factory.mktemp("vllm-vision-log") / "vllm.log",
        # --enforce-eager: no graph compile at start (the module took 66 / 78 s with it, 47 / 43 s
        # without); these tests check answers against the local model, not decoding speed.
        env=vllm_vision.env(), args=("--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--enforce-eager"),
        max_model_len=2048,  # the tiny VLM's own context
    )  # fmt: skip
    with own_deadline(pytestconfig):  # START_DEADLINE_S
        srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()
