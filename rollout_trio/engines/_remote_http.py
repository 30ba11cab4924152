"""One HTTP attempt, the retry policy, and the single place where errors are mapped.

Errors from httpx and from the server's status codes become the
:class:`~rollout_trio.EngineError` tree here and nowhere else::

    httpx.TimeoutException, our per-attempt deadline  ->  EngineTimeoutError
    the transport's ResponseTooLarge                 ->  EngineProtocolError (names the limit)
    httpx.DecodingError (a bad Content-Encoding)      ->  EngineProtocolError
    the transport's LocalResourceError (EMFILE)      ->  EngineLocalError
    httpx.ConnectError, any other transport error     ->  EngineConnectError
    HTTP status >= 400                                ->  EngineServerError(status_code)
    a 2xx body that is not the expected JSON          ->  EngineProtocolError

Retried (with exponential backoff and full jitter, bounded by the caller's deadline):
connect errors, local resource errors, timeouts, 5xx and 429. Never retried: other 4xx
and protocol errors.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import httpx
import orjson
import trio

from .._errors import (
    EngineConnectError,
    EngineError,
    EngineLocalError,
    EngineProtocolError,
    EngineServerError,
    EngineTimeoutError,
    ServerUnavailableError,
)
from ._remote_wire import HttpCall
from .._bounded import loads_json
from ._transport import LocalResourceError, ResponseTooLarge, TrioTransport, frame_head

__all__ = ["HttpSession", "RetryPolicy", "decode_json", "encode_json", "is_retriable", "map_transport_error", "retrying"]

T = TypeVar("T")

_PLAIN_RAW = [(b"user-agent", b"rollout-trio"), (b"accept", b"application/json")]
_JSON_TYPE = (b"content-type", b"application/json")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# The standard library's encoder, built once: what encode_json falls back to where orjson
# would say something else.
_encode_json = json.JSONEncoder(separators=(",", ":")).encode
# Subclasses of str/int/dict/list, dataclasses and datetimes: left to the standard library.
_ORJSON_PLAIN = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


def encode_json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON: what ``json.dumps(value, separators=(",", ":"))``
    says, about ten times cheaper.

    orjson writes it. Where orjson would refuse, or say something else, the standard
    library writes it: an int beyond 64 bits, a lone surrogate, a NaN or infinity (orjson
    writes ``null`` for those, so any ``null`` in its output sends the value that way), a
    subclass of a JSON type. Non-ASCII text goes out as UTF-8 rather than ``\\u`` escapes:
    the same JSON value.
    """
    try:
        data = orjson.dumps(value, option=_ORJSON_PLAIN)
    except TypeError:  # orjson.JSONEncodeError
        return _encode_json(value).encode()
    if b"null" in data:
        return _encode_json(value).encode()
    return data


def decode_json(content: bytes) -> Any:
    """The JSON value of a UTF-8 body, as ``json.loads`` reads it, about three times cheaper.

    orjson reads it. A body orjson refuses is read by the standard library (which also
    accepts ``NaN``, ``Infinity``, ``1e400`` and lone surrogates, for the validators to
    reject by field name) or raises its ``ValueError``. One difference: orjson reads an
    integer beyond 64 bits as a float, which every field that wants an int rejects.

    Nesting deeper than :data:`rollout_trio._bounded.MAX_JSON_DEPTH` is refused (never a
    ``RecursionError``).

    Raises:
        ValueError: not UTF-8 JSON, or nested too deep.
    """
    return loads_json(content)


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How often and how patiently to retry.

    ``attempts`` counts every try (so 1 means no retry). The wait before try ``k + 1`` is
    drawn uniformly from ``[0, min(backoff_max, backoff_base * 2**k)]`` (full jitter).
    """

    attempts: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    backoff_base: float = attrs.field(default=0.1, validator=attrs.validators.ge(0))
    backoff_max: float = attrs.field(default=5.0, validator=attrs.validators.ge(0))

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The wait after failed try number ``attempt`` (0-based)."""
        cap = min(self.backoff_max, self.backoff_base * (2**attempt))
        return rng.uniform(0.0, cap)


def is_retriable(exc: BaseException) -> bool:
    """Whether a failed attempt may be tried again: connect and local errors, timeouts, 5xx,
    429, and a server taken out of service (the request goes to another)."""
    if isinstance(exc, (EngineConnectError, EngineLocalError, EngineTimeoutError, ServerUnavailableError)):
        return True
    if isinstance(exc, EngineServerError):
        return exc.status_code >= 500 or exc.status_code == 429
    return False


