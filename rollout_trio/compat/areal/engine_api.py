"""``areal.api.engine_api``: ``InferenceEngine``, and the adapter AReaL workflows see."""

from __future__ import annotations

from typing import Any

from ..._io import ModelRequest
from ...engines._protocol import InferenceEngine
from ._errors import ArealCompatError
from .io_struct import ModelResponse

__all__ = ["ArealEngine", "InferenceEngine"]


class ArealEngine:
    """Wraps one of our engines so that ``agenerate`` returns AReaL's list-typed response.

    Everything else is the wrapped engine's. :class:`~.workflow_api.RolloutWorkflow`
    subclasses get one in ``arun_episode`` without asking.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """``engine.agenerate(req)`` with list sequences.

        Raises:
            ArealCompatError: ``req.gconfig.n_samples`` > 1 (AReaL's engines also refuse it
                in ``agenerate``; use a group).
        """
        if req.gconfig.n_samples != 1:
            raise ArealCompatError(
                f"ModelRequest.gconfig.n_samples={req.gconfig.n_samples}: agenerate returns one sample; "
                "run the workflow in a group (group_size) instead"
            )
        return ModelResponse.from_native(await self.engine.agenerate(req))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def adapt(engine: Any) -> ArealEngine:
    """``engine`` as AReaL workflows expect it (an :class:`ArealEngine` is returned as is)."""
    return engine if isinstance(engine, ArealEngine) else ArealEngine(engine)
