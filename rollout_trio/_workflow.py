"""Workflows: what turns one dataset item into trajectories, and how one is resolved."""

from __future__ import annotations

import abc
import importlib
import inspect
import logging
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from ._interaction import Interaction
    from ._trajectory import Trajectory
    from .engines import InferenceEngine

__all__ = ["AgentWorkflow", "AsyncioHostedWorkflow", "RolloutWorkflow", "WorkflowResult", "resolve_workflow"]

logger = logging.getLogger("rollout_trio.workflow")

#: What a workflow may return: tensors, interactions, or None (rejected).
WorkflowResult: TypeAlias = "Trajectory | Mapping[str, Any] | Mapping[str, Interaction] | None"
WorkflowFn: TypeAlias = Callable[["InferenceEngine", Any], Awaitable[Any]]


class RolloutWorkflow(abc.ABC):
    """Base class for class-style workflows (AReaL compatible).

    A plain ``async def workflow(engine, data)`` function works too; subclass this only
    when the workflow keeps state or configuration.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: Any) -> WorkflowResult:
        """Run one logical rollout for ``data`` and return its result."""


class FunctionWorkflow(RolloutWorkflow):
    """Adapts ``async def fn(engine, data, **kwargs)`` to :class:`RolloutWorkflow`."""

    def __init__(self, fn: WorkflowFn, **kwargs: Any) -> None:
        self.fn = fn
        self.kwargs = kwargs

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> WorkflowResult:
        return await self.fn(engine, data, **self.kwargs)

    def __repr__(self) -> str:
        return f"FunctionWorkflow({getattr(self.fn, '__qualname__', self.fn)!r})"


class _DuckWorkflow(RolloutWorkflow):
    """Adapts any object with ``async def arun_episode(engine, data)``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> WorkflowResult:
        return await self.obj.arun_episode(engine, data)

    def __getattr__(self, name: str) -> Any:  # optional hooks live on the wrapped object
        return getattr(self.obj, name)


class AsyncioHostedWorkflow(RolloutWorkflow):
    """Runs a workflow written for asyncio on the hosted asyncio loop (``rollout_trio._asyncio``).

    Its ``arun_episode`` gets the engine as asyncio code needs it: coroutine methods
    (``agenerate``) are served by the engine in Trio, in the episode's task, so cancelling
    the episode cancels the asyncio task and aborts its generations. What
    :func:`resolve_workflow` wraps a workflow marked :func:`~rollout_trio.on_asyncio` in.

    Args:
        workflow: the workflow written for asyncio (its ``arun_episode`` is asyncio code).

    Raises:
        Nothing at construction; the episode raises what the workflow raises.
    """

    def __init__(self, workflow: RolloutWorkflow) -> None:
        self.workflow = workflow

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> WorkflowResult:
        from ._asyncio import asyncio_portal

        async with asyncio_portal() as portal:
            return await portal.run(self.workflow.arun_episode, portal.engine(engine), data)

    def __getattr__(self, name: str) -> Any:  # optional hooks live on the wrapped workflow
        return getattr(self.workflow, name)

    def __repr__(self) -> str:
        return f"AsyncioHostedWorkflow({self.workflow!r})"


