"""Progress or a typed error, never silence: how a consumer call waits.

A consumer call (``wait``, ``wait_for_task``, ``rollout_batch``, ``rollout_stream``,
``prepare_batch``) that can no longer finish raises at once; one that waits on something
outside it (a version bump, a resume, a submit) waits, and after ``stall_warning_s``
without progress says once, in a log line, a metric and ``top``, what it waits on. A call
whose tasks end in ``max_consecutive_rejections`` rejections or failures in a row, with
nothing accepted, raises :class:`ExecutorStalled`: a workflow that never succeeds would
otherwise be resubmitted forever.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping

import trio

from .._errors import RolloutError
from ._store import Owner

__all__ = ["CallWait", "ExecutorStalled", "StallWatch"]

logger = logging.getLogger("rollout_trio.executor")


class ExecutorStalled(RolloutError):
    """A consumer call saw ``count`` of its tasks end in a row without one accepted.

    ``reasons`` counts them by reason (``"workflow_exception"``, ``"returned_none"``,
    ``"should_accept_fn"``, ...). The executor goes on; the call's results so far are kept
    for its next call. Raised after ``RolloutConfig.max_consecutive_rejections``.
    """

    def __init__(self, call: str, count: int, reasons: Mapping[str, int]) -> None:
        shown = ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
        super().__init__(
            f"{call}: {count} tasks in a row ended without a trajectory ({shown}); "
            "max_consecutive_rejections stops it here: fix the workflow or its filter, "
            "or raise max_consecutive_rejections (None: never stop)"
        )
        self.call = call
        self.count = count
        self.reasons = dict(reasons)


class StallWatch:
    """One executor's waiting calls: which of them have waited past ``stall_warning_s``.

    ``on_stall(call, waiting_on, waited)`` and ``on_unstall(call)`` tell observers;
    ``describe()`` says what holds work back now.
    """

    def __init__(
        self,
        stall_warning_s: float | None,
        max_consecutive_rejections: int | None,
        describe: Callable[[], str],
        on_stall: Callable[[str, str, float], None],
        on_unstall: Callable[[str], None],
    ) -> None:
        self.stall_warning_s = stall_warning_s
        self.max_consecutive_rejections = max_consecutive_rejections
        self.describe = describe
        self.on_stall = on_stall
        self.on_unstall = on_unstall
        self.stalled: collections.Counter[str] = collections.Counter()  # call name -> calls waiting past the limit

    @contextlib.contextmanager
    def call(self, name: str, owner: Owner, park: Callable[[], Awaitable[None]]) -> Iterator[CallWait]:
        """The waits of one consumer call, for the ``with`` block (the call's whole life)."""
        wait = CallWait(self, name, owner, park)
        try:
            yield wait
        finally:
            wait.unstall()


class CallWait:
    """How one consumer call waits: :meth:`park` instead of parking bare."""

    __slots__ = ("_ended", "_park", "_since", "_watch", "name", "owner", "stalled")

    def __init__(self, watch: StallWatch, name: str, owner: Owner, park: Callable[[], Awaitable[None]]) -> None:
        self._watch = watch
        self.name = name
        self.owner = owner
        self._park = park
        self._since = trio.current_time()
        self._ended = owner.ended
        self.stalled = False

    def check_rejections(self) -> None:
        """Raise :class:`ExecutorStalled` if the owner's tasks ended too often in a row without a trajectory."""
        limit = self._watch.max_consecutive_rejections
        owner = self.owner
        if limit is not None and owner.unaccepted_run >= limit:
            count, reasons = owner.unaccepted_run, dict(owner.unaccepted_reasons)
            owner.unaccepted_run = 0  # the next call gets a fresh allowance
            owner.unaccepted_reasons.clear()
            raise ExecutorStalled(self.name, count, reasons)

    async def park(self, *, check_rejections: bool = True) -> None:
        """Wait for the next change; warn once after ``stall_warning_s`` without progress.

        Raises:
            ExecutorStalled: (``check_rejections``) see :meth:`check_rejections`.
        """
        if check_rejections:
            self.check_rejections()
        if self.owner.ended != self._ended:  # progress since the last wait
            self._ended = self.owner.ended
            self._since = trio.current_time()
            self.unstall()
        limit = self._watch.stall_warning_s
        if self.stalled or limit is None:
            await self._park()
            return
        with trio.move_on_at(self._since + limit) as scope:
            await self._park()
        if scope.cancelled_caught:
            self.stalled = True
            watch = self._watch
            watch.stalled[self.name] += 1
            waited = trio.current_time() - self._since
            waiting_on = watch.describe()
            logger.warning("%s has waited %.0f s without progress: %s", self.name, waited, waiting_on)
            watch.on_stall(self.name, waiting_on, waited)

    def unstall(self) -> None:
        if self.stalled:
            self.stalled = False
            watch = self._watch
            watch.stalled[self.name] -= 1
            if not watch.stalled[self.name]:
                del watch.stalled[self.name]
            watch.on_unstall(self.name)
