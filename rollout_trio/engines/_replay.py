"""``ReplayEngine``: an inference engine that answers from a trajectory dump instead of a model."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Protocol

import attrs
import trio

from ..workflow_context import get as current_context
from .._errors import RolloutError
from .._io import ModelRequest, ModelResponse
from ._protocol import WeightsSource

__all__ = ["ReplayEngine", "ReplayMismatchError", "ReplayRecord", "ReplayTokens"]


class ReplayTokens(Protocol):
    """A recorded row's tokens, as a dump holds them (``rollout_trio.read_dump``'s ``tokens``)."""

    @property
    def input_ids(self) -> Sequence[int]: ...
    @property
    def loss_mask(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float] | None: ...
    @property
    def versions(self) -> Sequence[int]: ...


class ReplayRecord(Protocol):
    """What the engine reads of a recorded row (a :func:`rollout_trio.read_dump` record).

    A protocol, so the engines never import the executor that writes and reads dumps.
    """

    @property
    def task_id(self) -> int: ...
    @property
    def sample_idx(self) -> int: ...
    @property
    def is_eval(self) -> bool: ...
    @property
    def is_truncated(self) -> bool | None: ...
    @property
    def tokens(self) -> ReplayTokens | None: ...

TaskKey = tuple[bool, int]  # (is_eval, task_id)


class ReplayMismatchError(RolloutError, LookupError):
    """A request's prompt matches no recorded generation that is left.

    Attributes:
        tasks: the ``(is_eval, task_id)`` pairs whose recordings were searched.
        prompt: the request's token ids.
    """

    def __init__(self, message: str, tasks: Sequence[TaskKey], prompt: Sequence[int]) -> None:
        super().__init__(message)
        self.tasks = list(tasks)
        self.prompt = tuple(prompt)


@attrs.frozen
class _Answer:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    truncated: bool | None  # the row's is_truncated, for the row's last generation only


def _generation_runs(record: ReplayRecord) -> Iterable[tuple[tuple[int, ...], _Answer]]:
    """``(prompt ids, answer)`` for each run of generated tokens of a row, in order."""
    t = record.tokens
    assert t is not None
    n = len(t.input_ids)
    start = 0
    while start < n:
        if t.loss_mask[start] != 1:
            start += 1
            continue
        end = start
        while end < n and t.loss_mask[end] == 1:
            end += 1
        logprobs = tuple(t.logprobs[start:end]) if t.logprobs is not None else (0.0,) * (end - start)
        yield (
            tuple(t.input_ids[:start]),
            _Answer(
                tuple(t.input_ids[start:end]),
                logprobs,
                tuple(t.versions[start:end]),
                record.is_truncated if end == n else False,
            ),
        )
        start = end


def _describe(key: TaskKey) -> str:
    return f"{'eval ' if key[0] else ''}task {key[1]}"


class ReplayEngine:
    """An :class:`~rollout_trio.engines.InferenceEngine` that replays a dump's generations.

    Each generated run of each dumped row answers one ``agenerate`` call whose prompt is
    exactly the row's tokens before that run, with the recorded tokens, logprobs and
    versions; a multi-turn row answers its turns in order. Requests are matched within
    the current task (``workflow_context.get().task_id`` and ``is_eval``, as the executor
    sets them), or across all tasks when no task is set. Recordings with equal prompts
    (a group's slots) are used in ``sample_idx`` order, each once.

    A workflow, a group or a trainer step thereby re-runs without a model, and
    deterministically. A prompt matching nothing left raises :class:`ReplayMismatchError`
    naming the task(s) searched.

    Args:
        records: dump records (from :func:`rollout_trio.executor.read_dump`); those
            without ``tokens`` cannot be replayed and are refused.
        tokenizer: attached to responses, and used to show a mismatching prompt.
    """

    def __init__(self, records: Iterable[ReplayRecord], *, tokenizer: object = None) -> None:
        self.tokenizer = tokenizer
        self._answers: dict[TaskKey, dict[tuple[int, ...], collections.deque[_Answer]]] = {}
        self._rows: collections.Counter[TaskKey] = collections.Counter()
        top = -1
        for r in sorted(records, key=lambda r: (r.is_eval, r.task_id, r.sample_idx)):
            if r.tokens is None:
                raise ValueError(f"records: {_describe((r.is_eval, r.task_id))} row {r.sample_idx} has no 'tokens'; it cannot be replayed")
            key = (r.is_eval, r.task_id)
            self._rows[key] += 1
            per_task = self._answers.setdefault(key, {})
            for prompt, answer in _generation_runs(r):
                per_task.setdefault(prompt, collections.deque()).append(answer)
                top = max(top, *answer.versions)
        self.version = max(top, 0)
        self.answered = 0
        self._resumed = trio.Event()
        self._resumed.set()

    @classmethod
    def from_dump(
        cls,
        path: str | os.PathLike[str],
        *,
        read: Callable[[str | os.PathLike[str]], Iterable[ReplayRecord]],
        tokenizer: object = None,
    ) -> ReplayEngine:
        """An engine replaying every record of the dump at ``path``, read by ``read``
        (``rollout_trio.read_dump``: engines never import the executor, which owns dumps).

        Example: ``ReplayEngine.from_dump("runs/run/seed0", read=rollout_trio.read_dump)``.
        """
        return cls(read(path), tokenizer=tokenizer)

    @property
    def tasks(self) -> list[TaskKey]:
        """The ``(is_eval, task_id)`` pairs recorded, in order."""
        return sorted(self._answers)

    def rows(self, task: TaskKey) -> int:
        """How many rows were recorded for ``task``."""
        return self._rows[task]

    def remaining(self, task: TaskKey | None = None) -> int:
        """Recorded generations not yet used (for ``task``, or in all)."""
        keys = [task] if task is not None else list(self._answers)
        return sum(len(q) for k in keys for q in self._answers.get(k, {}).values())

    async def __aenter__(self) -> ReplayEngine:
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await trio.lowlevel.checkpoint()

    def get_version(self) -> int:
        """The current version (initially the newest recorded)."""
        return self.version

    def set_version(self, version: int) -> None:
        """Set the version (responses keep their recorded per-token versions)."""
        self.version = version

    async def pause(self) -> None:
        """Hold new answers until :meth:`resume`."""
        self._resumed = trio.Event()
        await trio.lowlevel.checkpoint()

    async def resume(self) -> None:
        """Release held answers."""
        self._resumed.set()
        await trio.lowlevel.checkpoint()

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Nothing to load: only sets ``version``."""
        self.set_version(version)
        await trio.lowlevel.checkpoint()

    def _candidates(self) -> list[TaskKey]:
        ctx = current_context()
        if ctx.task_id is None:
            return self.tasks
        return [(ctx.is_eval, ctx.task_id)]

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """The next recorded generation for ``req.input_ids`` in the current task."""
        await self._resumed.wait()
        prompt = tuple(req.input_ids)
        tasks = self._candidates()
        for key in tasks:
            queue = self._answers.get(key, {}).get(prompt)
            if queue:
                answer = queue.popleft()
                break
        else:
            raise ReplayMismatchError(self._mismatch(prompt, tasks), tasks, prompt)
        self.answered += 1
        truncated = answer.truncated if answer.truncated is not None else len(answer.tokens) >= req.gconfig.max_new_tokens
        return ModelResponse(
            input_tokens=prompt,
            output_tokens=answer.tokens,
            output_logprobs=answer.logprobs,
            output_versions=answer.versions,
            stop_reason="length" if truncated else "stop",
            tokenizer=req.tokenizer,
        )

    def _mismatch(self, prompt: tuple[int, ...], tasks: Sequence[TaskKey]) -> str:
        names = ", ".join(_describe(k) for k in tasks[:8]) + (f" and {len(tasks) - 8} more" if len(tasks) > 8 else "")
        if not any(k in self._answers for k in tasks):
            held = ", ".join(_describe(k) for k in self.tasks[:8]) or "nothing"
            return f"prompt matches nothing: {names or 'no task'} is not in the dump (it holds {held})"
        used = any(prompt in self._answers.get(k, {}) for k in tasks)
        why = "its recorded generations are all used" if used else "no recorded prompt is equal"
        # The recorded prompt sharing the longest prefix with this one says where they part.
        # (Ties go to a prompt that goes on past the shared part: it shows what was expected.)
        best, common, score = None, 0, (-1, False)
        for k in tasks:
            for recorded in self._answers.get(k, {}):
                n = next((i for i, (a, b) in enumerate(zip(prompt, recorded)) if a != b), min(len(prompt), len(recorded)))
                if (n, n < len(recorded)) > score:
                    best, common, score = recorded, n, (n, n < len(recorded))
        detail = f"{len(prompt)} prompt tokens"
        if best is not None and not used:
            detail += f"; the closest recorded prompt ({len(best)} tokens) differs from token {common} on"
            decode = getattr(self.tokenizer, "decode", None)
            if decode is not None:
                detail += f": request {decode(list(prompt[common:common + 12]))!r} vs recorded {decode(list(best[common:common + 12]))!r}"
        return f"prompt matches nothing left in {names}: {why} ({detail})"
