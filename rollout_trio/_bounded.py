"""Bounded decoding of bytes from other processes: content codings, JSON, UTF-8 text.

Everything another process sends is decoded here with a bound on what decoding can
cost, whichever path it came by (the engine's generation and control calls, health
probes, a router's ``/workers``, ``rollout-trio top``'s scrape, a fleet's worker list):

* :func:`decode_content` undoes ``Content-Encoding`` (``gzip``, ``x-gzip``, ``deflate``,
  ``br`` when the ``brotli`` package is installed, ``identity``), inflating incrementally
  and stopping as soon as the decoded bytes pass the limit: a 1 MiB gzip bomb costs the
  limit, never the gigabyte it inflates to. An unknown coding is refused.
* :func:`loads_json` reads UTF-8 JSON; nesting deeper than :data:`MAX_JSON_DEPTH`, invalid
  UTF-8 and malformed JSON are all a :class:`ValueError` (never a ``RecursionError`` or a
  ``UnicodeDecodeError`` escaping as itself).
* :func:`read_response` / :func:`aread_response` read an httpx streaming response's raw
  bytes up to a limit and decode them with :func:`decode_content`: for clients that use
  httpx's own transports (the standard library decoders there inflate whole).

* :func:`read_text_file` reads a local file a user named (a config): a regular file only
  (a FIFO, a device like ``/dev/zero`` or a directory is refused at once, never read), at
  most a size, strict UTF-8.

Errors: :class:`BodyTooLarge` (the raw or the decoded body passed the limit; the message
names the limit) and :class:`BadContent` (a coding that is unknown or corrupt). Both are
``ValueError`` subclasses so callers map them to their module's typed error.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Protocol

import orjson

__all__ = [
    "MAX_JSON_DEPTH",
    "BadContent",
    "BodyTooLarge",
    "Inflater",
    "aread_response",
    "decode_content",
    "loads_json",
    "read_response",
    "read_text_file",
]

#: The deepest JSON nesting :func:`loads_json` reads: orjson's own limit.
MAX_JSON_DEPTH = 1024

_CHUNK = 256 * 1024  # input fed to a decompressor at once


class BodyTooLarge(ValueError):
    """A body, as received or once decoded, is over the limit it was read under."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class BadContent(ValueError):
    """A ``Content-Encoding`` that is unknown, or a body that is not valid in it."""


class _Decoder(Protocol):
    def feed(self, data: bytes, room: int) -> bytes: ...
    def flush(self, room: int) -> bytes: ...


