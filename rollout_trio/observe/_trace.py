"""Episode traces as Chrome trace JSON (open the file in https://ui.perfetto.dev or chrome://tracing).

:class:`TraceRecorder` is an executor observer; :class:`TracedEngine` wraps the engine so
that each generation shows inside its episode. Each task gets a track (``task N``) holding
``queued`` -> ``episode`` -> ``buffered`` slices and instants for its reward, its outcome
and its consumption; each slot of a group gets a track under it with its generations.
Times are Trio's clock, in microseconds from the first event.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import trio

from ..workflow_context import get as _current_context
from .._io import ModelRequest, ModelResponse
from ..engines._protocol import InferenceEngine, WeightsSource
from ..executor._observer import Status
from ..phases import PhaseRecord
from ._metrics import result_size

__all__ = ["TraceRecorder", "TracedEngine", "open_trace"]

_PID = 1
_SLOTS = 1000  # track ids: task * _SLOTS for the task, + 1 + slot for a slot's generations


_QUEUED, _STARTED, _FINISHED, _CONSUMED, _GENERATION, _PHASE = range(6)


class TraceRecorder:
    """Records every task's lifecycle (an :class:`~rollout_trio.executor.ExecutorObserver`).

    :meth:`write` saves what was recorded; :func:`open_trace` does it when a block ends.
    Memory grows with the events recorded (a few per task and one per generation).

    Each call only appends a tuple of its arguments to a log (no dict, no formatting: at
    thousands of episodes per second that was most of the cost of tracing); :attr:`events`,
    :meth:`trace` and :meth:`write` turn the log into Chrome trace events first. Like the
    executor's observer calls, everything runs on the Trio thread.
    """

    def __init__(self) -> None:
        self._log: list[tuple[Any, ...]] = []
        self._events: list[dict[str, Any]] = []
        self._origin: float | None = None
        self._queued: dict[int, float] = {}
        self._started: dict[int, tuple[float, int]] = {}
        self._buffered: dict[int, float] = {}
        self._named: set[int] = set()

    @property
    def events(self) -> list[dict[str, Any]]:
        """The Chrome trace events recorded so far (metadata, slices and instants, in order)."""
        self._format()
        return self._events

    # -- ExecutorObserver ------------------------------------------------------------------

    def task_queued(self, task_id: int, *, is_eval: bool, time: float) -> None:
        self._log.append((_QUEUED, task_id, is_eval, time))

    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        self._log.append((_STARTED, task_id, version, time))

    def task_finished(self, task_id: int, *, status: Status, reason: str | None, result: Any, time: float) -> None:
        # the rewards, not the result (it is freed once taken); a tuple holding only numbers and
        # strings leaves the garbage collector's sight, the log of a long run costs it nothing
        rewards = tuple(result_size(result)[2]) if result is not None else None
        self._log.append((_FINISHED, task_id, status, reason, rewards, time))

    def task_consumed(self, task_id: int, *, version: int, lag: int, time: float) -> None:
        self._log.append((_CONSUMED, task_id, version, lag, time))

    # -- generations (from TracedEngine) -----------------------------------------------------

    def generation(self, request: ModelRequest, response: ModelResponse | None, start: float, end: float) -> None:
        """Record one ``agenerate`` call of the current task (None response: it raised)."""
        ctx = _current_context()
        if response is None:
            self._log.append((_GENERATION, ctx.task_id, ctx.sample_idx, start, end, len(request.input_ids), None, None, None))
        else:
            self._log.append(
                (_GENERATION, ctx.task_id, ctx.sample_idx, start, end, len(request.input_ids),
                 len(response.output_tokens), response.stop_reason, tuple(sorted(set(response.output_versions))))
            )  # fmt: skip

    # -- workflow phases (a listener of rollout_trio.phases) -----------------------------------

    def phase(self, record: PhaseRecord) -> None:
        """Record one traced phase that just ended (``add_phase_listener(recorder.phase)``)."""
        try:
            end = trio.current_time()
        except RuntimeError:  # a sync phase that ran in a worker thread: no Trio clock there
            return
        self._log.append(
            (_PHASE, record.task_id, record.sample_idx, end - record.seconds, end, record.phase, record.status, record.session)
        )

    # -- formatting (when the events are read) -----------------------------------------------

    def _format(self) -> None:
        """Turn the log into events (each entry once; the log is then emptied)."""
        log, self._log = self._log, []
        for entry in log:
            kind = entry[0]
            if kind == _QUEUED:
                self._format_queued(*entry[1:])
            elif kind == _STARTED:
                self._format_started(*entry[1:])
            elif kind == _FINISHED:
                self._format_finished(*entry[1:])
            elif kind == _CONSUMED:
                self._format_consumed(*entry[1:])
            elif kind == _PHASE:
                self._format_phase(*entry[1:])
            else:
                self._format_generation(*entry[1:])

    def _us(self, t: float) -> float:
        if self._origin is None:
            self._origin = t
        return round((t - self._origin) * 1e6, 3)

    def _track(self, tid: int, name: str, sort: int) -> None:
        if tid not in self._named:
            self._named.add(tid)
            self._events.append({"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid, "args": {"name": name}})
            self._events.append({"ph": "M", "name": "thread_sort_index", "pid": _PID, "tid": tid, "args": {"sort_index": sort}})

    def _slice(self, name: str, tid: int, start: float, end: float, cat: str, **args: Any) -> None:
        begin = self._us(start)
        self._events.append(
            {"ph": "X", "name": name, "cat": cat, "pid": _PID, "tid": tid, "ts": begin,
             "dur": max(0.0, round(self._us(end) - begin, 3)), "args": args}
        )  # fmt: skip

    def _instant(self, name: str, tid: int, t: float, cat: str, **args: Any) -> None:
        self._events.append({"ph": "i", "s": "t", "name": name, "cat": cat, "pid": _PID, "tid": tid, "ts": self._us(t), "args": args})

    def _format_queued(self, task_id: int, is_eval: bool, time: float) -> None:
        self._us(time)
        self._track(task_id * _SLOTS, f"{'eval ' if is_eval else ''}task {task_id}", task_id * _SLOTS)
        self._queued[task_id] = time

    def _format_started(self, task_id: int, version: int, time: float) -> None:
        queued = self._queued.pop(task_id, time)
        self._slice("queued", task_id * _SLOTS, queued, time, "task")
        self._started[task_id] = (time, version)

    def _format_finished(
        self, task_id: int, status: Status, reason: str | None, rewards: tuple[float, ...] | None, time: float
    ) -> None:
        tid = task_id * _SLOTS
        if task_id in self._queued:  # cancelled before it started
            self._slice("queued", tid, self._queued.pop(task_id), time, "task")
        start, version = self._started.pop(task_id, (None, None))
        if start is not None:
            self._slice("episode", tid, start, time, "task", version=version, status=status, reason=reason)
        if rewards:
            self._instant("reward", tid, time, "reward", rewards=list(rewards), mean=sum(rewards) / len(rewards))
        self._instant(status, tid, time, "outcome", reason=reason)
        if status == "accepted":
            self._buffered[task_id] = time

    def _format_consumed(self, task_id: int, version: int, lag: int, time: float) -> None:
        tid = task_id * _SLOTS
        self._slice("buffered", tid, self._buffered.pop(task_id, time), time, "task")
        self._instant("consumed", tid, time, "outcome", version=version, lag=lag)

    def _format_generation(
        self, task_id: int | None, sample_idx: int | None, start: float, end: float, input_tokens: int,
        output_tokens: int | None, stop_reason: str | None, versions: tuple[int, ...] | None,
    ) -> None:  # fmt: skip
        task = task_id if task_id is not None else -1
        slot = sample_idx or 0
        tid = task * _SLOTS + 1 + slot
        self._track(tid, f"task {task} slot {slot}", tid)
        if versions is None:  # the call raised
            self._slice("generate", tid, start, end, "generation", input_tokens=input_tokens, error=True)
            return
        self._slice(
            "generate", tid, start, end, "generation",
            input_tokens=input_tokens, output_tokens=output_tokens, stop_reason=stop_reason, versions=list(versions),
        )  # fmt: skip

    def _format_phase(
        self, task_id: int | None, sample_idx: int | None, start: float, end: float, name: str, status: str,
        session: int | None,
    ) -> None:  # fmt: skip
        task = task_id if task_id is not None else -1
        slot = sample_idx or 0
        tid = task * _SLOTS + 1 + slot
        self._track(tid, f"task {task} slot {slot}", tid)
        self._slice(name, tid, start, end, "phase", status=status, session=session)

    def trace(self) -> dict[str, Any]:
        """The Chrome trace object (``{"traceEvents": [...]}``)."""
        return {"traceEvents": list(self.events), "displayTimeUnit": "ms", "otherData": {"producer": "rollout-trio"}}

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to ``path`` atomically (a reader never sees half a file)."""
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.trace(), separators=(",", ":")), encoding="utf-8")
        tmp.replace(target)


@contextmanager
def open_trace(path: str | os.PathLike[str]) -> Iterator[TraceRecorder]:
    """A :class:`TraceRecorder` whose trace is written to ``path`` when the block ends (even by an error)."""
    recorder = TraceRecorder()
    try:
        yield recorder
    finally:
        recorder.write(path)


class TracedEngine:
    """``engine`` with each ``agenerate`` recorded in ``recorder``; everything else passes through."""

    def __init__(self, engine: InferenceEngine, recorder: TraceRecorder) -> None:
        self.engine = engine
        self.recorder = recorder

    def __getattr__(self, name: str) -> Any:  # tokenizer, servers, ...: the wrapped engine's
        return getattr(self.engine, name)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        start = trio.current_time()
        response: ModelResponse | None = None
        try:
            response = await self.engine.agenerate(req)
            return response
        finally:
            self.recorder.generation(req, response, start, trio.current_time())

    def get_version(self) -> int:
        return self.engine.get_version()

    def set_version(self, version: int) -> None:
        self.engine.set_version(version)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        await self.engine.update_weights(source, version)

    async def __aenter__(self) -> Self:
        await self.engine.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.engine.__aexit__(exc_type, exc, tb)
