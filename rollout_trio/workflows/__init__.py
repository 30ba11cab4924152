"""Ready-made workflows."""

from ._arithmetic import arithmetic_prompts as arithmetic_prompts
from ._arithmetic import arithmetic_reward as arithmetic_reward
from ._colour import colour_prompts as colour_prompts
from ._colour import colour_reward as colour_reward
from ._multi_turn import MultiTurnWorkflow as MultiTurnWorkflow
from ._rlvr import RewardFn as RewardFn
from ._rlvr import RLVRWorkflow as RLVRWorkflow
from ._rlvr import rlvr_workflow as rlvr_workflow
from ._vision_rlvr import VisionRLVRWorkflow as VisionRLVRWorkflow

__all__ = ["MultiTurnWorkflow", "RLVRWorkflow", "RewardFn", "VisionRLVRWorkflow", "arithmetic_prompts", "arithmetic_reward", "colour_prompts", "colour_reward", "rlvr_workflow"]

from .._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
