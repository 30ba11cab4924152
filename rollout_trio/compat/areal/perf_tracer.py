"""``areal.utils.perf_tracer``: the session-phase decorators, on :mod:`rollout_trio.phases`.

``trace_session(phase)`` and ``atrace_session_phase(phase)`` record the phase's duration
into the workflow's statistics and every phase listener; ``session_context()`` numbers the
sample. AReaL's global ``PerfTracer`` (its own trace files) is not served.
"""

from __future__ import annotations

from typing import Any

from ...phases import new_session, phase, traced_phase
from ._errors import ArealCompatError

__all__ = ["atrace_session_phase", "session_context", "trace_perf", "trace_session", "trace_session_phase"]

trace_session = traced_phase
session_context = new_session
trace_session_phase = phase
atrace_session_phase = phase


def trace_perf(name: str, *, category: Any = None) -> Any:
    """AReaL's function timer: here a phase named ``name`` (``category`` is ignored)."""
    return traced_phase(name)


def configure(*_: Any, **__: Any) -> None:
    """Not served: rollout_trio writes traces with ``--trace`` / ``open_trace``.

    Raises:
        ArealCompatError: always.
    """
    raise ArealCompatError("perf_tracer.configure: AReaL's PerfTracer is not served; phases go to stats and phase listeners")
