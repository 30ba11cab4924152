"""Serving an ASGI app on Hypercorn's Trio worker, through Hypercorn's public API only.

Hypercorn does the HTTP (h11 / h2 framing, head size, keep-alive, graceful close). This
module owns the listening sockets (so it can report the bound port and close them) and
one guard: when the process runs out of file descriptors, Hypercorn's ``accept`` fails
and it retries forever, so a new client would hang without an answer. The guard keeps a
reserve of descriptors; while none is free it takes pending connections with the reserve,
answers 503 and closes them. How many connections fit is therefore derived from the
open-file limit (``RLIMIT_NOFILE``); ``ServerLimits.max_connections`` raises the soft
limit when more are wanted.

Access lines are ours, not Hypercorn's: one INFO line per request on
``rollout_trio.server.access`` (method, path, status, duration, client). Hypercorn's own
access log is off: its Trio worker writes a request twice when the client closes while
the answer's end is being sent (hypercorn issue 357), once with ``- -`` for the status.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .._errors import exception_leaves
from ._limits import ServerLimits, ensure_capacity

__all__ = ["hypercorn_config", "serve_app"]

log = logging.getLogger("rollout_trio.server")
access_log = logging.getLogger("rollout_trio.server.access")

_BUSY_BODY = b'{"error":{"message":"too many open connections: the open-file limit (RLIMIT_NOFILE) is reached","code":503}}'
# A fixed answer sent before any request was read (no parser is involved).
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)
_CAP_BODY = b'{"error":{"message":"too many open connections: the server\'s connection_cap is reached","code":503}}'
_AT_CAP = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_CAP_BODY), _CAP_BODY)
)
_RESERVE = 2  # descriptors the guard keeps: one for the refused connection, one to probe
_GUARD_POLL = 0.05  # seconds the guard lets Hypercorn take a pending connection first


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a small process
        return 64


def hypercorn_config(limits: ServerLimits, sockets: list[socket.socket], *, graceful_timeout: float) -> Any:
    """Hypercorn's settings for ``limits``, serving ``sockets`` (logging through ``rollout_trio.server``)."""
    from hypercorn.config import Config, Sockets

    class _OwnSockets(Config):
        def create_sockets(self) -> Sockets:  # the sockets we bound (and will close)
            return Sockets(secure_sockets=[], insecure_sockets=list(sockets), quic_sockets=[])

    config = _OwnSockets()
    config.keep_alive_timeout = limits.keep_alive_timeout
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.h2_max_header_list_size = limits.max_header_bytes
    config.read_timeout = None if limits.read_timeout is None else max(1, math.ceil(limits.read_timeout))
    config.graceful_timeout = graceful_timeout
    config.backlog = limits.backlog
    config.errorlog = log
    config.accesslog = None  # access lines come from _logged_requests (see the module doc)
    config.include_server_header = False
    config.rollout_trio_send_timeout = limits.send_timeout  # type: ignore[attr-defined]  # read by _serialize_sends
    config.rollout_trio_cap = None if limits.connection_cap is None else _Cap(limits.connection_cap)  # type: ignore[attr-defined]
    return config


class _Cap:
    """Connections open on one server, against its ``ServerLimits.connection_cap``."""

    __slots__ = ("limit", "open")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0


def release_cap(server: Any) -> None:
    """Give back a Hypercorn ``TCPServer``'s slot under its cap, once (when its stream
    closes: its task may linger until the keep-alive timer ends, holding no descriptor)."""
    if getattr(server, "_rollout_trio_counted", False):
        server._rollout_trio_counted = False
        server.config.rollout_trio_cap.open -= 1


async def _refuse_at_cap(stream: Any) -> None:
    """Answer 503 on a connection over the cap and close it (within a second)."""
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(_AT_CAP)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass
    with trio.CancelScope(shield=True):
        await stream.aclose()


def _logged_requests(app: Any) -> Any:
    """``app`` writing one access line per HTTP request once it is over; a websocket
    upgrade is refused with 403 before it reaches ``app`` (Hypercorn would answer the
    app's error with a 500).

    The status is the one the app sent; 500 if the app raised (Hypercorn then answers
    500), 499 if it sent none (the client left first).
    """

    async def logged(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":  # no app of ours speaks it: refused before the handshake (403)
            await send({"type": "websocket.close", "code": 1008})
            access_log.info("%s %s 403 (websocket upgrade refused)", "GET", ascii(scope.get("path", "")))
            return
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.INFO):
            await app(scope, receive, send)
            return
        status: int | None = None
        start = time.perf_counter()

        async def send_seen(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        unanswered = 499  # the client left first
        try:
            await app(scope, receive, send_seen)
        except Exception:
            unanswered = 500  # Hypercorn answers an app's exception with a 500
            raise
        finally:
            path = scope["path"]
            client = scope.get("client")
            access_log.info(
                "%s %s %s %.1f ms%s",
                scope["method"],
                path if path.isprintable() else ascii(path),  # a decoded %0A cannot start a line
                status if status is not None else unanswered,
                (time.perf_counter() - start) * 1000,
                f" ({client[0]}:{client[1]})" if client else "",
            )

    return logged


def _bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    out: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, kind, proto)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
            if port == 0:  # every address family on the same port
                port = sock.getsockname()[1]
            break  # one address per host is enough for loopback and explicit addresses
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


