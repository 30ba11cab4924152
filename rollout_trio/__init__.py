"""rollout_trio: training-trajectory generation for LLM RL on Trio's structured concurrency.

Workflows are plain ``async def workflow(engine, data)`` functions (or classes with
``arun_episode``) that return a :class:`Trajectory`, a plain tensor dict, a dict of
:class:`Interaction` objects, or ``None`` to reject the rollout.

The names below load on first use, each with its own module only (``rollout_trio.Trajectory``,
``from rollout_trio import Trajectory``): ``import rollout_trio`` alone imports neither torch
nor transformers, and ``Trajectory`` imports torch only when a tensor is checked or made, so
the ``rollout-trio`` command answers ``--help`` at once.
"""

import importlib as _importlib
import sys as _sys
import typing as _typing

from ._util import fixup_module_metadata as _fixup_module_metadata

if _typing.TYPE_CHECKING:  # what a type checker sees; at run time __getattr__ imports each name on first use
    from . import workflow_context as workflow_context
    from ._assemble import GroupStatistics as GroupStatistics
    from ._check import check_trajectory_format as check_trajectory_format
    from ._config import GenerationConfig as GenerationConfig
    from ._convert import converter as converter
    from ._convert import from_json as from_json
    from ._convert import to_json as to_json
    from ._stats import StatsRecorder as StatsRecorder
    from ._stats import StatSummary as StatSummary
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
    from ._errors import VersionLabelError as VersionLabelError
    from ._errors import VersionMismatchError as VersionMismatchError
    from ._errors import WorkflowContractError as WorkflowContractError
    from ._group import GroupedRolloutWorkflow as GroupedRolloutWorkflow
    from ._group import run_group as run_group
    from ._images import ImageInputError as ImageInputError
    from ._interaction import Interaction as Interaction
    from ._interaction import interactions_to_trajectory as interactions_to_trajectory
    from ._io import ModelRequest as ModelRequest
    from ._io import ModelResponse as ModelResponse
    from ._normalize import NormConfig as NormConfig
    from ._normalize import normalize_advantages as normalize_advantages
    from ._normalize import normalize_rewards as normalize_rewards
    from ._normalize import rollout_time_affine as rollout_time_affine
    from ._normalize import rollout_time_apply as rollout_time_apply
    from ._padding import concat_trajectories as concat_trajectories
    from ._padding import split_trajectories as split_trajectories
    from ._rollout_group import RolloutGroup as RolloutGroup
    from ._trajectory import Trajectory as Trajectory
    from ._asyncio import AsyncioTaskCancelled as AsyncioTaskCancelled
    from ._asyncio import on_asyncio as on_asyncio
    from ._asyncio import on_trio as on_trio
    from ._asyncio import run_asyncio as run_asyncio
    from ._workflow import AgentWorkflow as AgentWorkflow
    from ._workflow import AsyncioHostedWorkflow as AsyncioHostedWorkflow
    from ._workflow import RolloutWorkflow as RolloutWorkflow
    from ._workflow import resolve_workflow as resolve_workflow
    from .agents import AgentRolloutWorkflow as AgentRolloutWorkflow
    from .agents import OpenAIEndpoint as OpenAIEndpoint
    from .executor import ExecutorFailed as ExecutorFailed
    from .executor import ExecutorStalled as ExecutorStalled
    from .executor import ExecutorObserver as ExecutorObserver
    from .executor import RolloutConfig as RolloutConfig
    from .executor import RolloutExecutor as RolloutExecutor
    from .executor import SyncRolloutExecutor as SyncRolloutExecutor
    from .executor import TrajectoryDumper as TrajectoryDumper
    from .executor import open_executor as open_executor
    from .executor import read_dump as read_dump
    from .phases import PhaseRecord as PhaseRecord
    from .phases import add_phase_listener as add_phase_listener
    from .phases import new_session as new_session
    from .phases import phase as phase
    from .phases import traced_phase as traced_phase
    from .rewards import RewardFunction as RewardFunction
    from .rewards import RewardTimeoutError as RewardTimeoutError
    from .workflows import MultiTurnWorkflow as MultiTurnWorkflow
    from .workflows import RLVRWorkflow as RLVRWorkflow
    from .workflows import VisionRLVRWorkflow as VisionRLVRWorkflow

