"""An ``httpx2`` transport over an ``httpx`` one: the Anthropic SDK's way into the endpoint.

Imported only where an agent is handed an ``httpx2`` client (``_clients``), so that
``httpx2`` (installed with the Anthropic SDK) is not needed otherwise.
"""

from __future__ import annotations

import httpx
import httpx2

__all__ = ["Httpx2Bridge"]


class Httpx2Bridge(httpx2.AsyncBaseTransport):
    """Sends each ``httpx2`` request through an ``httpx`` transport and answers in ``httpx2``.

    The Anthropic SDK appends ``/v1/messages`` to its base URL: handed the in-process base
    URL of OpenAI clients (which ends in ``/v1``), it asks for ``/v1/v1/messages``, which
    is the endpoint's ``/v1/messages``.

    Args:
        inner: the ``httpx`` transport on the caller's loop (cancelling a request there
            cancels it in the endpoint).
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        path = request.url.path
        url = str(request.url.copy_with(path=path[3:])) if path.startswith("/v1/v1/") else str(request.url)
        answer = await self._inner.handle_async_request(
            httpx.Request(request.method, url, headers=request.headers.raw, content=body)
        )
        try:
            content = await answer.aread()  # decoded: the length and encoding headers no longer apply
        finally:
            await answer.aclose()
        headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in (b"content-encoding", b"content-length")]
        return httpx2.Response(answer.status_code, headers=headers, content=content, request=request)
