"""The ``http_client`` an in-process agent is handed: ``httpx`` or ``httpx2``.

The OpenAI SDK, openai-agents and LangChain take ``httpx`` clients; the Anthropic SDK
from 2.16 takes only ``httpx2`` ones (it rejects an ``httpx`` client by type). One agent
gets one ``http_client``, so it is chosen per agent, by this rule: ``httpx2`` when the
agent's code (the modules of its class and its bases, and the globals of their ``run``
methods) uses the Anthropic SDK (an ``httpx2`` one) and none of the ``httpx`` SDKs;
``httpx`` otherwise. ``AgentRolloutWorkflow(http_library=...)``
overrides it. Both clients reach the same in-process endpoint with no socket.
"""

from __future__ import annotations

import sys
from types import FunctionType, ModuleType
from typing import Any, Literal

import httpx

from .._http import InProcessClient, InProcessTransport

__all__ = ["HTTP_LIBRARIES", "HttpLibrary", "http_library_of", "open_agent_client"]

HttpLibrary = Literal["auto", "httpx", "httpx2"]
HTTP_LIBRARIES: tuple[str, ...] = ("auto", "httpx", "httpx2")

#: Top-level packages whose clients are ``httpx`` ones: an agent module using any of them
#: keeps ``httpx`` even if it also imports ``anthropic``.
_HTTPX_SDKS = frozenset({"openai", "agents", "langchain_openai", "langchain", "langchain_core", "httpx"})


def _namespaces(agent: Any) -> list[dict[str, Any]]:
    """The global namespaces of the agent's code: the modules of its classes and the
    globals its ``run`` methods see (a script's ``__main__`` too, however it was run)."""
    spaces: list[dict[str, Any]] = []
    for cls in type(agent).__mro__[:-1]:  # object's module says nothing
        run = cls.__dict__.get("run")
        if isinstance(run, FunctionType):
            spaces.append(run.__globals__)
        module = sys.modules.get(cls.__module__)
        if module is not None:
            spaces.append(vars(module))
    return spaces


def _packages_used(agent: Any) -> set[str]:
    """The top-level packages of the modules, classes and functions the agent's code names globally."""
    used: set[str] = set()
    for space in _namespaces(agent):
        for value in space.values():
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
            if isinstance(name, str) and name:
                used.add(name.partition(".")[0])
    return used


def _anthropic_takes_httpx2() -> bool:
    base = sys.modules.get("anthropic._base_client")
    return base is not None and isinstance(getattr(base, "httpx2", None), ModuleType)


def http_library_of(agent: Any, choice: HttpLibrary = "auto") -> Literal["httpx", "httpx2"]:
    """The client library ``agent`` is handed (the rule in this module's docstring).

    Args:
        agent: the agent object (its class's module is looked at).
        choice: ``"auto"`` for the rule, or the library itself.

    Returns:
        ``"httpx"`` or ``"httpx2"``.

    Raises:
        ValueError: ``choice`` is not one of :data:`HTTP_LIBRARIES`.
    """
    if choice not in HTTP_LIBRARIES:
        raise ValueError(f"http_library: must be one of {HTTP_LIBRARIES}, got {choice!r}")
    if choice != "auto":
        return choice
    used = _packages_used(agent)
    if "anthropic" in used and not used & _HTTPX_SDKS and _anthropic_takes_httpx2():
        return "httpx2"
    return "httpx"


def open_agent_client(library: Literal["httpx", "httpx2"], transport: httpx.AsyncBaseTransport, base_url: str) -> Any:
    """An async client of ``library`` whose requests go to ``transport`` (an ``httpx`` one).

    Args:
        library: ``"httpx"`` or ``"httpx2"``.
        transport: the endpoint's transport on the caller's loop.
        base_url: the client's base URL.

    Returns:
        An ``httpx.AsyncClient`` or ``httpx2.AsyncClient`` (an async context manager).
    """
    if library == "httpx":
        if isinstance(transport, InProcessTransport):  # the endpoint's own: the client's short path too
            return InProcessClient(transport.app, base_url=base_url)
        return httpx.AsyncClient(transport=transport, base_url=base_url, timeout=None)
    import httpx2  # only with the Anthropic SDK, which requires it

    from ._httpx2_bridge import Httpx2Bridge

    return httpx2.AsyncClient(transport=Httpx2Bridge(transport), base_url=base_url, timeout=None)
