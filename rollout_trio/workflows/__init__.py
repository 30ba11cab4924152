"""Ready-made workflows."""

from ._rlvr import RewardFn as RewardFn
from ._rlvr import rlvr_workflow as rlvr_workflow

__all__ = ["RewardFn", "rlvr_workflow"]

from .._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
