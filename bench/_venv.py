"""A benchmark's side environment: a virtualenv filled by a fixed list of pip steps, and
a marker file recording that list, so that a changed list rebuilds it (areal_env, vllm_env)."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path


class PinnedVenv:
    """``path``'s environment, made by ``steps`` (pip argument lists, run in order)."""

    def __init__(self, path: Path, marker: str, steps: list[list[str]]) -> None:
        self.path, self.marker, self.steps = path, marker, steps

    def python(self) -> Path:
        """The environment's interpreter."""
        return self.path / "bin" / "python"

    def wanted(self) -> str:
        return "\n".join(" ".join(step) for step in self.steps) + "\n"

    def ready(self) -> bool:
        """True when the environment exists and was made by exactly these steps."""
        marker = self.path / self.marker
        return self.python().exists() and marker.exists() and marker.read_text() == self.wanted()

    def build(self, what: str, log=print, hint: str = "") -> Path:
        """Create and fill the environment if it is missing or stale; return its interpreter."""
        if self.ready():
            return self.python()
        log(f"creating the {what} environment in {self.path} (first use; a few minutes)")
        venv.EnvBuilder(with_pip=True, clear=True).create(self.path)
        pip = [str(self.python()), "-m", "pip", "--quiet", "--disable-pip-version-check"]
        for step in self.steps:
            done = subprocess.run([*pip, *step], check=False, stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                raise SystemExit(f"pip {' '.join(step)} failed in {self.path} (exit {done.returncode}){hint}")
        return self.python()

    def mark(self) -> None:
        """Record the steps (after any check the caller makes)."""
        (self.path / self.marker).write_text(self.wanted())
