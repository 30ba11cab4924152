"""rollout_trio: training-trajectory generation for LLM RL on Trio's structured concurrency."""

from ._config import GenerationConfig as GenerationConfig
from ._errors import EngineConnectError as EngineConnectError
from ._errors import EngineError as EngineError
from ._errors import EngineProtocolError as EngineProtocolError
from ._errors import EngineServerError as EngineServerError
from ._errors import EngineTimeoutError as EngineTimeoutError
from ._errors import RolloutError as RolloutError
from ._errors import UnsupportedRequestError as UnsupportedRequestError
from ._errors import VersionMismatchError as VersionMismatchError
from ._errors import WorkflowContractError as WorkflowContractError
from ._io import ModelRequest as ModelRequest
from ._io import ModelResponse as ModelResponse
from ._rollout_group import RolloutGroup as RolloutGroup
