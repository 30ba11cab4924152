"""`rollout-trio top` when the run it watches ends (issue 32 item 5): it says so and exits 0."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from rollout_trio.cli._top import top_main

from .process_helpers import reaped

_METRICS = b"# HELP rollout_trio_tasks_submitted_total x\n# TYPE rollout_trio_tasks_submitted_total counter\nrollout_trio_tasks_submitted_total 3.0\n"


class _Scrapes(http.server.BaseHTTPRequestHandler):
    """Answers every scrape with the same counters."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(_METRICS)))
        self.end_headers()
        self.wfile.write(_METRICS)

    def log_message(self, *args: object) -> None:
        pass


class _OneScrape(_Scrapes):
    """Answers one scrape, then the server goes away (as a run's metrics server does when it ends)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        super().do_GET()
        threading.Thread(target=self.server.shutdown, daemon=True).start()


def test_top_says_the_run_ended_and_exits_0(capsys):
    server = http.server.HTTPServer(("127.0.0.1", 0), _OneScrape)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    host, port = server.server_address[:2]
    closer = threading.Thread(target=lambda: (serving.join(), server.server_close()), daemon=True)
    closer.start()  # once serve_forever returns, the port closes: the next scrape is refused
    status = top_main([f"{host}:{port}", "--interval", "0.05"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert err.strip().splitlines()[-1] == f"rollout-trio top: the run ended (http://{host}:{port} stopped answering)"
    assert "Connection refused" not in err and "ConnectError" not in err


def test_top_of_an_address_nobody_serves_is_still_a_failure(capsys):
    server = http.server.HTTPServer(("127.0.0.1", 0), _OneScrape)
    host, port = server.server_address[:2]
    server.server_close()  # nobody listens there now
    assert top_main([f"{host}:{port}", "--once"]) == 1
    assert "cannot scrape" in capsys.readouterr().err


@pytest.mark.parametrize(("signum", "status", "how"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_top_says_what_it_showed_when_stopped(tmp_path, signum, status, how):
    """On a terminal (a pty), once a frame is shown: Ctrl-C or SIGTERM ends it with one line."""
    from tests.dump_helpers import write_dump_sync

    write_dump_sync(tmp_path, groups=2, group_size=2, versions=1)
    leader, follower = os.openpty()
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="100", LINES="40")
    screen = bytearray()
    first_frame = threading.Event()

    def read_the_terminal():  # to the end: a terminal nobody reads would block top's writes
        try:
            while chunk := os.read(leader, 65536):
                screen.extend(chunk)
                if b"tasks" in screen:  # the first frame's panel title
                    first_frame.set()
        except OSError:  # EIO: the last writer closed its end
            pass
        first_frame.set()

    reader = threading.Thread(target=read_the_terminal, daemon=True)
    try:
        with reaped(subprocess.Popen(
            [sys.executable, "-m", "rollout_trio", "top", str(tmp_path), "--interval", "0.05"],
            stdout=follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
        )) as proc:  # fmt: skip
            os.close(follower)
            follower = None
            reader.start()
            first_frame.wait(60)
            assert b"tasks" in screen, bytes(screen[-2000:])
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=60)
    finally:
        if follower is not None:
            os.close(follower)
        if reader.is_alive():
            reader.join(10)
        os.close(leader)
    assert proc.returncode == status, err
    assert re.fullmatch(rf"rollout-trio top: {how}; showed {re.escape(str(tmp_path))} for \d+\.\d s", err.strip()), err


# -- issue 31: top's first frame does not wait for torch ------------------------------------

_FRAME_THEN_MODULES = (
    "import contextlib, io, json, sys\n"
    "from rollout_trio.cli import main\n"
    "out = io.StringIO()\n"
    "with contextlib.redirect_stdout(out):\n"
    "    status = main(['top', sys.argv[1], '--once'])\n"
    "print(json.dumps([status, out.getvalue(), sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))\n"
)




def _top_once(address: str) -> tuple[int, str, list[str]]:
    env = dict(os.environ, COLUMNS="100")
    proc = subprocess.run([sys.executable, "-c", _FRAME_THEN_MODULES, address], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    status, frame, loaded = json.loads(proc.stdout.splitlines()[-1])
    return status, frame, loaded


def test_top_shows_a_metrics_frame_without_importing_torch():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Scrapes)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        host, port = server.server_address[:2]
        status, frame, loaded = _top_once(f"{host}:{port}")
    finally:
        server.shutdown()
        server.server_close()
    assert (status, loaded) == (0, []), frame
    assert f"http://{host}:{port}" in frame and "submitted" in frame


def test_top_shows_a_dump_frame_without_importing_torch(tmp_path):
    from tests.dump_helpers import write_dump_sync

    write_dump_sync(tmp_path, groups=2, group_size=2, versions=1)
    status, frame, loaded = _top_once(str(tmp_path))
    assert (status, loaded) == (0, []), frame
    assert "accepted" in frame and "reward by weight version" in frame
