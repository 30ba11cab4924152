"""Hostile local inputs (issue 34, item 6): dumps, config files, metrics answers and text
that reaches a terminal. Each gives the module's typed error (or is shown safely) within
a bounded time and memory."""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_trio._bounded import read_text_file
from rollout_trio._terminal import terminal_safe
from rollout_trio.cli._common import CommandError, describe_exception
from rollout_trio.cli._inspect import inspect_main
from rollout_trio.cli._top import DumpSource, HttpSource, render

from .test_inspect import write_reward_dump

HOSTILE = "\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m[red]x[/red][link=file:///etc]y[/link]\u202e\r\x00"


# --------------------------------------------------------------------- inspect


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_inspect_on_a_dump_with_nan_or_infinite_rewards_reports_them(bad: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = write_reward_dump(tmp_path / "dump", {0: [bad, bad], 1: [0.0, bad, 1.0]})
    page = tmp_path / "page.html"
    assert inspect_main([str(dump), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "3 rows have a NaN or infinite reward" in out
    assert "5 rows" in out
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_inspect_on_a_dump_whose_every_reward_is_nan_still_summarizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = write_reward_dump(tmp_path / "dump", {0: [math.nan], 1: [math.nan]})
    assert inspect_main([str(dump), "--html", str(tmp_path / "p.html")]) == 0
    assert "2 rows have a NaN or infinite reward" in capsys.readouterr().out


# --------------------------------------------------------------------- top on a dump


def _dump_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dump" / "exp" / "trial" / "rollout" / "0"
    d.mkdir(parents=True)
    return d


def test_top_on_a_1_gib_dump_line_is_a_one_line_error_in_bounded_memory(tmp_path: Path) -> None:
    """A 1 GiB line (sparse: no disk used) is refused after reading max_line_bytes of it."""
    d = _dump_dir(tmp_path)
    with open(d / "0.jsonl", "wb") as f:
        f.write(b'{"reward": 1, "seqlen": 3, "prompt_len": 1}\n')
        f.truncate(2**30)
    source = DumpSource(str(tmp_path / "dump"))
    tracemalloc.start()
    try:
        with pytest.raises(CommandError, match="longer than max_line_bytes"):
            source.read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * source.max_line_bytes
    assert source._counts["episodes"] == 1  # the complete line before it was read


@pytest.mark.parametrize(
    "line",
    [b"[" * 100_000 + b"]" * 100_000, b'{"reward": "\xff"}', b"[1, 2]", b'{"reward": 1e400, "seqlen": 1e400, "prompt_len": 0}'],
    ids=["deep", "invalid-utf8", "not-an-object", "overflow"],
)
def test_top_on_a_hostile_dump_line_is_a_command_error(line: bytes, tmp_path: Path) -> None:
    (_dump_dir(tmp_path) / "0.jsonl").write_bytes(line + b"\n")
    with pytest.raises(CommandError, match="not a dump line"):
        DumpSource(str(tmp_path / "dump")).read()


def test_top_counts_nan_rewards_without_averaging_them(tmp_path: Path) -> None:
    rows = [{"reward": r, "seqlen": 3, "prompt_len": 1} for r in (math.nan, 1.0, math.inf)]
    (_dump_dir(tmp_path) / "0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    snap = DumpSource(str(tmp_path / "dump")).read()
    assert dict(map(tuple, snap["counts"]))["episodes"] == 3
    assert snap["rewards"] == [[0, 1, 1.0]]


# --------------------------------------------------------------------- top scraping a hostile server


class RawHttp:
    """A blocking loopback server answering every request with ``raw`` (``top`` is sync)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    conn.sendall(self.raw)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_http() -> Iterator[list[RawHttp]]:
    made: list[RawHttp] = []
    yield made
    for server in made:
        server.close()


def _answer(body: bytes, coding: str = "") -> bytes:
    head = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/plain\r\n"
    if coding:
        head += b"content-encoding: %s\r\n" % coding.encode()
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def test_top_refuses_a_gzip_bomb_from_the_metrics_server_in_bounded_memory(raw_http: list[RawHttp]) -> None:
    bomb = gzip.compress(b"# " + b" " * (1 << 30), compresslevel=1)  # ~1 MiB, 1 GiB inflated
    server = RawHttp(_answer(bomb, "gzip"))
    raw_http.append(server)
    source = HttpSource(f"127.0.0.1:{server.port}", timeout=30)
    tracemalloc.start()
    try:
        with pytest.raises(CommandError, match=f"max_body_bytes={source.max_bytes}"):
            source.read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        source.close()
    assert peak < 4 * source.max_bytes


def test_top_shows_a_servers_escape_sequences_and_markup_as_text(raw_http: list[RawHttp]) -> None:
    label = HOSTILE.replace("\\", "").replace('"', "").replace("\n", "")
    text = (
        "# TYPE rollout_trio_server_in_flight gauge\n"
        f'rollout_trio_server_in_flight{{server="{label}"}} 1\n'
    ).encode()
    server = RawHttp(_answer(text))
    raw_http.append(server)
    source = HttpSource(f"127.0.0.1:{server.port}")
    try:
        snap = source.read()
    finally:
        source.close()
    snap["source"] = HOSTILE
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, force_terminal=False, color_system=None, width=400).print(render(snap, {}))
    shown = out.getvalue()
    assert not any(c in shown for c in "\x1b\x07\x9b\x00\r\u202e"), repr(shown)
    assert "[red]x[/red]" in shown and "[link=file:///etc]" in shown  # markup shown, not obeyed
    assert "\\x1b]52" in shown


# --------------------------------------------------------------------- terminal_safe


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_terminal_safe_leaves_no_control_character(text: str) -> None:
    """Invariant: whatever a string holds, terminal_safe's output has no C0/C1 control,
    DEL or bidirectional control, and printable text without escapes is unchanged."""
    safe = terminal_safe(text, max_chars=None)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\u2028\u2029" for c in safe)
    if text.isprintable():
        assert safe == text or any(c in text for c in "\u200e\u200f\u061c")


def test_a_cli_error_carrying_a_servers_message_prints_no_control_sequence() -> None:
    from rollout_trio import EngineServerError

    line = describe_exception(EngineServerError(f"POST x/generate: HTTP 500: {HOSTILE}", status_code=500))
    assert "\x1b" not in line and "\x07" not in line and "\\x1b]52" in line


# --------------------------------------------------------------------- config files


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_read_text_file_refuses_what_is_not_a_regular_file_at_once(kind: str, tmp_path: Path) -> None:
    if kind == "fifo":
        path = tmp_path / "config.yaml"
        os.mkfifo(path)
    elif kind == "dev-zero":
        path = Path("/dev/zero")
    else:
        path = tmp_path
    with pytest.raises(ValueError, match="must be a regular file"):
        read_text_file(path)


def test_read_text_file_bounds_the_size_and_requires_utf8(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2**30)
    with pytest.raises(ValueError, match="over the limit"):
        read_text_file(big)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"max_concurrent_rollouts: 4\n# \xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_text_file(bad)


@pytest.mark.parametrize("kind", ["fifo", "invalid-utf8", "dev-zero"])
def test_from_file_on_a_fifo_or_invalid_utf8_is_a_value_error_at_once(kind: str, tmp_path: Path) -> None:
    """A FIFO blocked forever, /dev/zero ended in MemoryError after 13 s, bad UTF-8 was a UnicodeDecodeError."""
    from rollout_trio import RolloutConfig

    path = tmp_path / "config.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_bytes(b"\xff\n")
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            RolloutConfig.from_file(path)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked on the FIFO: a writer that opens and closes frees it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("from_file blocked on a FIFO")
    (error,) = outcome
    assert isinstance(error, ValueError) and ("regular file" in str(error) or "UTF-8" in str(error)), repr(error)