def _descriptor_free(probe: int) -> bool:
    try:
        os.close(os.dup(probe))
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return False
        raise
    return True


async def _refuse_when_out_of_descriptors(listening: socket.socket) -> None:
    """Answer 503 to pending connections while no descriptor is free (see the module doc)."""
    sock = listening.dup()  # its own descriptor: Hypercorn waits on the original
    reserve = [os.open(os.devnull, os.O_RDONLY) for _ in range(_RESERVE)]
    try:
        while True:
            await trio.lowlevel.wait_readable(sock)
            if _descriptor_free(reserve[0]):
                await trio.sleep(_GUARD_POLL)  # Hypercorn accepts it
                continue
            os.close(reserve.pop())
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                reserve.append(os.open(os.devnull, os.O_RDONLY))
                continue  # Hypercorn took it after all
            with conn:
                log.warning("refused a connection: no file descriptor is free (RLIMIT_NOFILE)")
                try:
                    conn.setblocking(False)
                    conn.send(_BUSY)
                except OSError:
                    pass
            reserve.append(os.open(os.devnull, os.O_RDONLY))
    finally:
        for fd in reserve:
            os.close(fd)
        sock.close()


def _cut_connections(ports: set[int]) -> None:
    """Shut down (not close) every accepted connection on ``ports`` (Linux; else nothing).

    Hypercorn sends with a shielded ``send_all``: a client that never reads its answer
    would hold shutdown forever. Once the graceful timeout is over, shutting the socket
    down makes that send fail, and Hypercorn closes the connection itself.
    """
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue  # not a socket
        try:
            if sock.type == socket.SOCK_STREAM and sock.getsockname()[1] in ports:
                sock.getpeername()  # an accepted connection, not a listener
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            sock.detach()  # the descriptor stays Hypercorn's


def _contain_connection_failures() -> None:
    """Make an error inside one of Hypercorn's connections close that connection, not the server.

    Under Trio, Hypercorn runs each connection (``TCPServer.run``) in the server's nursery,
    so an exception its protocol code does not expect stops every connection and the
    server. Two are known in Hypercorn 0.17-0.18, each reachable by one client:
    - ``trio.BusyResourceError``: a send racing its own ``send_eof`` when an h2 connection
      closes while a stream still sends (sglang-router speaks HTTP/2 to its workers), or
      a cut chunked body over HTTP/1.1;
    - ``KeyError``: an h2 DATA frame for a stream already answered and closed (its issue
      329, PR 334; "rollout-trio serve: error: KeyError: 1").
    No public setting avoids them, so the one method is wrapped: such an error is logged
    and the connection ends there (``run`` closes its stream on the way out).
    Cancellation and KeyboardInterrupt pass through untouched.
    """
    from hypercorn.trio.tcp_server import TCPServer

    if getattr(TCPServer, "_rollout_trio_contained", False):
        return
    original = TCPServer.run

    async def run(self: Any) -> None:
        cap: _Cap | None = getattr(self.config, "rollout_trio_cap", None)
        if cap is not None:
            if cap.open >= cap.limit:
                log.warning("refused a connection: %d open, the connection_cap", cap.open)
                await _refuse_at_cap(self.stream)
                return
            cap.open += 1
            self._rollout_trio_counted = True
        try:
            await original(self)
        except Exception as exc:  # an ExceptionGroup from the connection's task group too
            why = "; ".join(f"{type(e).__name__}: {e}" for e in exception_leaves(exc))
            log.warning("closed a connection after an error inside Hypercorn: %s", why)
        finally:
            release_cap(self)

    TCPServer.run = run  # type: ignore[method-assign]
    TCPServer._rollout_trio_contained = True  # type: ignore[attr-defined]


