"""Watching a run: Prometheus metrics, the live page, ``rollout-trio top``, Perfetto traces.

Metrics and traces are executor observers::

    metrics = ExecutorMetrics()
    async with open_metrics_server(metrics, port=9400) as url:  # url/metrics, url/live
        async with open_executor(engine, config, observers=[metrics]) as ex:
            ...

:func:`metrics_app` is the same server as an ASGI app, to mount in one's own.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from .._util import lazy_names as _lazy_names

if _TYPE_CHECKING:  # what a type checker sees; at run time each name imports its module on first use
    from ._app import metrics_app as metrics_app
    from ._app import open_metrics_server as open_metrics_server
    from ._metrics import ExecutorMetrics as ExecutorMetrics
    from ._metrics import ObservedTransport as ObservedTransport
    from ._metrics import watch_loop_lag as watch_loop_lag
    from ._serve_metrics import ServeMetrics as ServeMetrics
    from ._snapshot import snapshot_from_text as snapshot_from_text
    from ._trace import TracedEngine as TracedEngine
    from ._trace import TraceRecorder as TraceRecorder
    from ._trace import open_trace as open_trace

__all__ = [
    "ExecutorMetrics",
    "ObservedTransport",
    "ServeMetrics",
    "TraceRecorder",
    "TracedEngine",
    "metrics_app",
    "open_metrics_server",
    "open_trace",
    "snapshot_from_text",
    "watch_loop_lag",
]

#: Public name -> the private module that defines it (imported on first access, so one
#: name does not load the rest: ``rollout-trio top`` reads a dump without torch).
_LAZY = {
    "metrics_app": "._app",
    "open_metrics_server": "._app",
    "ExecutorMetrics": "._metrics",
    "ObservedTransport": "._metrics",
    "watch_loop_lag": "._metrics",
    "ServeMetrics": "._serve_metrics",
    "snapshot_from_text": "._snapshot",
    "TracedEngine": "._trace",
    "TraceRecorder": "._trace",
    "open_trace": "._trace",
}

if not _TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any attribute
    __getattr__, __dir__ = _lazy_names(__name__, _LAZY, globals())