class AgentWorkflow(abc.ABC):
    """Deprecated base for agent workflows: any class with ``async def run()`` will do.

    Instantiating a subclass emits a :class:`DeprecationWarning`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> AgentWorkflow:
        warnings.warn(
            f"{cls.__name__} inherits from deprecated AgentWorkflow. You no longer need to "
            "inherit from this class. Any class with a compatible async run() method will work.",
            DeprecationWarning,
            stacklevel=2,
        )
        return super().__new__(cls)

    @abc.abstractmethod
    async def run(self, data: Any, **extra_kwargs: Any) -> Any:
        """Run the agent on ``data``; return its reward(s)."""


def import_from_string(path: str) -> Any:
    """Import ``"package.module.Name"`` and return ``Name``."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"Invalid module path: {path!r}")
    parts = path.rsplit(".", 1)
    if len(parts) != 2:
        raise ValueError(f"Expected format 'module.path.ObjectName', got {len(parts)} part(s).")
    module_name, attr = parts
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ImportError(f"Failed to import module {module_name!r} from path {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"Module {module_name!r} has no attribute {attr!r}.") from None


def _is_async_callable(obj: Any, name: str) -> bool:
    return inspect.iscoroutinefunction(getattr(obj, name, None))


#: Wraps an agent (an object with ``async run()``) as a workflow. The agents layer builds
#: on this module, so it registers itself here when it is imported; the first agent
#: resolved imports it (``rollout_trio.executor`` alone does not, issue 32).
_agent_wrapper: Callable[[Any], RolloutWorkflow] | None = None


def register_agent_wrapper(wrapper: Callable[[Any], RolloutWorkflow]) -> None:
    """Make :func:`resolve_workflow` wrap agents with ``wrapper`` (done by ``rollout_trio.agents``)."""
    global _agent_wrapper
    _agent_wrapper = wrapper


def _agent_workflow(agent: Any, kwargs: Mapping[str, Any] | None, instance_note: str) -> RolloutWorkflow:
    if _agent_wrapper is None:
        importlib.import_module("rollout_trio.agents")  # registers AgentRolloutWorkflow
    if _agent_wrapper is None:  # pragma: no cover - the agents layer registers at import
        raise RuntimeError("rollout_trio.agents did not register its agent wrapper")
    if inspect.isclass(agent):
        agent = agent(**(kwargs or {}))
    elif kwargs is not None:
        logger.warning("workflow_kwargs is ignored when workflow %s", instance_note)
    return _agent_wrapper(agent)


def resolve_workflow(workflow: Any, workflow_kwargs: Mapping[str, Any] | None = None) -> RolloutWorkflow:
    """Turn anything workflow-like into a :class:`RolloutWorkflow` instance.

    Accepts, first match wins: a RolloutWorkflow instance (``workflow_kwargs`` is
    ignored, with a warning); an ``async def (engine, data)`` function (kwargs are bound
    as keyword arguments); a class with ``arun_episode`` (instantiated with
    ``workflow_kwargs``, which is then required); an object with ``async def
    arun_episode``; an import string ``"pkg.module.Name"`` naming any of these; an agent
    (an object or class with ``async def run``), wrapped in ``AgentRolloutWorkflow``.

    Args:
        workflow: any of the above.
        workflow_kwargs: keyword arguments for a class (required) or a function (bound).

    Returns:
        A :class:`RolloutWorkflow` instance.

    Raises:
        ValueError: ``None``, a class without ``workflow_kwargs``, or an import string
            that fails to import.
        TypeError: anything else.

    Which loop runs it: agents run on the hosted asyncio loop unless marked
    :func:`~rollout_trio.on_trio`; every other workflow runs on Trio unless marked
    :func:`~rollout_trio.on_asyncio` (then it is wrapped in :class:`AsyncioHostedWorkflow`).
    """
    return _resolve(workflow, workflow_kwargs, from_string=False)


def _resolve(workflow: Any, kwargs: Mapping[str, Any] | None, *, from_string: bool) -> RolloutWorkflow:
    resolved = _resolve_any(workflow, kwargs, from_string=from_string)
    if isinstance(resolved, AsyncioHostedWorkflow) or isinstance(workflow, str) or not _marked_asyncio(workflow, resolved):
        return resolved
    return AsyncioHostedWorkflow(resolved)


def _marked_asyncio(workflow: Any, resolved: RolloutWorkflow) -> bool:
    """A non-agent workflow marked ``on_asyncio`` (agents choose their host themselves)."""
    from ._asyncio import host_of

    if _agent_wrapper is not None and isinstance(resolved, _agent_wrapper):  # type: ignore[arg-type]
        return False
    return host_of(workflow, default="trio") == "asyncio"


def _resolve_any(workflow: Any, kwargs: Mapping[str, Any] | None, *, from_string: bool) -> RolloutWorkflow:
    if workflow is None:
        raise ValueError("workflow is None; pass an async function, a RolloutWorkflow, a class or an import string")
    if isinstance(workflow, str) and not from_string:
        try:
            target = import_from_string(workflow)
        except (ValueError, ImportError, AttributeError) as exc:
            raise ValueError(f"Failed to import workflow from string {workflow!r}: {exc}") from exc
        return _resolve(target, kwargs, from_string=True)
    instance_note = "resolves to an instance" if from_string else "is already an instance"
    if isinstance(workflow, RolloutWorkflow) or (
        not inspect.isclass(workflow) and _is_async_callable(workflow, "arun_episode")
    ):
        if kwargs is not None:
            logger.warning("workflow_kwargs is ignored when workflow %s", instance_note)
        return workflow if isinstance(workflow, RolloutWorkflow) else _DuckWorkflow(workflow)
    if inspect.isclass(workflow) and _is_async_callable(workflow, "arun_episode"):
        if kwargs is None:
            what = "a class or string" if from_string else "a class"
            raise ValueError(
                f"workflow_kwargs is required when workflow is {what}. "
                f"Got workflow={workflow!r}, but workflow_kwargs=None."
            )
        obj = workflow(**kwargs)
        return obj if isinstance(obj, RolloutWorkflow) else _DuckWorkflow(obj)
    if inspect.iscoroutinefunction(workflow):
        return FunctionWorkflow(workflow, **(kwargs or {}))
    if _is_async_callable(workflow, "run"):
        return _agent_workflow(workflow, kwargs, instance_note)
    raise TypeError(
        "workflow must be an async function (engine, data), a RolloutWorkflow instance or "
        "class, an object with async arun_episode(engine, data), or an import string; "
        f"got {type(workflow).__name__} {workflow!r}"
    )