def map_transport_error(exc: httpx.HTTPError, where: str) -> EngineError:
    """The :class:`EngineError` for an httpx exception (chained by the caller)."""
    if isinstance(exc, (ResponseTooLarge, httpx.DecodingError)):  # retrying would read the same answer
        return EngineProtocolError(f"{where}: {exc}")
    if isinstance(exc, LocalResourceError):  # this machine's shortage: never the server's fault
        return EngineLocalError(f"{where}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeoutError(f"{where}: timed out ({type(exc).__name__}: {exc})")
    return EngineConnectError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}")


def _status_error(response: httpx.Response, where: str) -> EngineServerError:
    body: Any
    try:
        body = loads_json(response.content)
    except ValueError:
        body = response.content[:500].decode("utf-8", "replace")
    message = body
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            message = err.get("message", err)
        elif err is not None:
            message = err
        elif "message" in body:
            message = body["message"]
    return EngineServerError(
        f"{where}: HTTP {response.status_code}: {message}", status_code=response.status_code, body=body
    )


class HttpSession:
    """Sends :class:`HttpCall` s, one attempt each, and maps what goes wrong.

    Occasional calls (start-up, version reads, health) go through ``client`` (one
    ``httpx.AsyncClient`` for the engine's lifetime). Calls sent with ``direct=True``
    (generation segments, and the pause/resume/update fan-outs and aborts, which go to
    every server at once) go as
    ``httpx.Request`` objects straight to ``transport.handle_async_request``: the
    client's cookie, auth, redirect and event-hook machinery does nothing for these JSON
    APIs and costs about as much as the rest of a loopback round trip. Both paths share
    the request construction, the timeout handling and the error mapping below.
    """

    def __init__(
        self, client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport, *, api_key: str | None = None
    ) -> None:
        self.client = client
        self.transport = transport
        self._auth = [(b"authorization", b"Bearer " + api_key.encode())] if api_key else []
        # What client.send would attach (the client's timeouts, all None for the engine's
        # client): the transport reads connect/read/pool limits from this extension.
        self._extensions = {"timeout": client.timeout.as_dict()}
        self._targets: dict[tuple[str, str], tuple[httpx.URL, list[tuple[bytes, bytes]]]] = {}
        # The direct path to a TrioTransport frames requests itself: per (base_url, method,
        # path), the server and the checked head up to the body's own headers.
        self._raw = transport if type(transport) is TrioTransport else None
        self._heads: dict[tuple[str, str, str], tuple[tuple[str, int], bytes]] = {}

    def _request(self, base_url: str, call: HttpCall) -> httpx.Request:
        """``call`` as a fully built request (body read, every header explicit).

        Built directly, not with ``client.build_request``: the URL and the fixed headers
        are parsed once per endpoint, the body is encoded once, and ``stream=`` skips
        httpx's content sniffing (the headers ``Request(content=...)`` would add, ``Host``
        and ``Content-Length``, are set here).
        """
        target = self._targets.get((base_url, call.path))
        if target is None:
            url = httpx.URL(base_url + call.path)
            fixed = [(b"host", url.netloc), *_PLAIN_RAW, *self._auth]
            target = self._targets[(base_url, call.path)] = (url, fixed)
        url, fixed = target
        if call.params is not None:
            url = url.copy_with(params=call.params)
        if call.json is None:
            content = b""
            headers = fixed
        else:
            content = encode_json(call.json)
            headers = [*fixed, _JSON_TYPE]
        if content or call.method in _BODY_METHODS:
            headers = [*headers, (b"content-length", b"%d" % len(content))]
        request = httpx.Request(
            call.method, url, headers=headers, stream=httpx.ByteStream(content), extensions=self._extensions
        )
        request.read()  # a ByteStream: sets request.content, no I/O
        return request

    async def call(
        self, base_url: str, call: HttpCall, *, timeout: float, expect_json: bool = True, direct: bool = False
    ) -> Any:
        """Send ``call`` to ``base_url`` once, within ``timeout`` seconds.

        ``direct`` sends through the transport, bypassing the client (see the class
        docstring); the caller's cancel scope bounds either path, and so does
        ``timeout``.

        Returns:
            The decoded JSON body (``None`` when ``expect_json`` is false).

        Raises:
            EngineTimeoutError, EngineConnectError, EngineServerError, EngineProtocolError:
                see the module docstring. The httpx exception is the ``__cause__``.
        """
        response: httpx.Response | tuple[int, bytes] | None = None
        with trio.move_on_after(timeout) as scope:
            try:
                if direct and self._raw is not None and call.params is None:
                    response = await self._exchange(self._raw, base_url, call)
                else:
                    request = self._request(base_url, call)
                    if not direct:
                        response = await self.client.send(request)
                    else:  # what client.send does that matters here: send, and read the body whole
                        response = await self.transport.handle_async_request(request)
                        try:
                            response.content  # noqa: B018 - read already (TrioTransport, MockTransport)?
                        except httpx.ResponseNotRead:
                            try:
                                await response.aread()  # a streaming transport: read it (that closes it)
                            except BaseException:
                                await response.aclose()
                                raise
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, _where(base_url, call)) from exc
        if response is None or scope.cancelled_caught:
            raise EngineTimeoutError(f"{_where(base_url, call)}: no complete answer within {timeout:.3g} s")
        if type(response) is tuple:
            status, content = response
        else:
            assert isinstance(response, httpx.Response)
            status, content = response.status_code, response.content
            if status >= 400:
                raise _status_error(response, _where(base_url, call))
        if not expect_json:
            return None
        try:
            return decode_json(content)
        except ValueError as exc:
            raise EngineProtocolError(
                f"{_where(base_url, call)}: HTTP {status} body is not JSON: {content[:200]!r}"
            ) from exc

    async def _exchange(
        self, transport: TrioTransport, base_url: str, call: HttpCall
    ) -> httpx.Response | tuple[int, bytes]:
        """``call`` framed here and sent through ``transport.exchange``: no httpx objects on the hot path.

        The same bytes ``_request`` + the transport would send. A plain 2xx-3xx answer
        comes back as ``(status, body)``; an error status or an encoded body as a read
        ``httpx.Response`` (decoded as on the other path).
        """
        key = (base_url, call.method, call.path)
        target = self._heads.get(key)
        if target is None:
            url, fixed = self._request(base_url, HttpCall(call.method, call.path)).url, self._fixed(base_url, call.path)
            head = b"\r\n".join(frame_head(call.method, url.raw_path, fixed)) + b"\r\n"
            target = self._heads[key] = ((url.host, url.port or 80), head)
        origin, head = target
        if call.json is None:
            tail = b"content-length: 0\r\n\r\n" if call.method in _BODY_METHODS else b"\r\n"
            data = head + tail
        else:
            content = encode_json(call.json)
            data = b"%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (head, len(content), content)
        answer = await transport.exchange(origin, data, self._extensions["timeout"])
        content = await answer.adecoded(None)  # bounded after decompression, off the loop when large
        if answer.status < 400:
            return answer.status, content
        response = httpx.Response(answer.status, headers=answer.plain_headers(), stream=httpx.ByteStream(content))
        response.read()  # a ByteStream without Content-Encoding: no I/O
        return response

    def _fixed(self, base_url: str, path: str) -> list[tuple[bytes, bytes]]:
        return self._targets[(base_url, path)][1]


