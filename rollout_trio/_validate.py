"""Small attrs validators whose errors name the class, the field and the rule."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import attrs

from ._errors import WorkflowContractError


def rule(text: str, predicate: Callable[[Any], bool]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator: ``predicate(value)`` must hold, else the error quotes ``text``."""

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not predicate(value):
            raise WorkflowContractError(
                f"{type(instance).__name__}.{attribute.name}: must satisfy {text}, got {value!r}"
            )

    return check


def is_int(value: Any) -> bool:
    """True for integers (Python or NumPy), never for bools."""
    if type(value) is int:  # the common case, without the ABC check
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for finite real numbers (Python or NumPy), never for bools."""
    if type(value) is float:  # the common case, without the ABC check
        return math.isfinite(value)
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def only_type(values: Any, kind: type) -> bool:
    """True if every element of the non-empty ``values`` has exactly type ``kind``."""
    return set(map(type, values)) == {kind}


def int_list(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Every element is a non-negative integer token id."""
    # Fast path: plain ints (the common case) skip the slow numbers.Integral ABC check;
    # set(map(type, ...)) runs in C, a generator per element does not.
    if not value or (only_type(value, int) and min(value) >= 0):
        return
    for i, v in enumerate(value):
        if not is_int(v) or v < 0:
            raise WorkflowContractError(
                f"{type(instance).__name__}.{attribute.name}[{i}]: must be a non-negative "
                f"integer token id, got {v!r} ({type(v).__name__})"
            )
