"""Requests to an :class:`HTTPApp` in the caller's own task: no socket, no ASGI messages.

An in-process agent's completions cost what its HTTP client and the app's handler cost;
the transport between them should cost nothing. ``httpx.ASGITransport`` turns each
request into ASGI messages and back; :class:`InProcessTransport` hands the request's
head and body to :meth:`HTTPApp.respond_in_memory` and the answer back as an
``httpx.Response``, under the same limits, routes and error bodies. ``httpx.AsyncClient``
itself runs an auth flow, a redirect loop and a cookie jar per request, which an
in-process endpoint (no redirects, no cookies, keys in the ``Authorization`` header) never
uses: :class:`InProcessClient` skips them while nothing asks for them, and is an
``httpx.AsyncClient`` in every other respect (the SDKs take it as their ``http_client``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import httpx
from httpx._client import BoundAsyncStream, ClientState, UseClientDefault

from ._app import HTTPApp, response_headers

__all__ = ["InProcessClient", "InProcessTransport"]

_httpx_log = logging.getLogger("httpx")


class InProcessTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport answering every request with ``app``, in the calling task.

    A cancelled caller cancels the handler (and any generation it awaits) directly, as
    with ``httpx.ASGITransport``. A streamed request body is read up to one chunk past
    the app's ``max_body_bytes`` at most, then refused (413), unread beyond.

    Args:
        app: the app to answer with.
    """

    def __init__(self, app: HTTPApp) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The app's answer to ``request`` (the SDKs call this through the client)."""
        status, headers, body = await self.answer(request)
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body), request=request)

    async def answer(self, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The app's answer to ``request``: status, headers and the whole body."""
        body = await self._body(request)
        url = request.url
        scope = {
            "type": "http",
            "method": request.method,
            "path": url.path,
            "raw_path": url.raw_path.split(b"?")[0],  # as httpx.ASGITransport has it
            "query_string": url.query,
            "headers": request.headers.raw,  # Request lower-cases the names it looks up
        }
        answer = await self.app.respond_in_memory(scope, body)
        return answer.status, response_headers(answer), answer.body

    async def _body(self, request: httpx.Request) -> bytes:
        try:
            return request.content  # a JSON or bytes body: already in memory
        except httpx.RequestNotRead:
            pass
        # A streamed body: read until one byte past the limit at most, and left to the
        # app's Request to refuse (413) after the checks that come first (431, 404, ...).
        limit = self.app.limits.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        parts = aiter(request.stream)  # type: ignore[arg-type]
        try:
            async for chunk in parts:
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    break
        finally:
            close = getattr(parts, "aclose", None)  # an async generator left unexhausted
            if close is not None:
                await close()
        return b"".join(chunks)


class InProcessClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` whose requests go to ``app`` in the calling task.

    ``send`` takes a short path while the client has no auth, no event hooks and no
    redirects to follow (as it is built): the request goes straight to the transport and
    the answer's cookies, if it sets any, into the jar. Otherwise it is
    ``httpx.AsyncClient.send`` unchanged. URLs merged with ``base_url`` are kept (they are
    immutable), so a client making the same calls parses each URL once.

    Args:
        app: the app answering every request.
        base_url: the client's base URL.
        **kwargs: any other ``httpx.AsyncClient`` argument but ``transport``.
    """

    def __init__(self, app: HTTPApp, *, base_url: str = "http://in-process", **kwargs: Any) -> None:
        kwargs.setdefault("timeout", None)
        super().__init__(transport=InProcessTransport(app), base_url=base_url, **kwargs)
        self._in_process = cast(InProcessTransport, self._transport)
        self._urls: dict[str, httpx.URL] = {}
        self._urls_base: httpx.URL = self._base_url

    def _merge_url(self, url: httpx.URL | str) -> httpx.URL:
        if type(url) is not str:
            return super()._merge_url(url)
        if self._urls_base is not self._base_url:  # base_url was reassigned
            self._urls.clear()
            self._urls_base = self._base_url
        merged = self._urls.get(url)
        if merged is None:
            merged = super()._merge_url(url)
            if len(self._urls) < 1024:
                self._urls[url] = merged
        return merged

    async def send(
        self,
        request: httpx.Request,
        *,
        stream: bool = False,
        auth: Any = httpx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = httpx.USE_CLIENT_DEFAULT,
    ) -> httpx.Response:
        """Send ``request`` (see ``httpx.AsyncClient.send``; the short path is in the class docstring)."""
        follow = self.follow_redirects if isinstance(follow_redirects, UseClientDefault) else follow_redirects
        hooks = self._event_hooks
        plain = (
            not follow
            and self._auth is None
            and (auth is None or isinstance(auth, UseClientDefault))
            and not hooks["request"]
            and not hooks["response"]
            and not self._mounts
            and self._transport is self._in_process
            and not self.is_closed
        )
        if not plain:
            return await super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        self._state = ClientState.OPENED
        start = time.perf_counter()
        status, headers, body = await self._in_process.answer(request)
        content = httpx.ByteStream(body)
        response = httpx.Response(status, headers=headers, stream=content, request=request, default_encoding=self._default_encoding)
        response.stream = BoundAsyncStream(content, response=response, start=start)
        if "set-cookie" in response.headers:
            self.cookies.extract_cookies(response)
        if _httpx_log.isEnabledFor(logging.INFO):
            _httpx_log.info('HTTP Request: %s %s "%s %d %s"', request.method, request.url, response.http_version,
                            response.status_code, response.reason_phrase)  # fmt: skip
        if not stream:
            if "content-encoding" in response.headers:
                await response.aread()
            else:  # the body is in hand: what aread would join from one chunk
                response._content = body
                response.is_stream_consumed = True
                await response.aclose()  # closed, with its elapsed time, as aread leaves it
        return response
