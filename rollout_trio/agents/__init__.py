"""Agent workflows: any OpenAI client talks to the engine; completions become interactions.

An *agent* is any object with ``async def run(data, **kwargs)``. Pass it where a
workflow goes (:func:`~rollout_trio.resolve_workflow` wraps it in
:class:`AgentRolloutWorkflow`), or wrap it yourself to choose the mode, discount and
export style::

    class Agent:
        async def run(self, data, *, base_url, http_client, api_key):
            client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
            reply = await client.chat.completions.create(model="any", messages=data["messages"])
            return 1.0 if "4" in reply.choices[0].message.content else 0.0
"""

from .._util import fixup_module_metadata as _fixup_module_metadata
from ._endpoint import OpenAIEndpoint as OpenAIEndpoint
from .._http import InProcessClient as InProcessClient
from .._http import InProcessTransport as InProcessTransport
from ._schema import APIError as APIError
from ..server import ServerLimits as ServerLimits  # its home is rollout_trio.server, whichever loads first
from ._server import serve_app as serve_app
from ._session import AgentSession as AgentSession
from ._session import assign_rewards as assign_rewards
from ._workflow import AgentProcessError as AgentProcessError
from ._workflow import AgentRolloutWorkflow as AgentRolloutWorkflow

__all__ = [
    "APIError",
    "AgentProcessError",
    "AgentRolloutWorkflow",
    "AgentSession",
    "InProcessClient",
    "InProcessTransport",
    "OpenAIEndpoint",
    "ServerLimits",
    "assign_rewards",
    "serve_app",
]

_fixup_module_metadata(__name__, {k: v for k, v in globals().items() if k != "ServerLimits"})
del _fixup_module_metadata
