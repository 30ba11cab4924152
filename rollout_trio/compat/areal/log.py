"""``areal.utils.logging``: ``getLogger`` (standard :mod:`logging` loggers under ``areal.``)."""

from __future__ import annotations

import logging

__all__ = ["getLogger"]


def getLogger(name: str | None = None, type_: str | None = None) -> logging.Logger:  # noqa: N802 - AReaL's name
    """The standard logger ``areal.<name>`` (AReaL's colour formatting is not reproduced)."""
    return logging.getLogger(f"areal.{name}" if name else "areal")
