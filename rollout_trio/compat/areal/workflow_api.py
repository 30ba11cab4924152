"""``areal.api.workflow_api``: ``RolloutWorkflow``, ``AgentWorkflow``, ``WorkflowLike``."""

from __future__ import annotations

import functools
from typing import Any

from ..._workflow import AgentWorkflow
from ..._workflow import RolloutWorkflow as NativeRolloutWorkflow
from .engine_api import adapt

__all__ = ["AgentWorkflow", "RolloutWorkflow", "WorkflowLike"]

WorkflowLike = Any


class RolloutWorkflow(NativeRolloutWorkflow):
    """AReaL's base class: a subclass's ``arun_episode`` is handed an engine whose
    ``agenerate`` returns list-typed responses (:class:`~.engine_api.ArealEngine`).

    It is one of our workflows: executors, groups and the CLI run it as they run ours.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("arun_episode")
        if run is None or getattr(run, "_areal_adapted", False):
            return

        @functools.wraps(run)
        async def arun_episode(self: Any, engine: Any, data: Any) -> Any:
            return await run(self, adapt(engine), data)

        arun_episode._areal_adapted = True  # type: ignore[attr-defined]
        cls.arun_episode = arun_episode  # type: ignore[method-assign]
