"""``AgentRolloutWorkflow``: runs an agent (any object with ``async def run(data, **kw)``).

The agent talks to the engine through an :class:`OpenAIEndpoint` with any OpenAI
client; every completion becomes an :class:`~rollout_trio.Interaction`, and the
agent's return value becomes their rewards (spec §8).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import pickle
import weakref
from typing import TYPE_CHECKING, Any, Literal, cast

import httpx
import trio

from .. import workflow_context
from .._asyncio import Host, asyncio_portal, host_of
from .._config import GenerationConfig
from .._errors import RolloutError
from .._interaction import Interaction
from .._isolation import IsolatedWorkers, WorkerDied
from .._isolation_worker import run_agent
from .._workflow import RolloutWorkflow, register_agent_wrapper
from ._clients import HttpLibrary, http_library_of, open_agent_client
from ._endpoint import OpenAIEndpoint
from ._server import serve_app
from ._session import EXPORT_STYLES, AgentSession, ExportStyle, assign_rewards

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["AgentProcessError", "AgentRolloutWorkflow"]

logger = logging.getLogger("rollout_trio.agents")

Mode = Literal["inline", "subproc"]
MODES: tuple[str, ...] = ("inline", "subproc")
_IN_PROCESS_URL = "http://rollout-trio.agent/v1"


class AgentProcessError(RolloutError):
    """A subprocess agent died or failed in a way that left no Python exception to re-raise."""


@dataclasses.dataclass
class _Raised:
    exc: Exception


class AgentRolloutWorkflow(RolloutWorkflow):
    """Wraps an agent so the executor and groups can run it like any workflow.

    Args:
        agent: an object with ``async def run(data, **kwargs)``. In ``"inline"`` mode it
            is called as ``run(data, base_url=..., http_client=..., api_key=...)``: hand the
            three to ``openai.AsyncOpenAI(base_url=..., api_key=..., http_client=...)``.
            It runs on the hosted asyncio loop (``rollout_trio._asyncio``: asyncio code as
            agent SDKs write it, ``http_client`` an asyncio-side client) unless it is
            marked :func:`~rollout_trio.on_trio` or ``host="trio"`` is passed.
            ``http_client`` is an ``httpx`` client, or an ``httpx2`` one for an agent
            whose module uses the Anthropic SDK (which takes only those) and no
            ``httpx`` SDK (openai, openai-agents, LangChain); ``http_library`` overrides.
            In ``"subproc"`` mode ``run(data)`` runs in a fresh child process (forked by
            a worker supervisor that kills everything it started, ``setsid`` children too,
            when the episode ends or is cancelled) with its own event loop; its return
            value (the rewards) crosses as JSON-like data, and finds
            the endpoint in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (and ``ANTHROPIC_BASE_URL`` /
            ``ANTHROPIC_API_KEY`` for Anthropic clients). The agent must be
            picklable; one defined in a script's ``__main__`` works as with
            multiprocessing's spawn (guard the script's entry point).
        mode: ``"inline"`` (same process, no socket) or ``"subproc"``.
        host: in ``"inline"`` mode, the loop ``run`` runs on: ``"asyncio"`` (a task on the
            hosted asyncio loop; cancelling the episode cancels it) or ``"trio"`` (in the
            episode's Trio task). Default: the agent's mark, else ``"asyncio"``.
        tokenizer: the engine's tokenizer; defaults to ``engine.tokenizer``.
        gconfig: base sampling settings of the endpoint.
        discount: each completion's reward becomes its own plus ``discount`` times the
            next one's (newest to oldest, over the episode's completions).
        export_style: ``"individual"`` (every completion is a row) or ``"concat"``
            (only the last completion of each conversation, carrying its history).
        subproc_max_workers: how many subprocess agents may run at once.
        subproc_backend: the child's event loop (``"trio"`` or ``"asyncio"``, via anyio).
        http_library: the in-process ``http_client``'s library: ``"auto"`` (the rule
            above), ``"httpx"`` or ``"httpx2"``.
        endpoint_kwargs: passed to :class:`OpenAIEndpoint`.

    The episode's result is ``{completion_id: Interaction}``, or None when the agent
    made no completion. An exception in the agent rejects the episode; cancelling the
    episode cancels the agent and aborts its in-flight generations.
    """

    def __init__(
        self,
        agent: Any,
        *,
        mode: Mode = "inline",
        tokenizer: Any = None,
        gconfig: GenerationConfig | None = None,
        discount: float = 1.0,
        export_style: ExportStyle = "individual",
        subproc_max_workers: int = 4,
        subproc_backend: Literal["trio", "asyncio"] = "trio",
        host: Host | None = None,
        http_library: HttpLibrary = "auto",
        **endpoint_kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"Invalid mode: {mode!r}. Must be 'inline' or 'subproc'")
        if agent is None:
            raise ValueError("agent is required when mode is 'inline' or 'subproc'")
        run = getattr(agent, "run", None)
        if not callable(run):
            raise TypeError(
                f"Agent must have a callable 'run' method. Got agent of type {type(agent).__name__} "
                "without a callable 'run' attribute."
            )
        if not inspect.iscoroutinefunction(run):
            raise TypeError(
                f"Agent's 'run' method must be an async function. Got {type(agent).__name__}.run "
                "which is not a coroutine function."
            )
        if export_style not in EXPORT_STYLES:
            raise ValueError(f"export_style: must be one of {EXPORT_STYLES}, got {export_style!r}")
        if not 0 < discount <= 1:
            raise ValueError(f"discount: must be in (0, 1], got {discount!r}")
        if subproc_max_workers < 1:
            raise ValueError(f"subproc_max_workers: must be >= 1, got {subproc_max_workers}")
        if subproc_backend not in ("trio", "asyncio"):
            raise ValueError(f"subproc_backend: must be 'trio' or 'asyncio', got {subproc_backend!r}")
        if host not in (None, "trio", "asyncio"):
            raise ValueError(f"host: must be 'trio', 'asyncio' or None (the agent's mark), got {host!r}")
        self.agent = agent
        self.mode = mode
        self.http_library = http_library_of(agent, http_library)
        self.host: Host = host if host is not None else host_of(agent, default="asyncio")
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.discount = float(discount)
        self.export_style = export_style
        self.subproc_backend = subproc_backend
        self._subproc_limiter = trio.CapacityLimiter(subproc_max_workers)
        self._endpoint_kwargs = endpoint_kwargs
        self._endpoints: weakref.WeakKeyDictionary[Any, OpenAIEndpoint] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return (f"AgentRolloutWorkflow({self.agent!r}, mode={self.mode!r}, host={self.host!r}, "
                f"http_library={self.http_library!r}, export_style={self.export_style!r})")  # fmt: skip

    def endpoint(self, engine: InferenceEngine) -> OpenAIEndpoint:
        """The endpoint serving ``engine`` (one per engine, built on first use)."""
        ep = self._endpoints.get(engine)
        if ep is None:
            # The cached endpoint holds its engine weakly: a strong reference from a
            # WeakKeyDictionary's value would keep every engine ever used alive.
            weak = cast("InferenceEngine", weakref.proxy(engine))
            ep = OpenAIEndpoint(weak, self.tokenizer, gconfig=self.gconfig, **self._endpoint_kwargs)
            self._endpoints[engine] = ep
        return ep

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> dict[str, Interaction] | None:
        endpoint = self.endpoint(engine)
        ctx = workflow_context.get()
        label = str(ctx.task_id) if ctx.sample_idx is None else f"{ctx.task_id}:{ctx.sample_idx}"
        template_type: Literal["hf", "concat"] = "concat" if self.export_style == "concat" else "hf"
        with endpoint.session(chat_template_type=template_type, label=label) as session:
            try:
                if self.mode == "inline":
                    rewards = await self._run_inline(endpoint, session, data)
                else:
                    rewards = await self._run_subproc(endpoint, session, data)
            except Exception as exc:
                logger.warning("Agent task failed (%s: %s). This trajectory will be rejected.", type(exc).__name__, exc)
                raise
        if not session.interactions:
            logger.warning("%r: the agent made no chat completion; the episode is rejected", session)
            return None
        assign_rewards(session, rewards)
        session.apply_discount(self.discount)
        result = session.export(self.export_style)
        if not result:
            return None
        # The episode's outcome is its last completion's reward: the reference group
        # normalization uses for the whole logical rollout (its rows differ once discounted).
        outcome = float(next(reversed(result.values())).reward or 0.0)
        for inter in result.values():
            inter.rollout_reward = outcome
        workflow_context.stats_recorder().record(workflow_context.stat_scope(), {"reward": outcome})
        return result

    async def _run_inline(self, endpoint: OpenAIEndpoint, session: AgentSession, data: Any) -> Any:
        if self.host == "trio":
            return await _run_agent(self.agent, data, self.http_library, endpoint.in_process_transport(), session.key)
        # The agent's requests cross to Trio as calls of this task's portal: cancelling the
        # episode cancels the agent's asyncio task and, at once, its requests' generations.
        async with asyncio_portal() as portal:
            transport = portal.http_transport(endpoint.in_process_transport())
            return await portal.run(_run_agent, self.agent, data, self.http_library, transport, session.key)

    async def _run_subproc(self, endpoint: OpenAIEndpoint, session: AgentSession, data: Any) -> Any:
        payload = pickle.dumps(((self.agent, data, self.subproc_backend), {}))
        try:
            async with self._subproc_limiter:
                reply: Any
                async with trio.open_nursery() as nursery:
                    base = await nursery.start(serve_app, endpoint.app, "127.0.0.1", 0)
                    # The Anthropic SDK appends /v1/messages to its base URL itself.
                    env = {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": session.key,
                           "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": session.key}  # fmt: skip
                    try:
                        # Cancelling the run kills the agent's process group (its requests then disconnect).
                        async with IsolatedWorkers(run_agent, 1, what="agent process") as pool:
                            reply = await pool.run(payload, env=env)
                    except Exception as exc:  # raised outside the nursery, so not as a group
                        reply = _Raised(exc)
                    nursery.cancel_scope.cancel()
            if isinstance(reply, _Raised):
                raise reply.exc
            return reply
        except WorkerDied as exc:
            raise AgentProcessError(str(exc)) from None


async def _run_agent(agent: Any, data: Any, library: Literal["httpx", "httpx2"], transport: httpx.AsyncBaseTransport, key: str) -> Any:
    """``agent.run`` with a client (of ``library``, on the running loop) whose requests the endpoint serves in Trio."""
    async with open_agent_client(library, transport, _IN_PROCESS_URL) as client:
        return await agent.run(data, base_url=_IN_PROCESS_URL, http_client=client, api_key=key)


register_agent_wrapper(AgentRolloutWorkflow)