__version__ = "0.1.0"

__all__ = [
    "AgentRolloutWorkflow",
    "AgentWorkflow",
    "AsyncioHostedWorkflow",
    "AsyncioTaskCancelled",
    "EngineConnectError",
    "EngineError",
    "EngineLocalError",
    "EngineProtocolError",
    "EngineServerError",
    "EngineTimeoutError",
    "ExecutorFailed",
    "ExecutorStalled",
    "ExecutorObserver",
    "FleetError",
    "GenerationConfig",
    "GroupedRolloutWorkflow",
    "GroupRolloutError",
    "GroupStatistics",
    "ImageInputError",
    "Interaction",
    "ModelRequest",
    "ModelResponse",
    "MultiTurnWorkflow",
    "NormConfig",
    "OpenAIEndpoint",
    "PhaseRecord",
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
    "StatSummary",
    "StatsRecorder",
    "SyncRolloutExecutor",
    "Trajectory",
    "TrajectoryDumper",
    "UnsupportedRequestError",
    "VersionLabelError",
    "VersionMismatchError",
    "VisionRLVRWorkflow",
    "WorkflowContractError",
    "check_trajectory_format",
    "concat_trajectories",
    "converter",
    "from_json",
    "interactions_to_trajectory",
    "add_phase_listener",
    "new_session",
    "phase",
    "traced_phase",
    "normalize_advantages",
    "normalize_rewards",
    "on_asyncio",
    "on_trio",
    "open_executor",
    "read_dump",
    "resolve_workflow",
    "rollout_time_affine",
    "rollout_time_apply",
    "run_asyncio",
    "run_group",
    "split_trajectories",
    "to_json",
    "workflow_context",
]

