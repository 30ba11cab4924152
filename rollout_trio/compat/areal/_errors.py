"""The error raised when an AReaL name is used with a meaning rollout_trio does not support."""

from __future__ import annotations

__all__ = ["ArealCompatError"]


class ArealCompatError(NotImplementedError):
    """An AReaL name was used with a meaning the compatibility layer does not support.

    The message names the AReaL name and how rollout_trio differs (docs/areal.md).
    """
