"""Ready-made workflows."""

from ._rlvr import RewardFn as RewardFn
from ._rlvr import rlvr_workflow as rlvr_workflow