#: public name -> (module, attribute); attribute None: the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "AgentRolloutWorkflow": (".agents", "AgentRolloutWorkflow"),
    "AgentWorkflow": ("._workflow", "AgentWorkflow"),
    "AsyncioHostedWorkflow": ("._workflow", "AsyncioHostedWorkflow"),
    "AsyncioTaskCancelled": ("._asyncio", "AsyncioTaskCancelled"),
    "on_asyncio": ("._asyncio", "on_asyncio"),
    "on_trio": ("._asyncio", "on_trio"),
    "run_asyncio": ("._asyncio", "run_asyncio"),
    "check_trajectory_format": ("._check", "check_trajectory_format"),
    "concat_trajectories": ("._padding", "concat_trajectories"),
    "converter": ("._convert", "converter"),
    "EngineConnectError": ("._errors", "EngineConnectError"),
    "EngineError": ("._errors", "EngineError"),
    "EngineLocalError": ("._errors", "EngineLocalError"),
    "EngineProtocolError": ("._errors", "EngineProtocolError"),
    "EngineServerError": ("._errors", "EngineServerError"),
    "EngineTimeoutError": ("._errors", "EngineTimeoutError"),
    "ExecutorFailed": (".executor", "ExecutorFailed"),
    "ExecutorStalled": (".executor", "ExecutorStalled"),
    "ExecutorObserver": (".executor", "ExecutorObserver"),
    "FleetError": ("._errors", "FleetError"),
    "from_json": ("._convert", "from_json"),
    "GenerationConfig": ("._config", "GenerationConfig"),
    "GroupedRolloutWorkflow": ("._group", "GroupedRolloutWorkflow"),
    "GroupRolloutError": ("._errors", "GroupRolloutError"),
    "GroupStatistics": ("._assemble", "GroupStatistics"),
    "ImageInputError": ("._images", "ImageInputError"),
    "Interaction": ("._interaction", "Interaction"),
    "interactions_to_trajectory": ("._interaction", "interactions_to_trajectory"),
    "ModelRequest": ("._io", "ModelRequest"),
    "PhaseRecord": (".phases", "PhaseRecord"),
    "add_phase_listener": (".phases", "add_phase_listener"),
    "new_session": (".phases", "new_session"),
    "phase": (".phases", "phase"),
    "traced_phase": (".phases", "traced_phase"),
    "ModelResponse": ("._io", "ModelResponse"),
    "MultiTurnWorkflow": (".workflows", "MultiTurnWorkflow"),
    "normalize_advantages": ("._normalize", "normalize_advantages"),
    "normalize_rewards": ("._normalize", "normalize_rewards"),
    "NormConfig": ("._normalize", "NormConfig"),
    "open_executor": (".executor", "open_executor"),
    "OpenAIEndpoint": (".agents", "OpenAIEndpoint"),
    "read_dump": (".executor", "read_dump"),
    "resolve_workflow": ("._workflow", "resolve_workflow"),
    "rollout_time_affine": ("._normalize", "rollout_time_affine"),
    "rollout_time_apply": ("._normalize", "rollout_time_apply"),
    "RewardFunction": (".rewards", "RewardFunction"),
    "RewardTimeoutError": (".rewards", "RewardTimeoutError"),
    "RewardValueError": ("._errors", "RewardValueError"),
    "RLVRWorkflow": (".workflows", "RLVRWorkflow"),
    "RolloutConfig": (".executor", "RolloutConfig"),
    "RolloutError": ("._errors", "RolloutError"),
    "RolloutExecutor": (".executor", "RolloutExecutor"),
    "RolloutGroup": ("._rollout_group", "RolloutGroup"),
    "RolloutWorkflow": ("._workflow", "RolloutWorkflow"),
    "run_group": ("._group", "run_group"),
    "ServerUnavailableError": ("._errors", "ServerUnavailableError"),
    "split_trajectories": ("._padding", "split_trajectories"),
    "StatSummary": ("._stats", "StatSummary"),
    "StatsRecorder": ("._stats", "StatsRecorder"),
    "SyncRolloutExecutor": (".executor", "SyncRolloutExecutor"),
    "to_json": ("._convert", "to_json"),
    "Trajectory": ("._trajectory", "Trajectory"),
    "TrajectoryDumper": (".executor", "TrajectoryDumper"),
    "UnsupportedRequestError": ("._errors", "UnsupportedRequestError"),
    "VersionLabelError": ("._errors", "VersionLabelError"),
    "VersionMismatchError": ("._errors", "VersionMismatchError"),
    "VisionRLVRWorkflow": (".workflows", "VisionRLVRWorkflow"),
    "workflow_context": (".workflow_context", None),
    "WorkflowContractError": ("._errors", "WorkflowContractError"),
}


_MISSING = object()


def _load(name: str) -> _typing.Any:
    """Import the module of one public name, then make the loaded names report ``rollout_trio``.

    Only that name's module (and what it imports) loads: ``from rollout_trio import
    Trajectory`` does not import the executor, the agents or torch. Every public name whose
    module is fully imported by then is rewritten and kept here, so later lookups skip
    ``__getattr__``. A class's annotations stay tied to the module they were written in
    (:func:`~rollout_trio._util.fixup_module_metadata`), so cattrs and ``get_type_hints``
    resolve them whichever name loaded first.
    """
    module_name, attribute = _LAZY[name]
    module = _importlib.import_module(module_name, __name__)
    if attribute is None:
        return module
    wanted = getattr(module, attribute)  # first: a lazy subpackage (executor) loads it now
    values: dict[str, _typing.Any] = {}
    for other, (other_module, other_attribute) in _LAZY.items():
        if other_attribute is None or other in globals():
            continue
        loaded = _sys.modules.get(__name__ + other_module if other_module.startswith(".") else other_module)
        spec = getattr(loaded, "__spec__", None)
        if loaded is None or getattr(spec, "_initializing", False):
            continue  # not imported, or still importing (a cycle): its names wait for their own lookup
        value = vars(loaded).get(other_attribute, _MISSING)  # a lazy subpackage's unloaded name stays unloaded
        if value is not _MISSING:
            values[other] = value
    globals().update(values)
    _fixup_module_metadata(__name__, values)
    return wanted


if not _typing.TYPE_CHECKING:  # hidden from type checkers, which would otherwise accept any attribute

    def __getattr__(name: str) -> _typing.Any:
        """A public name imports its own module on first use (a module alone: ``from . import workflow_context``)."""
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return _load(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
