"""One strict converter for request bodies: JSON values are taken as they are.

``"8"`` is not an integer, ``true`` is not a number, ``1.5`` is not an integer, and a string must be valid Unicode (a lone surrogate such as
``"\\ud800"`` cannot be encoded, so it would fail later, deep in a tokenizer).
Every failure raises :class:`TypeRule` with the rule and the value.
"""

from __future__ import annotations

import math
from typing import Any

import cattrs

from .._validate import is_int

__all__ = ["TypeRule", "check_text", "strict_converter"]

_SHOWN = 80  # characters of a refused value quoted in the message


class TypeRule(ValueError):
    """A JSON value of the wrong type (a strict scalar hook refused it)."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def check_text(value: str) -> str:
    """``value`` if it is valid Unicode (encodable as UTF-8).

    Raises:
        TypeRule: a lone surrogate, naming its index.
    """
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TypeRule(f"must be valid Unicode, got a lone surrogate at index {exc.start}") from None
    return value


def strict_int(value: Any, _t: Any = None) -> int:
    if not is_int(value):
        raise TypeRule(f"must be an integer, got {_show(value)} ({type(value).__name__})")
    return int(value)


def strict_float(value: Any, _t: Any = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeRule(f"must be a number, got {_show(value)} ({type(value).__name__})")
    return float(value)  # NaN and infinities pass here; a value rule refuses them by name


def finite_float(value: Any, _t: Any = None) -> float:
    """A finite number (for fields without a value rule of their own)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeRule(f"must be a finite number, got {_show(value)} ({type(value).__name__})")
    return float(value)


def strict_bool(value: Any, _t: Any = None) -> bool:
    if not isinstance(value, bool):
        raise TypeRule(f"must be true or false, got {_show(value)} ({type(value).__name__})")
    return value


def strict_str(value: Any, _t: Any = None) -> str:
    if not isinstance(value, str):
        raise TypeRule(f"must be a string, got {_show(value)} ({type(value).__name__})")
    return check_text(value)


def strict_converter(*, forbid_extra_keys: bool = False) -> cattrs.Converter:
    """A cattrs converter whose scalars are structured strictly (see the module doc)."""
    conv = cattrs.Converter(detailed_validation=True, forbid_extra_keys=forbid_extra_keys)
    conv.register_structure_hook(int, strict_int)
    conv.register_structure_hook(float, strict_float)
    conv.register_structure_hook(bool, strict_bool)
    conv.register_structure_hook(str, strict_str)
    return conv
