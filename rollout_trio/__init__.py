"""rollout_trio: training-trajectory generation for LLM RL on Trio's structured concurrency.

Workflows are plain ``async def workflow(engine, data)`` functions (or classes with
``arun_episode``) that return a :class:`Trajectory`, a plain tensor dict, a dict of
:class:`Interaction` objects, or ``None`` to reject the rollout.
"""

from . import workflow_context as workflow_context
from ._config import GenerationConfig as GenerationConfig
from ._convert import converter as converter
from ._convert import from_json as from_json
from ._convert import to_json as to_json
from ._errors import EngineConnectError as EngineConnectError
from ._errors import EngineError as EngineError
from ._errors import EngineLocalError as EngineLocalError
from ._errors import EngineProtocolError as EngineProtocolError
from ._errors import EngineServerError as EngineServerError
from ._errors import EngineTimeoutError as EngineTimeoutError
from ._errors import FleetError as FleetError
from ._errors import GroupRolloutError as GroupRolloutError
from ._errors import RewardValueError as RewardValueError
from ._errors import RolloutError as RolloutError
from ._errors import ServerUnavailableError as ServerUnavailableError
from ._errors import UnsupportedRequestError as UnsupportedRequestError
from ._errors import VersionMismatchError as VersionMismatchError
from ._errors import WorkflowContractError as WorkflowContractError
from .executor import ExecutorFailed as ExecutorFailed
from .executor import ExecutorObserver as ExecutorObserver
from .executor import RolloutConfig as RolloutConfig
from .executor import RolloutExecutor as RolloutExecutor
from .executor import SyncRolloutExecutor as SyncRolloutExecutor
from .executor import TrajectoryDumper as TrajectoryDumper
from .executor import read_dump as read_dump
from .executor import open_executor as open_executor
from ._group import GroupedRolloutWorkflow as GroupedRolloutWorkflow
from ._assemble import GroupStatistics as GroupStatistics
from ._group import run_group as run_group
from ._interaction import Interaction as Interaction
from ._interaction import interactions_to_trajectory as interactions_to_trajectory
from ._io import ModelRequest as ModelRequest
from ._normalize import NormConfig as NormConfig
from ._normalize import normalize_advantages as normalize_advantages
from ._normalize import normalize_rewards as normalize_rewards
from ._io import ModelResponse as ModelResponse
from ._padding import concat_trajectories as concat_trajectories
from ._padding import split_trajectories as split_trajectories
from ._rollout_group import RolloutGroup as RolloutGroup
from ._trajectory import Trajectory as Trajectory
from ._check import check_trajectory_format as check_trajectory_format
from ._util import fixup_module_metadata as _fixup_module_metadata
from ._workflow import AgentWorkflow as AgentWorkflow
from ._workflow import RolloutWorkflow as RolloutWorkflow
from ._workflow import resolve_workflow as resolve_workflow
from .agents import AgentRolloutWorkflow as AgentRolloutWorkflow
from .agents import OpenAIEndpoint as OpenAIEndpoint
from .rewards import RewardFunction as RewardFunction
from .rewards import RewardTimeoutError as RewardTimeoutError
from .workflows import MultiTurnWorkflow as MultiTurnWorkflow
from .workflows import RLVRWorkflow as RLVRWorkflow

__version__ = "0.1.0"

__all__ = [
    "AgentRolloutWorkflow",
    "AgentWorkflow",
    "EngineConnectError",
    "EngineError",
    "EngineLocalError",
    "EngineProtocolError",
    "EngineServerError",
    "EngineTimeoutError",
    "ExecutorFailed",
    "ExecutorObserver",
    "FleetError",
    "GenerationConfig",
    "GroupedRolloutWorkflow",
    "GroupRolloutError",
    "GroupStatistics",
    "Interaction",
    "ModelRequest",
    "ModelResponse",
    "MultiTurnWorkflow",
    "NormConfig",
    "OpenAIEndpoint",
    "RewardFunction",
    "RewardTimeoutError",
    "RewardValueError",
    "RLVRWorkflow",
    "RolloutConfig",
    "RolloutError",
    "RolloutExecutor",
    "RolloutGroup",
    "RolloutWorkflow",
    "ServerUnavailableError",
    "SyncRolloutExecutor",
    "Trajectory",
    "TrajectoryDumper",
    "UnsupportedRequestError",
    "VersionMismatchError",
    "WorkflowContractError",
    "check_trajectory_format",
    "concat_trajectories",
    "converter",
    "from_json",
    "interactions_to_trajectory",
    "normalize_advantages",
    "normalize_rewards",
    "open_executor",
    "read_dump",
    "resolve_workflow",
    "run_group",
    "split_trajectories",
    "to_json",
    "workflow_context",
]

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
