"""Limits that light modules read too (a command's ``--help`` shows them without loading torch)."""

from __future__ import annotations

__all__ = ["MAX_DUMP_LINE_BYTES"]

#: The longest dump line :func:`~rollout_trio.read_dump` reads, in bytes (about 1M tokens with
#: their texts). A line is parsed whole, so this bounds the memory one record may take.
MAX_DUMP_LINE_BYTES = 64 * 2**20
