"""Ready-made workflows."""

from ._multi_turn import MultiTurnWorkflow as MultiTurnWorkflow
from ._rlvr import RewardFn as RewardFn
from ._rlvr import RLVRWorkflow as RLVRWorkflow
from ._rlvr import rlvr_workflow as rlvr_workflow