class _Zlib:
    """gzip (possibly several members) or deflate (zlib-wrapped, or raw as some servers send)."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.gzip = coding in ("gzip", "x-gzip")
        self.first = True
        self.d = zlib.decompressobj(16 + zlib.MAX_WBITS if self.gzip else zlib.MAX_WBITS)
        self.pending = b""  # input not yet given to the decompressor (when output filled the room)

    def feed(self, data: bytes, room: int) -> bytes:
        if not self.gzip and self.first and data:
            self.first = False
            if not _looks_zlib(data):
                self.d = zlib.decompressobj(-zlib.MAX_WBITS)
        out: list[bytes] = []
        data = self.pending + data
        self.pending = b""
        try:
            while data and room > 0:
                if self.d.eof:  # another gzip member follows (deflate: trailing garbage)
                    if not self.gzip:
                        raise BadContent(f"content-encoding {self.coding}: data after the end of the stream")
                    self.d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                piece = self.d.decompress(data, room)
                room -= len(piece)
                out.append(piece)
                data = self.d.unconsumed_tail or self.d.unused_data
                if not piece and not self.d.eof and not self.d.unconsumed_tail:
                    break
        except zlib.error as exc:
            raise BadContent(f"content-encoding {self.coding}: corrupt body ({exc})") from None
        self.pending = data
        return b"".join(out)

    def flush(self, room: int) -> bytes:
        out = self.feed(b"", room) if self.pending else b""
        if self.pending:  # more output waits than the room left
            return out + b"\0"  # one byte more than the room: the caller's bound trips
        if not self.d.eof:
            raise BadContent(f"content-encoding {self.coding}: the body ends inside the compressed stream")
        return out


def _looks_zlib(data: bytes) -> bool:
    if len(data) < 2:
        return True
    return data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


class _Brotli:
    def __init__(self) -> None:
        import brotli  # type: ignore[import-not-found, import-untyped, unused-ignore]

        self.brotli = brotli
        self.d = brotli.Decompressor()

    def feed(self, data: bytes, room: int) -> bytes:
        out: list[bytes] = []
        try:
            piece = self.d.process(data, output_buffer_limit=room)
            out.append(piece)
            room -= len(piece)
            while room > 0 and not self.d.can_accept_more_data():  # output still waits
                piece = self.d.process(b"", output_buffer_limit=room)
                if not piece:
                    break
                out.append(piece)
                room -= len(piece)
        except self.brotli.error as exc:
            raise BadContent(f"content-encoding br: corrupt body ({exc})") from None
        return b"".join(out)

    def flush(self, room: int) -> bytes:
        if not self.d.is_finished():
            raise BadContent("content-encoding br: the body ends inside the compressed stream")
        return b""


class _Identity:
    def feed(self, data: bytes, room: int) -> bytes:
        return data

    def flush(self, room: int) -> bytes:
        return b""


def _codings(header: str) -> list[str]:
    """The codings of a ``Content-Encoding`` value, in the order they were applied."""
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    return [c for c in codings if c != "identity"]


def _decoder(coding: str) -> _Decoder:
    if coding in ("gzip", "x-gzip", "deflate"):
        return _Zlib(coding)
    if coding == "br":
        try:
            return _Brotli()
        except ImportError:
            raise BadContent("content-encoding br: not supported here (the brotli package is not installed)") from None
    raise BadContent(f"content-encoding {coding[:40]!r}: not supported (gzip, deflate, br or identity)")


class Inflater:
    """Decodes a body given in pieces, with its decoded size bounded.

    Args:
        content_encoding: the ``Content-Encoding`` header's value ('' for none); several
            codings are undone last first. At most 4 are accepted.
        limit: the most decoded bytes (and the most raw bytes) accepted.
        what: names the body in error messages (e.g. ``"GET http://h:1/health"``).

    Raises:
        BadContent: an unknown coding, more than 4, or a corrupt body (from any method).
        BodyTooLarge: from :meth:`feed` or :meth:`finish`, once the raw or the decoded
            bytes pass ``limit``.
    """

    def __init__(self, content_encoding: str, limit: int, *, what: str = "body") -> None:
        codings = _codings(content_encoding)
        if len(codings) > 4:
            raise BadContent(f"{what}: content-encoding: more than 4 codings ({content_encoding[:80]!r})")
        self.limit = limit
        self.what = what
        self._chain = [_decoder(c) for c in reversed(codings)]
        self._raw = 0
        self._produced = [0] * len(self._chain)
        self._out: list[bytes] = []

    def _over(self, kind: str) -> BodyTooLarge:
        return BodyTooLarge(
            f"{self.what}: {kind} body exceeds max_body_bytes={self.limit} (decoding stopped there)", limit=self.limit
        )

    def _push(self, data: bytes, final: bool) -> None:
        for i, decoder in enumerate(self._chain):
            room = self.limit - self._produced[i] + 1  # one byte past the limit trips it
            data = decoder.feed(data, room) if data else b""
            if final:
                data += decoder.flush(room - len(data))
            self._produced[i] += len(data)
            if self._produced[i] > self.limit:
                raise self._over("decoded")
        if data:
            self._out.append(data)

    def feed(self, data: bytes) -> None:
        """Decode the next raw piece."""
        self._raw += len(data)
        if self._raw > self.limit:
            raise self._over("raw")
        for start in range(0, len(data), _CHUNK):
            self._push(data[start : start + _CHUNK], final=False)

    def finish(self) -> bytes:
        """The whole decoded body (checks that the compressed stream ended)."""
        self._push(b"", final=True)
        out = self._out
        return out[0] if len(out) == 1 else b"".join(out)


def decode_content(body: bytes | Iterable[bytes], content_encoding: str, limit: int, *, what: str = "body") -> bytes:
    """``body`` with its ``Content-Encoding`` undone, at most ``limit`` bytes decoded.

    Raises:
        BodyTooLarge: the body, as received or decoded, is over ``limit`` bytes.
        BadContent: an unknown coding, or a body corrupt in its coding.
    """
    if not _codings(content_encoding):
        data = body if isinstance(body, bytes) else b"".join(body)
        if len(data) > limit:
            raise BodyTooLarge(f"{what}: body exceeds max_body_bytes={limit}", limit=limit)
        return data
    inflater = Inflater(content_encoding, limit, what=what)
    for piece in [body] if isinstance(body, bytes) else body:
        inflater.feed(piece)
    return inflater.finish()


def _depth_ok(content: bytes | str) -> bool:
    """Whether the nesting of ``content`` stays within :data:`MAX_JSON_DEPTH` (a bracket
    count that ignores strings: an overestimate, exact for bodies without brackets in text)."""
    data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
    opened = data.count(b"[") + data.count(b"{")
    if opened <= MAX_JSON_DEPTH:
        return True
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_JSON_DEPTH:
                    return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


def loads_json(content: bytes | str) -> Any:
    """The JSON value of ``content`` (UTF-8 bytes or text), as ``json.loads`` reads it.

    orjson reads it; what orjson refuses is read by the standard library (which also
    accepts ``NaN``, ``Infinity``, ``1e400`` and big integers, for validators to reject by
    field name), after a nesting check, so no input ends in ``RecursionError``.

    Raises:
        ValueError: not UTF-8, not JSON, or nested deeper than :data:`MAX_JSON_DEPTH`.
    """
    import json

    try:
        return orjson.loads(content)
    except ValueError:  # orjson.JSONDecodeError
        pass
    try:
        text = content.decode() if isinstance(content, (bytes, bytearray, memoryview)) else content
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
    if not _depth_ok(text):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:  # within the depth, but past this thread's recursion limit
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None


def _encoding_of(response: Any) -> str:
    return ",".join(response.headers.get_list("content-encoding"))


def read_response(response: Any, limit: int, *, what: str = "body") -> bytes:
    """The decoded body of an httpx streaming ``response`` (``client.stream(...)``), at
    most ``limit`` bytes raw and decoded; the raw bytes are read in pieces.

    Raises:
        BodyTooLarge, BadContent: see :class:`Inflater`.
    """
    inflater = Inflater(_encoding_of(response), limit, what=what)
    raw: Iterator[bytes] = response.iter_raw()
    for piece in raw:
        inflater.feed(piece)
    return inflater.finish()


async def aread_response(response: Any, limit: int, *, what: str = "body") -> bytes:
    """:func:`read_response` for an ``httpx.AsyncClient``'s streaming response."""
    inflater = Inflater(_encoding_of(response), limit, what=what)
    raw: AsyncIterator[bytes] = response.aiter_raw()
    async for piece in raw:
        inflater.feed(piece)
    return inflater.finish()


#: The largest configuration file :func:`read_text_file` reads by default.
MAX_CONFIG_BYTES = 4 * 2**20


def read_text_file(path: str | os.PathLike[str], max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The text of the regular file at ``path``, at most ``max_bytes`` bytes of UTF-8.

    Opened without blocking (a FIFO with no writer would otherwise wait forever) and
    checked to be a regular file before a byte is read.

    Raises:
        OSError: the file cannot be opened (missing, no permission).
        ValueError: not a regular file, over ``max_bytes``, or not UTF-8; naming the file
            and the rule.
    """
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode) else "a device or socket"
            raise ValueError(f"{name!r}: must be a regular file, got {kind}")
        if info.st_size > max_bytes:
            raise ValueError(f"{name!r}: {info.st_size} bytes is over the limit of {max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            piece = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not piece:
                break
            chunks.append(piece)
            size += len(piece)
            if size > max_bytes:  # it grew while read
                raise ValueError(f"{name!r}: over the limit of {max_bytes} bytes")
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name!r}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
