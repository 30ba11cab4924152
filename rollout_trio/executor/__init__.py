"""The rollout executor a trainer embeds: submit / wait / prepare_batch under a staleness bound.

Trio trainers use :func:`open_executor`; others use :class:`SyncRolloutExecutor`, which
runs the executor in a background thread. :class:`TrajectoryDumper` writes what it
produces to JSONL; :func:`read_dump` reads it back.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from .._util import lazy_names as _lazy_names

if _TYPE_CHECKING:  # what a type checker sees; at run time each name imports its module on first use
    from ._config import RolloutConfig as RolloutConfig
    from ._dump import DumpRecord as DumpRecord
    from ._dump import TrajectoryDumper as TrajectoryDumper
    from ._dump import read_dump as read_dump
    from ._executor import ExecutorFailed as ExecutorFailed
    from ._executor import RolloutExecutor as RolloutExecutor
    from ._executor import TaskOutcome as TaskOutcome
    from ._executor import open_executor as open_executor
    from ._liveness import ExecutorStalled as ExecutorStalled
    from ._observer import ExecutorObserver as ExecutorObserver
    from ._staleness import RolloutStat as RolloutStat
    from ._staleness import StalenessManager as StalenessManager
    from ._statistics import ExecutorStatistics as ExecutorStatistics
    from ._stream import RolloutStream as RolloutStream
    from ._sync import SyncRolloutExecutor as SyncRolloutExecutor

__all__ = [
    "DumpRecord",
    "ExecutorFailed",
    "ExecutorObserver",
    "ExecutorStalled",
    "ExecutorStatistics",
    "open_executor",
    "read_dump",
    "RolloutConfig",
    "RolloutExecutor",
    "RolloutStat",
    "RolloutStream",
    "StalenessManager",
    "SyncRolloutExecutor",
    "TaskOutcome",
    "TrajectoryDumper",
]

#: Public name -> the private module that defines it (imported on first access, so one
#: name does not load the rest: ``rollout-trio top`` reads a dump without torch).
_LAZY = {
    "RolloutConfig": "._config",
    "DumpRecord": "._dump",
    "TrajectoryDumper": "._dump",
    "read_dump": "._dump",
    "ExecutorFailed": "._executor",
    "RolloutExecutor": "._executor",
    "TaskOutcome": "._executor",
    "open_executor": "._executor",
    "ExecutorStalled": "._liveness",
    "ExecutorObserver": "._observer",
    "RolloutStat": "._staleness",
    "StalenessManager": "._staleness",
    "ExecutorStatistics": "._statistics",
    "RolloutStream": "._stream",
    "SyncRolloutExecutor": "._sync",
}

if not _TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any attribute
    __getattr__, __dir__ = _lazy_names(__name__, _LAZY, globals())
