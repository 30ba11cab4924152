"""Pause, resume and versions: the trainer's control of the executor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from ._admission import Admission
    from ._staleness import StalenessManager

__all__ = ["Control"]


class Control:
    """``pause``, ``resume``, ``set_version``, ``on_version_recovered``, mixed into the executor."""

    if TYPE_CHECKING:  # provided by the executor
        engine: Any
        staleness: StalenessManager
        _admission: Admission
        _control: trio.Lock
        _version: Any

        def _check(self) -> None: ...
        def _notify(self) -> None: ...

    async def pause(self) -> None:
        """Start nothing new and interrupt in-flight generation (the engine's pause).

        Submissions are still queued and finished results still delivered. Pause and
        :meth:`resume` run one at a time, so a resume never overtakes a pause still
        reaching the servers.
        """
        self._check()
        async with self._control:
            self._admission.paused = True  # before the engine: nothing new starts while it pauses
            await self.engine.pause()
        self._notify()

    async def resume(self) -> None:
        """Undo :meth:`pause` (after any pause still in progress has finished).

        The executor resumes even when the engine's resume raises (the error is raised
        after): a server that refuses cannot keep the executor paused.
        """
        self._check()
        async with self._control:
            try:
                await self.engine.resume()
            finally:
                self._admission.paused = False
                self._notify()

    def set_version(self, version: int) -> None:
        """Tell the executor (and a client-versioned engine) the trainer's version.

        The executor's budget and staleness bound use it at once. Engines whose servers
        own their version (``RemoteEngine``: only ``update_weights`` changes a server)
        keep their own: a version announced before the servers have it fails no task.
        """
        self._check()
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version: must be an int, got {version!r}")
        self._version.announced = version
        if not getattr(self.engine, "servers_own_version", False):
            self.engine.set_version(version)
        self._notify()

    def on_version_recovered(self, version: int) -> None:
        """After a checkpoint resume at ``version``: no burst of ``version`` batches of budget."""
        self._check()
        self.staleness.on_version_recovered(version)
        self._notify()