def _serialize_sends() -> None:
    """Make Hypercorn's Trio ``TCPServer`` write each connection from one task at a time,
    and give up on a client that does not read within a send deadline.

    Hypercorn 0.17-0.18 (``hypercorn/trio/tcp_server.py``) sends data under
    ``self.send_lock`` but closes without it: ``_close`` calls ``stream.send_eof()``, and
    Trio's ``SocketStream.send_eof`` holds the stream's send-conflict detector across a
    checkpoint. A response (another task) that starts to send in that window raises
    ``BusyResourceError: another task is currently sending data on this SocketStream``,
    which ended the connection before its answer was out (seen under fleet load: an h2
    ``GOAWAY`` or a client's half-close handled while streams still answer). Patched here:

    - ``_close`` takes ``send_lock`` (unless the task closing is the one holding it)
      before ``send_eof``, so the EOF follows the data already being sent; when the lock
      does not come within the send deadline, the stream is closed without the EOF (the
      blocked send then fails with ``ClosedResourceError``, which Hypercorn handles).
    - ``protocol_send`` bounds each (shielded) ``send_all`` by the deadline
      (``ServerLimits.send_timeout``): a client that stops reading is cut and its buffers
      freed, instead of holding a task and the answer forever.
    - ``_read_data``: when a client closes an idle keep-alive connection, the connection
      ends at once; Hypercorn kept it (and its descriptor) until the keep-alive timer ran
      out, so clients that connect and leave could hold every descriptor.
    """
    from hypercorn.events import Closed, RawData
    from hypercorn.trio.tcp_server import TCPServer

    if getattr(TCPServer, "_rollout_trio_serialized", False):
        return

    def deadline(self: Any) -> float:
        timeout = getattr(self.config, "rollout_trio_send_timeout", None)
        return math.inf if timeout is None else float(timeout)

    async def _close(self: Any) -> None:
        lock = self.send_lock
        owner = lock.statistics().owner
        with trio.CancelScope(shield=True):
            try:
                if owner is trio.lowlevel.current_task():
                    await self.stream.send_eof()
                else:
                    with trio.move_on_after(deadline(self)):
                        async with lock:
                            await self.stream.send_eof()
            except (trio.BrokenResourceError, AttributeError, trio.BusyResourceError, trio.ClosedResourceError):
                pass  # already gone, or an SSL stream (no EOF)
            await self.stream.aclose()
        release_cap(self)

    async def protocol_send(self: Any, event: Any) -> None:
        if not isinstance(event, RawData):
            await original_send(self, event)
            return
        cut = False
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(deadline(self)) as scope:
                        await self.stream.send_all(event.data)
                    cut = scope.cancelled_caught
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                cut = True
        if cut:
            if not getattr(self, "_rollout_trio_cut", False):
                self._rollout_trio_cut = True
                log.info("closed a connection whose client did not read its answer within the send deadline")
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
            await self.protocol.handle(Closed())

    async def _read_data(self: Any) -> None:
        await original_read(self)
        if self.idle_task._handle is not None:  # idle (no request in flight) and the client left:
            await self.idle_task.stop()  # end now, not when the keep-alive timer runs out

    original_send = TCPServer.protocol_send
    original_read = TCPServer._read_data
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
    TCPServer._close = _close  # type: ignore[method-assign]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    TCPServer._rollout_trio_serialized = True  # type: ignore[attr-defined]


async def serve_app(
    app: Any,
    host: str,
    port: int,
    limits: ServerLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    graceful_timeout: float = 10.0,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``host:port`` (0: a free port) until ``shutdown_trigger`` returns.

    ``task_status.started`` reports the bound ``(host, port)`` pairs. On shutdown, new
    connections stop, idle ones close, and requests still running get
    ``graceful_timeout`` seconds to finish before they are cancelled.
    Cancelling the caller's scope stops everything at once.

    Raises:
        ValueError: ``limits.max_connections`` cannot fit under the hard open-file limit.
        OSError: the address cannot be bound.
    """
    from hypercorn.trio import serve  # only servers need Hypercorn: import on use

    _contain_connection_failures()
    _serialize_sends()

    ensure_capacity(limits, _open_files())
    sockets = _bind(host, port, limits.backlog)
    try:
        config = hypercorn_config(limits, sockets, graceful_timeout=graceful_timeout)
        bound: list[tuple[str, int]] = [tuple(s.getsockname()[:2]) for s in sockets]

        class _Started:
            def started(self, _binds: object = None) -> None:
                task_status.started(bound)

        async with trio.open_nursery() as nursery:
            for sock in sockets:
                nursery.start_soon(_refuse_when_out_of_descriptors, sock)
            trigger = None
            ports = {port for _host, port in bound}
            if shutdown_trigger is not None:
                until = shutdown_trigger

                async def trigger() -> None:
                    await until()
                    nursery.start_soon(_cut_after, graceful_timeout + 1.0)

            async def _cut_after(delay: float) -> None:
                await trio.sleep(delay)
                _cut_connections(ports)

            await serve(_logged_requests(app), config, shutdown_trigger=trigger, task_status=_Started(), mode="asgi")
            nursery.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
