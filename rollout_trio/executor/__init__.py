"""The rollout executor a trainer embeds: submit / wait / prepare_batch under a staleness bound.

Trio trainers use :func:`open_executor`; others use :class:`SyncRolloutExecutor`, which
runs the executor in a background thread. :class:`TrajectoryDumper` writes what it
produces to JSONL; :func:`read_dump` reads it back.
"""

from .._util import fixup_module_metadata as _fixup_module_metadata
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

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
