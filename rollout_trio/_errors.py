"""Exceptions raised by rollout_trio.

The hierarchy::

    RolloutError
    ├── WorkflowContractError (also a ValueError)   a workflow result breaks the contract
    ├── EngineError                                  an inference engine call failed
    │   ├── EngineConnectError                       the server could not be reached
    │   ├── EngineTimeoutError                       a deadline passed
    │   ├── EngineServerError                        the server answered with an error status
    │   ├── EngineProtocolError                      the server's answer was malformed
    │   ├── VersionMismatchError                     a server reported an unexpected weight version
    │   └── UnsupportedRequestError (also ValueError) the engine cannot honour a request setting
    └── GroupRolloutError (also an ExceptionGroup)   one or more slots of a group failed
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EngineConnectError",
    "EngineError",
    "EngineProtocolError",
    "EngineServerError",
    "EngineTimeoutError",
    "RolloutError",
    "UnsupportedRequestError",
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


class EngineError(RolloutError):
    """An inference engine call failed."""


class EngineConnectError(EngineError):
    """The inference server could not be reached (refused, reset, DNS)."""


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


class UnsupportedRequestError(EngineError, ValueError):
    """The engine cannot honour a setting of the request and refuses rather than ignore it."""