def _where(base_url: str, call: HttpCall) -> str:
    return f"{call.method} {base_url}{call.path}"


async def retrying(
    attempt_fn: Callable[[int], Awaitable[T]],
    *,
    policy: RetryPolicy,
    rng: random.Random,
    on_retry: Callable[[int, EngineError], None] | None = None,
) -> T:
    """Run ``attempt_fn(k)`` for ``k = 0, 1, ...`` until it succeeds or must not be retried.

    A retry is skipped (and the last error raised, with a note) when the enclosing cancel
    scope's deadline would pass during the backoff or, by the time the failed attempt
    took (twice over), during the retry itself.
    """
    for attempt in range(policy.attempts):
        started = trio.current_time()
        try:
            return await attempt_fn(attempt)
        except EngineError as exc:
            last = attempt == policy.attempts - 1
            if not is_retriable(exc) or last:
                if last and is_retriable(exc):
                    exc.add_note(f"gave up after {policy.attempts} attempts")
                raise
            delay = policy.delay(attempt, rng)
            now = trio.current_time()
            if now + delay + 2 * (now - started) >= trio.current_effective_deadline():
                exc.add_note("no retry: the caller's deadline would pass before it could finish")
                raise
            if on_retry is not None:
                on_retry(attempt, exc)
            await trio.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
