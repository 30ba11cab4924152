"""A group-scoped, single-flight memo that the slots of one group share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

import trio

__all__ = ["ProcessorCache"]

T = TypeVar("T")


class ProcessorCache:
    """Computes each key once, however many slots ask for it at the same time.

    Slots of a group typically process the same prompt (tokenize it, run an image
    processor): the first caller computes, the others wait for its result. A failed
    computation is not cached; the next caller tries again. Close it with
    :meth:`aclose` when the group ends (the group does this, exactly once).
    """

    def __init__(self) -> None:
        self._values: dict[Hashable, Any] = {}
        self._pending: dict[Hashable, trio.Event] = {}
        self.closed = False

    def __len__(self) -> int:
        return len(self._values)

    async def get_or_compute(self, key: Hashable, compute: Callable[[], Awaitable[T]]) -> T:
        """The value for ``key``, computing it with ``compute()`` if nobody has."""
        while True:
            if self.closed:
                raise trio.ClosedResourceError("the group's processor cache is closed")
            if key in self._values:
                await trio.lowlevel.checkpoint()
                return self._values[key]
            event = self._pending.get(key)
            if event is None:
                break
            await event.wait()  # another slot is computing it; look again when it is done
        event = self._pending[key] = trio.Event()
        try:
            value = await compute()
            self._values[key] = value
            return value
        finally:
            del self._pending[key]
            event.set()

    async def aclose(self) -> None:
        """Drop every value; later lookups raise :class:`trio.ClosedResourceError`."""
        self.closed = True
        self._values.clear()
        await trio.lowlevel.checkpoint()
