"""``ScriptedEngine``: an in-process engine whose answers, delays and failures a test scripts."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .._io import ModelRequest, ModelResponse
from ..engines._protocol import WeightsSource

__all__ = ["ScriptedEngine"]

Script = Callable[[ModelRequest], Awaitable[ModelResponse | None] | ModelResponse | None]


def echo_response(req: ModelRequest, version: int = 0) -> ModelResponse:
    """A deterministic answer: the prompt's last token + 1, ``max_new_tokens`` capped at 4."""
    n = min(4, req.gconfig.max_new_tokens)
    start = (req.input_ids[-1] + 1) if req.input_ids else 0
    return ModelResponse(
        input_tokens=req.input_ids,
        output_tokens=[(start + k) % 256 for k in range(n)],
        output_logprobs=[-0.5] * n,
        output_versions=[version] * n,
        stop_reason="length" if n == req.gconfig.max_new_tokens else "stop",
    )


class ScriptedEngine:
    """An :class:`~rollout_trio.engines.InferenceEngine` for tests of workflows and groups.

    ``script(request)`` (sync or async) decides each answer; returning None means the
    default :func:`echo_response`. ``delay`` seconds pass before each answer. A call
    cancelled while in flight is recorded in :attr:`aborted` (the rid), the way a real
    engine sends a server-side abort; finished calls are in :attr:`completed`.
    ``control_delay`` seconds pass in :meth:`pause` and :meth:`resume` before they act,
    like a fan-out to remote servers. Pauses do not nest: one :meth:`resume` releases
    every held request, and :meth:`update_weights` leaves a pause in effect.
    """

    def __init__(self, script: Script | None = None, *, delay: float = 0.0, control_delay: float = 0.0) -> None:
        self.script = script
        self.delay = delay
        self.control_delay = control_delay
        self.version = 0
        self.requests: list[ModelRequest] = []
        self.completed: list[str] = []
        self.aborted: list[str] = []
        self.in_flight: set[str] = set()
        self._resumed = trio.Event()
        self._resumed.set()

    async def __aenter__(self) -> ScriptedEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await trio.lowlevel.checkpoint()

    def get_version(self) -> int:
        """The current weight version."""
        return self.version

    def set_version(self, version: int) -> None:
        """Set the weight version."""
        self.version = version

    @property
    def paused(self) -> bool:
        """Whether answers are held."""
        return not self._resumed.is_set()

    async def pause(self) -> None:
        """Hold new answers until :meth:`resume`."""
        await trio.sleep(self.control_delay)
        if self._resumed.is_set():  # already paused: the requests held keep waiting on the same event
            self._resumed = trio.Event()

    async def resume(self) -> None:
        """Release held answers."""
        await trio.sleep(self.control_delay)
        self._resumed.set()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Pretend to load ``source``; set ``version``. A pause in effect stays in effect."""
        was_paused = self.paused
        await self.pause()
        self.set_version(version)
        if not was_paused:
            await self.resume()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Answer ``req`` per the script, recording the call, its completion or its abort."""
        self.requests.append(req)
        self.in_flight.add(req.rid)
        try:
            await self._resumed.wait()
            if self.delay == math.inf:
                await trio.sleep_forever()
            await trio.sleep(self.delay)
            answer: Any = self.script(req) if self.script is not None else None
            if hasattr(answer, "__await__"):
                answer = await answer
            resp = answer if answer is not None else echo_response(req, self.version)
        except trio.Cancelled:
            self.aborted.append(req.rid)
            raise
        finally:
            self.in_flight.discard(req.rid)
        self.completed.append(req.rid)
        return resp
