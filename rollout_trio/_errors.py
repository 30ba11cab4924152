"""Exceptions raised by rollout_trio.

The hierarchy::

    RolloutError
    ├── WorkflowContractError (also a ValueError)   a workflow result breaks the contract
    │   └── RewardValueError                         a reward is NaN, infinite or not a number
    ├── EngineError                                  an inference engine call failed
    │   ├── EngineConnectError                       the server could not be reached
    │   ├── EngineTimeoutError                       a deadline passed
    │   ├── EngineServerError                        the server answered with an error status
    │   ├── EngineProtocolError                      the server's answer was malformed
    │   ├── VersionMismatchError                     a server reported an unexpected weight version
    │   │   └── VersionLabelError (also EngineProtocolError, ValueError)  a label is not a canonical int64
    │   ├── ServerUnavailableError                   one server of a fleet was taken out of service
    │   ├── FleetError                               a control call (pause, update...) failed on servers
    │   └── UnsupportedRequestError (also ValueError) the engine cannot honour a request setting
    └── GroupRolloutError (also an ExceptionGroup)   one or more slots of a group failed

A :class:`GroupRolloutError` is a strict exception group: ``except* ValueError`` and
``eg.split(...)`` reach the slots' exceptions (each noted with its slot index), and the
parts keep the group size and their slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "EngineConnectError",
    "EngineError",
    "EngineLocalError",
    "EngineProtocolError",
    "EngineServerError",
    "EngineTimeoutError",
    "FleetError",
    "GroupRolloutError",
    "RewardValueError",
    "RolloutError",
    "ServerUnavailableError",
    "UnsupportedRequestError",
    "VersionLabelError",
    "VersionMismatchError",
    "WorkflowContractError",
]


class RolloutError(Exception):
    """Root of every exception rollout_trio raises on purpose."""


class WorkflowContractError(RolloutError, ValueError):
    """A workflow result (or a value built for one) breaks the trajectory contract.

    The message names the key, the rule and what was expected and found. It is a
    bug in the workflow, not bad luck, so executors never swallow it.
    """


class RewardValueError(WorkflowContractError):
    """A reward *value* is NaN, infinite, a bool or not a real number.

    Bad luck in one episode (a reward function that divided by zero), not a malformed
    result: the executor rejects that task (reason ``"invalid_reward"``) instead of stopping.
    """


class EngineError(RolloutError):
    """An inference engine call failed."""


class EngineConnectError(EngineError):
    """The inference server could not be reached (refused, reset, DNS)."""


class EngineLocalError(EngineError):
    """This machine ran out of a resource for the call (file descriptors, ports, memory).

    Says nothing about the server: it is never marked down for it. Retried like a
    connect error, since other calls ending free the resource.
    """


class EngineTimeoutError(EngineError):
    """A request or a wait on the engine ran past its deadline."""


class EngineServerError(EngineError):
    """The server answered with an error status.

    ``status_code`` holds the HTTP status (or 0 when the engine is in-process).
    """

    def __init__(self, message: str, *, status_code: int = 0, body: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class EngineProtocolError(EngineError):
    """The server's answer did not have the shape the protocol promises."""


class VersionMismatchError(EngineError):
    """A server reported a weight version other than the one pinned for the segment."""


class VersionLabelError(VersionMismatchError, EngineProtocolError, ValueError):
    """A weight-version label is not ``"default"`` or a canonical decimal integer in
    ``[0, 2**63 - 1]`` (no sign, no leading zero, no space, no ``_``, ASCII digits only).

    ``field`` names where the label was read; ``rule`` is the rule it broke.
    """

    def __init__(self, message: str, *, field: str, rule: str) -> None:
        super().__init__(message)
        self.field = field
        self.rule = rule


class ServerUnavailableError(EngineError):
    """A server could not take part in a control call (unreachable, timed out, 5xx) and was
    taken out of service; it serves again only once healthy and at the fleet's version.

    ``server`` is its base URL; ``__cause__`` is the error that took it out.
    """

    def __init__(self, message: str, *, server: str) -> None:
        super().__init__(message)
        self.server = server


class FleetError(EngineError):
    """A control call (pause, resume, update_weights) failed on one or more servers.

    ``errors`` maps each failed server's base URL to its error. Servers that were merely
    unavailable are skipped (see :class:`ServerUnavailableError`); this is raised when a
    server refused the call or when the call reached no server at all.
    """

    def __init__(self, message: str, errors: dict[str, EngineError]) -> None:
        super().__init__(message)
        self.errors = dict(errors)


class UnsupportedRequestError(EngineError, ValueError):
    """The engine cannot honour a setting of the request and refuses rather than ignore it."""


class GroupRolloutError(ExceptionGroup[Exception], RolloutError):
    """One or more slots of a group raised; the others were cancelled.

    ``exceptions[k]`` is what slot ``slots[k]`` raised (also noted on it);
    ``group_size`` is the group's G. Parts made by ``split``/``subgroup``/``except*``
    are ``GroupRolloutError`` too, with the slots of the exceptions they keep.
    """

    group_size: int
    slots: tuple[int, ...]

    def __new__(
        cls, message: str, exceptions: Sequence[Exception], *, group_size: int, slots: Sequence[int]
    ) -> GroupRolloutError:
        if len(slots) != len(exceptions):
            raise ValueError(f"slots: one per exception ({len(exceptions)}), got {len(slots)}")
        self = super().__new__(cls, message, exceptions)
        self.group_size = group_size
        self.slots = tuple(slots)
        return self

    def __init__(
        self, message: str, exceptions: Sequence[Exception], *, group_size: int, slots: Sequence[int]
    ) -> None:
        super().__init__(message, exceptions)

    def derive(self, excs: Sequence[Exception]) -> GroupRolloutError:  # type: ignore[override]
        """The same group, holding only ``excs`` (called by ``split`` and ``except*``)."""
        # A kept exception is one of ours, or a part of one of our nested groups: it
        # belongs to the slot whose exception holds its leaves.
        owner = {id(leaf): slot for e, slot in zip(self.exceptions, self.slots) for leaf in exception_leaves(e)}
        slots = [owner[id(next(iter(exception_leaves(exc))))] for exc in excs]
        return GroupRolloutError(self.message, excs, group_size=self.group_size, slots=slots)


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions that are not groups inside ``exc`` (``[exc]`` for a plain one)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in exception_leaves(e)]
    return [exc]
