"""`rollout-trio top` when the run it watches ends (issue 32 item 5): it says so and exits 0."""

from __future__ import annotations

import http.server
import threading

from rollout_trio.cli._top import top_main

_METRICS = b"# HELP rollout_trio_tasks_submitted_total x\n# TYPE rollout_trio_tasks_submitted_total counter\nrollout_trio_tasks_submitted_total 3.0\n"


class _OneScrape(http.server.BaseHTTPRequestHandler):
    """Answers one scrape, then the server goes away (as a run's metrics server does when it ends)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(_METRICS)))
        self.end_headers()
        self.wfile.write(_METRICS)
        threading.Thread(target=self.server.shutdown, daemon=True).start()

    def log_message(self, *args: object) -> None:
        pass


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
