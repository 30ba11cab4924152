"""Keep the reason of a skip raised inside a Trio test.

pytest-trio 0.8.0 runs a Trio test inside its fixtures' nursery; a ``pytest.skip(reason)``
there reaches it wrapped in an exception group, and it re-raises a bare ``pytest.skip()``:
every such skip then reads "Skipped", without its reason (a starved vLLM server, a missing
binary). This wrapper re-raises the test's own skip, whose ``__context__`` is that group.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

Skipped = pytest.skip.Exception


def _only_leaf(group: BaseException | None) -> BaseException | None:
    """The single non-group exception inside ``group``, or None."""
    if not isinstance(group, BaseExceptionGroup):
        return None
    leaves: list[BaseException] = []
    queue: list[BaseException] = [group]
    while queue:
        exc = queue.pop()
        if isinstance(exc, BaseExceptionGroup):
            queue.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else None


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, Any, Any]:
    """Re-raise the skip the test raised when pytest-trio replaced it by one without a reason."""
    try:
        return (yield)
    except Skipped as exc:
        inner = _only_leaf(exc.__context__)
        if not exc.msg and isinstance(inner, Skipped) and inner.msg:
            raise inner from None
        raise
