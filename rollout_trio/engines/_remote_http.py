"""One HTTP attempt, the retry policy, and the single place where errors are mapped.

Errors from httpx and from the server's status codes become the
:class:`~rollout_trio.EngineError` tree here and nowhere else::

    httpx.TimeoutException, our per-attempt deadline  ->  EngineTimeoutError
    httpx.ConnectError, any other transport error     ->  EngineConnectError
    HTTP status >= 400                                ->  EngineServerError(status_code)
    a 2xx body that is not the expected JSON          ->  EngineProtocolError

Retried (with exponential backoff and full jitter, bounded by the caller's deadline):
connect errors, timeouts, 5xx and 429. Never retried: other 4xx and protocol errors.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import httpx
import trio

from .._errors import EngineConnectError, EngineError, EngineProtocolError, EngineServerError, EngineTimeoutError
from ._remote_wire import HttpCall

__all__ = ["HttpSession", "RetryPolicy", "is_retriable", "map_transport_error", "retrying"]

T = TypeVar("T")

_PLAIN = {"user-agent": "rollout-trio", "accept": "application/json"}
_JSON = {**_PLAIN, "content-type": "application/json"}


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
    """Whether a failed attempt may be tried again: connect errors, timeouts, 5xx, 429."""
    if isinstance(exc, (EngineConnectError, EngineTimeoutError)):
        return True
    if isinstance(exc, EngineServerError):
        return exc.status_code >= 500 or exc.status_code == 429
    return False


def map_transport_error(exc: httpx.HTTPError, where: str) -> EngineError:
    """The :class:`EngineError` for an httpx exception (chained by the caller)."""
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeoutError(f"{where}: timed out ({type(exc).__name__}: {exc})")
    return EngineConnectError(f"{where}: {type(exc).__name__}: {exc or 'connection failed'}")


def _status_error(response: httpx.Response, where: str) -> EngineServerError:
    body: Any
    try:
        body = response.json()
    except ValueError:
        body = response.text[:500]
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
    """Sends :class:`HttpCall` s through one ``httpx.AsyncClient`` (one attempt each)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._targets: dict[tuple[str, str], tuple[httpx.URL, httpx.Headers, httpx.Headers]] = {}

    def _request(self, base_url: str, call: HttpCall) -> httpx.Request:
        # Built directly (URL and headers parsed once per endpoint) and sent with
        # client.send: the client's build_request costs several times more than the
        # rest of a loopback round trip.
        target = self._targets.get((base_url, call.path))
        if target is None:
            url = httpx.URL(base_url + call.path)
            host = {"host": url.netloc.decode("ascii")}
            target = self._targets[(base_url, call.path)] = (
                url,
                httpx.Headers({**host, **_PLAIN}),
                httpx.Headers({**host, **_JSON}),
            )
        url, plain, with_json = target
        if call.json is None:
            return httpx.Request(call.method, url, params=call.params, headers=plain)
        content = json.dumps(call.json, separators=(",", ":")).encode()
        return httpx.Request(call.method, url, params=call.params, content=content, headers=with_json)

    async def call(self, base_url: str, call: HttpCall, *, timeout: float, expect_json: bool = True) -> Any:
        """Send ``call`` to ``base_url`` once, within ``timeout`` seconds.

        Returns:
            The decoded JSON body (``None`` when ``expect_json`` is false).

        Raises:
            EngineTimeoutError, EngineConnectError, EngineServerError, EngineProtocolError:
                see the module docstring. The httpx exception is the ``__cause__``.
        """
        where = f"{call.method} {base_url}{call.path}"
        response: httpx.Response | None = None
        with trio.move_on_after(timeout) as scope:
            try:
                response = await self.client.send(self._request(base_url, call))
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, where) from exc
        if response is None or scope.cancelled_caught:
            raise EngineTimeoutError(f"{where}: no complete answer within {timeout:.3g} s")
        if response.status_code >= 400:
            raise _status_error(response, where)
        if not expect_json:
            return None
        try:
            return json.loads(response.content)
        except ValueError as exc:
            raise EngineProtocolError(
                f"{where}: HTTP {response.status_code} body is not JSON: {response.content[:200]!r}"
            ) from exc


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
