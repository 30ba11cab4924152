"""``rollout-trio top ADDRESS``: a live terminal view of a run, refreshed once a second.

ADDRESS is what serves ``/metrics`` (``rollout-trio run --metrics-port``, an executor's
:func:`~rollout_trio.observe.open_metrics_server`, ``rollout-trio serve``), as
``http://HOST:PORT`` or ``HOST:PORT``; or a dump directory being written
(``run --dump``), whose new lines are read as they arrive. When a metrics endpoint that
answered stops answering (the run ended), ``top`` says "the run ended" and exits 0; an
address that never answered is a failure (exit 1).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._bounded import BadContent, BodyTooLarge, loads_json, read_response
from .._limits import MAX_DUMP_LINE_BYTES
from .._terminal import safe_tree
from ._common import CommandError, Parser, positive_float, run_command, stopped_by

__all__ = ["DumpSource", "HttpSource", "render", "top_main"]

_SPARK = "▁▂▃▄▅▆▇█"
_HISTORY = 60
#: The largest /metrics answer read, raw and once decoded (a run's metrics are kilobytes).
MAX_METRICS_BYTES = 16 * 2**20
#: Seconds one scrape may take by default: a run whose machine is saturated (its event loop
#: shares two cores with torch's threads) was seen answering after 5 s.
SCRAPE_TIMEOUT = 30.0


def _parser() -> Parser:
    p = Parser("rollout-trio top", __doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("address", metavar="ADDRESS", help="http://HOST:PORT (or HOST:PORT) serving /metrics, or a dump directory")
    p.add_argument("--interval", type=positive_float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=SCRAPE_TIMEOUT,
        help="seconds one scrape of /metrics may take (a run on a loaded machine answers late)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("ROLLOUT_TRIO_API_KEY") or None,
        help="sent as 'Authorization: Bearer KEY' to a serve started with --api-key (default: $ROLLOUT_TRIO_API_KEY)",
    )
    return p


# ---------------------------------------------------------------------------- sources


class RunEnded(Exception):
    """The metrics endpoint answered before and now refuses connections: the run is over."""


class HttpSource:
    """Scrapes ``{base}/metrics`` and parses it with prometheus-client's parser.

    The answer is untrusted: at most ``max_bytes`` are read, raw and once its
    ``Content-Encoding`` is undone (:mod:`rollout_trio._bounded`), and it must be UTF-8.
    """

    def __init__(
        self, address: str, api_key: str | None = None, timeout: float = SCRAPE_TIMEOUT, max_bytes: int = MAX_METRICS_BYTES
    ) -> None:
        import httpx

        base = address if "://" in address else f"http://{address}"
        self.base = base.rstrip("/").removesuffix("/metrics")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout, headers=headers)
        self.max_bytes = max_bytes
        self._answered = False  # once it has, a refused connection means the run ended

    def read(self) -> dict[str, Any]:
        import httpx

        from ..observe._snapshot import snapshot_from_text

        url = f"{self.base}/metrics"
        try:
            with self._client.stream("GET", url) as response:
                body = read_response(response, self.max_bytes, what=url)
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            if self._answered:
                raise RunEnded(f"{self.base} stopped answering") from exc
            raise CommandError(f"{url}: cannot scrape: {type(exc).__name__}: {exc}") from exc
        except httpx.HTTPError as exc:
            raise CommandError(f"{url}: cannot scrape: {type(exc).__name__}: {exc}") from exc
        except (BodyTooLarge, BadContent) as exc:
            raise CommandError(str(exc)) from None
        self._answered = True
        text = body.decode("utf-8", "replace")
        if response.status_code != 200:
            raise CommandError(f"{url}: HTTP {response.status_code}: {text[:200]!r}")
        try:
            return snapshot_from_text(text, self.base)
        except (ValueError, OverflowError, TypeError) as exc:
            raise CommandError(f"{url}: not Prometheus metrics: {exc}") from exc

    def close(self) -> None:
        self._client.close()


class DumpSource:
    """Reads a dump directory incrementally: each refresh parses only the complete lines added since.

    A file is read in pieces of at most ``max_line_bytes`` (so memory stays bounded
    however large the file); a line longer than that is a :class:`CommandError`.
    """

    def __init__(self, root: str, max_line_bytes: int = MAX_DUMP_LINE_BYTES) -> None:
        self.root = Path(root)
        self.max_line_bytes = max_line_bytes
        self._offsets: dict[Path, int] = {}
        self._counts = {"accepted": 0, "rejected": 0, "episodes": 0, "tokens": 0, "files": 0}
        self._rewards: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
        self._history: list[tuple[float, int, int]] = []
        self._version: int | None = None

    def _ingest(self, path: Path, version: int) -> None:
        offset = self._offsets.get(path, 0)
        limit = self.max_line_bytes
        with path.open("rb") as fh:
            while True:
                fh.seek(offset)
                data = fh.read(limit + 1)
                end = data.rfind(b"\n") + 1  # a line still being written waits for the next refresh
                if not end:
                    if len(data) > limit:
                        raise CommandError(
                            f"{path}: the line at byte {offset} is longer than max_line_bytes={limit} (not read)"
                        )
                    return
                offset += end
                self._offsets[path] = offset
                for line in data[:end].split(b"\n"):
                    if line.strip():
                        self._row(path, line, version)
                if len(data) <= limit:  # the end of the file
                    return

    def _row(self, path: Path, line: bytes, version: int) -> None:
        try:
            row = loads_json(line)
            accepted = bool(row.get("accepted", True))
            reward = float(row.get("original_reward") if row.get("original_reward") is not None else row["reward"])
            generated = int(row["seqlen"]) - int(row["prompt_len"])
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise CommandError(f"{path}: not a dump line: {exc!r:.200}") from None
        self._counts["episodes"] += 1
        self._counts["accepted" if accepted else "rejected"] += 1
        if accepted:
            self._counts["tokens"] += generated
            if math.isfinite(reward):  # a NaN or infinite reward is counted, not averaged
                entry = self._rewards[version]
                entry[0] += 1
                entry[1] += reward

    def read(self) -> dict[str, Any]:
        from ..executor._dump_records import SCOPES

        if not self.root.is_dir():
            raise CommandError(f"{self.root}: no such dump directory")
        files = sorted(self.root.rglob("*.jsonl"))
        for path in files:
            scope, version = path.parent.parent.name, path.parent.name
            if scope in SCOPES and version.lstrip("-").isdigit():
                self._version = max(self._version or 0, int(version))
                self._ingest(path, int(version))
        self._counts["files"] = len(self._offsets)
        now = time.monotonic()
        self._history = [h for h in self._history if h[0] > now - 10.0] + [(now, self._counts["episodes"], self._counts["tokens"])]
        t0, e0, k0 = self._history[0]
        span = now - t0
        rates = [["episodes/s", (self._counts["episodes"] - e0) / span if span else 0.0],
                 ["tokens/s", (self._counts["tokens"] - k0) / span if span else 0.0]]  # fmt: skip
        return {
            "source": str(self.root),
            "time": time.time(),
            "counts": [[k, v] for k, v in self._counts.items()],
            "rates": rates,
            "version": self._version,
            "lag": {"buckets": [], "count": 0, "mean": None},
            "rewards": [[v, n, s / n] for v, (n, s) in sorted(self._rewards.items()) if n],
            "servers": [],
            "loop_lag": None,
        }

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- rendering


def _spark(values: Sequence[float]) -> str:
    values = [v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0 for v in values]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int(v / top * (len(_SPARK) - 1) + 0.5))] for v in values)


def _n(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return f"{int(v):,}"
    return f"{v:.2f}"


def render(snap: dict[str, Any], history: dict[str, list[float]]) -> Any:
    """The frame for ``snap`` (a rich renderable); ``history`` keeps each rate's recent values.

    Every string of ``snap`` came from elsewhere (a server's labels, a dump's path): each is
    shown through :func:`~rollout_trio._terminal.terminal_safe` and as ``Text`` (never
    parsed as rich markup).
    """
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    snap = safe_tree(snap)
    loop = "-" if snap["loop_lag"] is None else f"{snap['loop_lag'] * 1000:.1f} ms"
    head = Text.assemble(
        ("rollout-trio top ", "bold"), (snap["source"], "cyan"),
        f"   version {_n(snap['version'])}   loop lag {loop}   ",
        (time.strftime("%H:%M:%S", time.localtime(snap["time"])), "dim"),
    )  # fmt: skip
    counts = Table.grid(padding=(0, 2))
    cells = [Text.assemble((f"{_n(v):>9}", "bold"), f" {k}") for k, v in snap["counts"]]
    columns = 4
    for _ in range(columns):
        counts.add_column(no_wrap=True, min_width=10 + max((len(k) for k, _ in snap["counts"]), default=0))
    for i in range(0, len(cells), columns):
        counts.add_row(*cells[i : i + columns])
    rates = Table.grid(padding=(0, 2))
    for label, value in snap["rates"]:
        series = history.setdefault(label, [])
        series.append(value)
        del series[:-_HISTORY]
        rates.add_row(Text(f"{value:10.1f}", style="bold"), Text(label), Text(_spark(series), style="green"))
    parts: list[Any] = [head, Panel(counts, title="tasks", title_align="left"), Panel(rates, title="throughput", title_align="left")]
    lag = snap["lag"]
    if lag["count"]:
        bars = Table.grid(padding=(0, 1))
        most = max(n for _, n in lag["buckets"]) or 1
        for label, n in lag["buckets"]:
            bars.add_row(Text(f"{label:>6}"), Text("█" * max(1 if n else 0, round(n / most * 30)), style="blue"), _n(n))
        mean = "" if lag["mean"] is None else f", mean {lag['mean']:.2f}"
        parts.append(Panel(bars, title=f"version lag of consumed data ({_n(lag['count'])}{mean})", title_align="left"))
    if snap["rewards"]:
        rewards = Table("version", "episodes", "mean reward", box=None, padding=(0, 2))
        for version, n, mean in snap["rewards"][-8:]:
            rewards.add_row(Text(str(version)), _n(n), f"{mean:.3f}")
        parts.append(Panel(rewards, title="reward by weight version", title_align="left"))
    if snap["servers"]:
        servers = Table("server", "in flight", "calls", "mean latency", "aborts", "errors", box=None, padding=(0, 2))
        for s in snap["servers"]:
            latency = "-" if s["mean_latency"] is None else f"{s['mean_latency'] * 1000:.1f} ms"
            servers.add_row(Text(str(s["server"])), _n(s["in_flight"]), _n(s["calls"]), latency, _n(s["aborts"]), _n(s["errors"]))
        parts.append(Panel(servers, title="inference servers", title_align="left"))
    return Group(*parts)


def source_for(address: str, api_key: str | None = None, timeout: float = SCRAPE_TIMEOUT) -> HttpSource | DumpSource:
    """A dump directory when ``address`` is one, else an HTTP metrics endpoint (scraped with ``timeout``)."""
    if os.path.isdir(address):
        return DumpSource(address)
    if os.sep in address and "://" not in address:
        raise CommandError(f"{address}: no such dump directory")
    return HttpSource(address, api_key, timeout=timeout)


def watch(source: HttpSource | DumpSource, *, interval: float, once: bool, console: Any = None, shown: list[int] | None = None) -> None:
    """Show ``source`` until Ctrl-C (``once``: one frame); ``shown`` counts the frames."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    history: dict[str, list[float]] = {}
    shown = [0] if shown is None else shown
    if once:
        console.print(render(source.read(), history))
        shown[0] += 1
        return
    # Nothing else prints while it lives, so stdout and stderr stay themselves (a Ctrl-C
    # part-way through starting it would otherwise leave them redirected).
    with Live(console=console, auto_refresh=False, screen=False, redirect_stdout=False, redirect_stderr=False) as live:
        while True:
            frame = render(source.read(), history)
            shown[0] += 1  # (a Ctrl-C while it is drawn still counts it as shown)
            live.update(frame, refresh=True)
            time.sleep(interval)


def _main(args: argparse.Namespace) -> int:
    source = source_for(args.address, args.api_key, args.timeout)
    shown = [0]
    started = time.monotonic()
    try:
        watch(source, interval=args.interval, once=args.once, shown=shown)
    except RunEnded as ended:
        print(f"rollout-trio top: the run ended ({ended})", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what it watched, then 130 or 143
        how, status = stopped_by()
        where = args.address if isinstance(source, DumpSource) else source.base
        shown_for = f"showed {where} for {time.monotonic() - started:.1f} s" if shown[0] else f"nothing shown of {where} yet"
        print(f"rollout-trio top: {how}; {shown_for}", file=sys.stderr, flush=True)
        return status
    finally:
        source.close()
    return 0


def top_main(argv: Sequence[str]) -> int:
    """Entry point of ``rollout-trio top``; returns the exit status (Ctrl-C: 130)."""
    return run_command("rollout-trio top", _parser(), argv, _main)


if __name__ == "__main__":
    sys.exit(top_main(sys.argv[1:]))
