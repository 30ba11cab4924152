"""Talk to AReaL 1.0.4's worker subprocess (bench/areal_worker.py) from rollout_trio's side.

Used by ``python -m bench`` and by the differential tests (tests/test_areal_differential.py).
Tensors cross the pipe as ``{"dtype", "shape", "data"}`` with ``data`` flat, which is
exact for every dtype used (float32 and float64 survive a JSON round trip).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def encode(value: Any) -> Any:
    """A tensor as JSON (other values pass through)."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape), "data": value.flatten().tolist()}
    return value


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, dict) and set(value) == {"dtype", "shape", "data"}:
        return torch.tensor(value["data"], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
    return value


class Areal:
    """AReaL's worker: one JSON command per line on stdin, one JSON answer per line back."""

    def __init__(self, python: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        self._proc = subprocess.Popen(
            [str(python), str(ROOT / "bench" / "areal_worker.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        while line := self._proc.stdout.readline():
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"AReaL worker exited ({self._proc.wait()})")

    def __call__(self, op: str, **kwargs: Any) -> Any:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self._proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"AReaL side, {op}: {out['error']}")
        return out

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(30)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> Areal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
