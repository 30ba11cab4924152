"""What one client may ask of a served app: the limits every server of the package enforces."""

from __future__ import annotations

import math
import resource
from typing import Any

import attrs

from .._validate import rule

__all__ = ["RESERVED_FILES", "ServerLimits", "connection_capacity"]

#: Open files kept for the server itself (model files, logs, pipes, threads' sockets) when
#: the connection cap is derived from ``RLIMIT_NOFILE``.
RESERVED_FILES = 64


def _positive(text: str) -> Any:
    return rule(text, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)


def _optional_positive(text: str) -> Any:
    check = _positive(text)

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check(instance, attribute, value)

    return validate


@attrs.frozen(kw_only=True)
class ServerLimits:
    """What one client may ask of a server (``serve`` and the agent endpoint alike).

    Attributes:
        max_body_bytes: the largest request body (HTTP 413 beyond it, at once when
            ``Content-Length`` says so). Bodies are JSON parsed while the server waits,
            so this also bounds how long one request can hold the event loop.
        read_deadline: seconds to receive a whole request body once its head arrived
            (HTTP 408 after it).
        keep_alive_timeout: seconds an idle connection stays open (and the most a
            request head may take to arrive).
        read_timeout: seconds of silence after which a connection is closed even in the
            middle of a request (None: never; a client waiting for a long generation
            sends nothing). Rounded up to whole seconds, Hypercorn's unit; never to 0.
        max_connections: open connections the server must be able to hold. None: as many
            as the open-file limit (``RLIMIT_NOFILE``) leaves after :data:`RESERVED_FILES`.
            Beyond the open-file limit a new connection is answered 503 and closed.
        max_header_bytes: the largest request head, request line included (431 beyond).
        connection_cap: the most connections open at once (None: as many as the open-file
            limit allows); a connection beyond it is answered 503 and closed at once. For
            servers beside a training run (the metrics server), so clients cannot take the
            descriptors the run needs.
        send_timeout: seconds one write of an answer may wait for the client to read
            (None: forever); a client that does not read within it is disconnected and its
            buffers freed.
        backlog: pending connections the listening socket queues.
    """

    max_body_bytes: int = attrs.field(default=4 * 1024 * 1024, validator=_positive("max_body_bytes > 0"))
    read_deadline: float = attrs.field(default=60.0, validator=_positive("read_deadline > 0"))
    keep_alive_timeout: float = attrs.field(default=75.0, validator=_positive("keep_alive_timeout > 0"))
    read_timeout: float | None = attrs.field(default=None, validator=_optional_positive("None or read_timeout > 0"))
    max_connections: int | None = attrs.field(default=None, validator=_optional_positive("None or max_connections > 0"))
    max_header_bytes: int = attrs.field(default=16 * 1024, validator=_positive("max_header_bytes > 0"))
    backlog: int = attrs.field(default=1024, validator=_positive("backlog > 0"))
    connection_cap: int | None = attrs.field(default=None, validator=_optional_positive("None or connection_cap > 0"))
    send_timeout: float | None = attrs.field(default=60.0, validator=_optional_positive("None or send_timeout > 0"))


def connection_capacity(open_files: int) -> int:
    """Connections the soft ``RLIMIT_NOFILE`` leaves room for with ``open_files`` already open."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(0, soft - open_files - RESERVED_FILES)


def ensure_capacity(limits: ServerLimits, open_files: int) -> int:
    """Raise the soft open-file limit so ``limits.max_connections`` fit; the capacity then.

    Raises:
        ValueError: the hard limit is too low for ``max_connections``.
    """
    capacity = connection_capacity(open_files)
    wanted = limits.max_connections
    if wanted is None or wanted <= capacity:
        return capacity
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_files + RESERVED_FILES + wanted
    if hard != resource.RLIM_INFINITY and need > hard:
        raise ValueError(
            f"ServerLimits.max_connections: {wanted} connections need {need} open files, but the hard "
            f"open-file limit (RLIMIT_NOFILE) is {hard}; raise it (ulimit -n) or ask for fewer"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return connection_capacity(open_files)
