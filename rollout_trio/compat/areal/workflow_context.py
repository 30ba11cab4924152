"""``areal.infra.workflow_context`` (also ``areal.workflow_context``): ours, under AReaL's names."""

from __future__ import annotations

from typing import Any

from ...workflow_context import WorkflowContext, get, set, stat_scope
from ...workflow_context import http_client as get_httpx_client
from ._errors import ArealCompatError

__all__ = ["WorkflowContext", "get", "get_aiohttp_session", "get_httpx_client", "set", "stat_scope"]


async def get_aiohttp_session() -> Any:
    """Not served: rollout_trio runs on Trio, where aiohttp does not run.

    Raises:
        ArealCompatError: always; use ``get_httpx_client()`` (an ``httpx.AsyncClient``).
    """
    raise ArealCompatError(
        "areal.infra.workflow_context.get_aiohttp_session: aiohttp needs asyncio and rollout_trio runs on Trio; "
        "use get_httpx_client() (the run's shared httpx.AsyncClient, opened by workflow_context.open_http_client())"
    )
