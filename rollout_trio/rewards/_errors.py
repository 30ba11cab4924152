"""Errors of reward computation."""

from __future__ import annotations

from .._errors import RolloutError

__all__ = ["RewardError", "RewardResourceError", "RewardTimeoutError", "RewardWorkerError"]


class RewardError(RolloutError):
    """A reward could not be computed."""


class RewardTimeoutError(RewardError):
    """The reward function ran past its timeout on every attempt (the task is rejected)."""


class RewardWorkerError(RewardError):
    """A reward worker process died (a crash, ``os._exit``, a signal) or failed without a Python exception."""


class RewardResourceError(RewardWorkerError):
    """A process-isolated reward call exceeded one of its ``limits`` (address space, CPU seconds, open files)."""
