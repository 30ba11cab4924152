"""Text from other processes made safe to print on a terminal.

A server's error message, a metric's label values, a dump's fields or a router's worker
URL may carry terminal control sequences: ``ESC ] 52`` (writes the clipboard), ``ESC [ 2 J``
(clears the screen), a title change, bidirectional overrides that reorder what is shown.
:func:`terminal_safe` writes every such character as a visible escape (``\\x1b``,
``\\u202e``), so what data holds is shown, never obeyed. Rich markup in data is a separate
hazard: print data through ``rich.text.Text`` (never as a markup string), or pass
``markup=True`` here to escape it for a markup context.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["safe_tree", "terminal_safe"]

# C0 and C1 controls, DEL, line/paragraph separators, and the bidirectional controls
# (embeddings, overrides, isolates, marks) that reorder a terminal line.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_MARKUP = re.compile(r"(\\*)(\[[a-zA-Z#/@].*?\])")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: object, *, markup: bool = False, max_chars: int | None = 10_000) -> str:
    """``str(text)`` with every control character shown as an escape, never sent as itself.

    Args:
        text: anything; its ``str()`` is made safe.
        markup: also escape rich markup (``[bold]``, ``[link=...]``) for a string that is
            printed as markup.
        max_chars: longer text is cut there, with a note of how much was cut (None: no cut).

    Returns:
        Text that holds no control character, DEL, C1 control or bidirectional control.
    """
    s = text if isinstance(text, str) else str(text)
    cut = 0
    if max_chars is not None and len(s) > max_chars:
        cut = len(s) - max_chars
        s = s[:max_chars]
    s = _UNSAFE.sub(_escape, s)
    if markup:
        s = _MARKUP.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", s)
    return s + (f"... ({cut} more characters)" if cut else "")


def safe_tree(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string, keys too,
    passed through :func:`terminal_safe`."""
    if isinstance(value, str):
        return terminal_safe(value)
    if isinstance(value, dict):
        return {safe_tree(k): safe_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(safe_tree(v) for v in value)
    return value
