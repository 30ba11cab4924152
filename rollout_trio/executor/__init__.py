"""The rollout executor and what it writes: trajectory dumps."""

from .._util import fixup_module_metadata as _fixup_module_metadata
from ._dump import DumpRecord as DumpRecord
from ._dump import TrajectoryDumper as TrajectoryDumper
from ._dump import read_dump as read_dump

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
