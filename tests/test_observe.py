"""Watching a run: metrics scraped with prometheus-client's parser during real runs, traces, top."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from rollout_trio import ModelRequest, Trajectory, open_executor
from rollout_trio.engines import LocalEngine, RemoteEngine
from rollout_trio.engines._transport import TrioTransport
from rollout_trio.models import tiny_model
from rollout_trio.observe import (
    ExecutorMetrics,
    ObservedTransport,
    TracedEngine,
    TraceRecorder,
    metrics_app,
    open_metrics_server,
    snapshot_from_text,
)
from rollout_trio.testing import ScriptedEngine

from . import warm_cli
from .process_helpers import reaped
from .warm_cli import WarmPopen
from .test_executor import GC, gen_workflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of Prometheus ``text``, parsed by prometheus-client: ``(name, labels) -> value``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url)


def held_workflow(hold: trio.Event, generated: trio.Event) -> Any:
    """One generation; a task whose data says ``held`` then sets ``generated`` and waits for ``hold``."""

    async def workflow(engine: Any, data: Any) -> Trajectory:
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GC))
        if data.get("held"):
            generated.set()
            await hold.wait()
        return Trajectory.from_response(resp, data["reward"])

    return workflow


async def test_metrics_scraped_over_http_during_a_run_on_the_tiny_model() -> None:
    model, tok = tiny_model()
    metrics = ExecutorMetrics()
    hold = trio.Event()
    async with LocalEngine(model, tok, seed=0) as engine, open_metrics_server(metrics) as url:
        async with open_executor(engine, max_head_offpolicyness=10, observers=[metrics]) as ex:
            generated = trio.Event()
            workflow = held_workflow(hold, generated)
            for k in range(3):
                ex.submit({"reward": float(k)}, workflow)
            ex.submit({"reward": 5.0, "held": True}, workflow)
            first = await ex.wait(3)
            await generated.wait()  # the held task generated at version 0
            # mid-run: three consumed at version 0, one still running
            mid = scrape((await get(f"{url}/metrics")).text)
            engine.set_version(2)
            hold.set()
            (last,) = await ex.wait(1)
            end = scrape((await get(f"{url}/metrics")).text)
            page = await get(f"{url}/live")
            live = (await get(f"{url}/live.json")).json()
    assert len(first) == 3 and last is not None
    assert mid[("rollout_trio_tasks_submitted_total", ())] == 4
    assert mid[("rollout_trio_tasks_finished_total", (("status", "accepted"),))] == 3
    assert mid[("rollout_trio_tasks_running", ())] == 1
    assert mid[("rollout_trio_tasks_consumed_total", ())] == 3
    assert mid[("rollout_trio_consumed_version_lag_count", ())] == 3
    assert mid[("rollout_trio_consumed_version_lag_bucket", (("le", "0.0"),))] == 3
    assert mid[("rollout_trio_episodes_total", ())] == 3
    assert mid[("rollout_trio_tokens_total", ())] > 0
    assert mid[("rollout_trio_episodes_per_second", ())] > 0
    assert mid[("rollout_trio_reward_sum", (("version", "0"),))] == 0.0 + 1.0 + 2.0
    assert ("rollout_trio_loop_lag_seconds", ()) in mid
    # the held task started at version 0 and was consumed at 2
    assert end[("rollout_trio_tasks_running", ())] == 0 and end[("rollout_trio_tasks_buffered", ())] == 0
    assert end[("rollout_trio_consumed_version_lag_bucket", (("le", "1.0"),))] == 3
    assert end[("rollout_trio_consumed_version_lag_bucket", (("le", "2.0"),))] == 4
    assert end[("rollout_trio_reward_count", (("version", "0"),))] == 4
    assert page.status_code == 200 and "live.json" in page.text and "<script src" not in page.text
    counts = dict(live["counts"])
    assert counts["accepted"] == 4 and counts["consumed"] == 4
    assert live["lag"]["buckets"] == [["0", 3], ["1", 0], ["2", 1]] and live["lag"]["count"] == 4
    assert live["rewards"] == [[0, 4, pytest.approx(8.0 / 4)]]


async def test_metrics_app_is_served_by_the_shared_http_layer_with_its_limits() -> None:
    """The metrics server answers like ``serve``: exact routes, JSON errors, the same head limit."""
    from rollout_trio._http import ServerLimits

    metrics = ExecutorMetrics()
    app = metrics_app(metrics.registry, limits=ServerLimits(max_header_bytes=4096))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://metrics") as client:
        page = await client.get("/")
        assert page.status_code == 307 and page.headers["location"] == "/live"
        live = await client.get("/live")
        assert live.headers["content-type"].startswith("text/html") and "<html" in live.text.lower()
        scraped = scrape((await client.get("/metrics")).text)
        assert any(name.startswith("rollout_trio_") for name, _ in scraped)
        missing = await client.get("/metrics/")
        assert missing.status_code == 404 and "no endpoint /metrics/" in missing.json()["error"]["message"]
        assert (await client.post("/metrics")).status_code == 405
        huge = await client.get("/metrics", headers={"x-padding": "a" * 8192})
        assert huge.status_code == 431


def test_the_package_never_loads_starlette() -> None:
    """One HTTP layer: serving, the metrics server and the agent endpoint load no Starlette."""
    code = (
        "import sys, rollout_trio.observe, rollout_trio.server, rollout_trio.agents, rollout_trio.cli;"
        "from rollout_trio.observe import ExecutorMetrics, metrics_app; metrics_app(ExecutorMetrics().registry);"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'starlette'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_rejected_failed_and_cancelled_are_counted_apart() -> None:
    metrics = ExecutorMetrics()
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10, observers=[metrics]) as ex:
        await ex.wait_for_task(ex.submit({}, gen_workflow, should_accept_fn=lambda t: False))

        async def boom(engine: Any, data: Any) -> None:
            raise RuntimeError("bad luck")

        await ex.wait_for_task(ex.submit({}, boom))
        await ex.pause()
        assert ex.cancel(ex.submit({}, gen_workflow))
    from prometheus_client import generate_latest

    s = scrape(generate_latest(metrics.registry).decode())
    status = {k[1][0][1]: v for k, v in s.items() if k[0] == "rollout_trio_tasks_finished_total"}
    assert status == {"accepted": 0, "rejected": 1, "failed": 1, "cancelled": 1}
    assert s[("rollout_trio_tasks_queued", ())] == 0 and s[("rollout_trio_tasks_running", ())] == 0


async def test_remote_engine_servers_are_measured_through_the_transport() -> None:
    """A real `serve` app behind a socket; per-server calls, latency and in-flight from the transport."""
    from rollout_trio.server import ServerLimits, SGLangApp, serve_app, sglang_asgi

    model, tok = tiny_model()
    metrics = ExecutorMetrics()
    async with LocalEngine(model, tok, seed=0) as local, trio.open_nursery() as nursery:
        app = SGLangApp(local, tokenizer=tok)
        bound = await nursery.start(serve_app, sglang_asgi(app), "127.0.0.1", 0, ServerLimits())
        address = f"127.0.0.1:{bound[0][1]}"
        transport = ObservedTransport(TrioTransport(), metrics.registry)
        async with RemoteEngine(address, transport=transport) as remote:
            async with open_executor(remote, max_head_offpolicyness=10, observers=[metrics]) as ex:
                for _ in range(2):
                    ex.submit({}, gen_workflow)
                await ex.wait(2)
            server_text = (await get(f"http://{address}/metrics")).text
            server_live = (await get(f"http://{address}/live.json")).json()
        nursery.cancel_scope.cancel()
    from prometheus_client import generate_latest

    snap = snapshot_from_text(generate_latest(metrics.registry).decode(), "test")
    (row,) = snap["servers"]
    assert row["server"] == f"http://{address}" and row["calls"] >= 2 and row["in_flight"] == 0
    assert row["mean_latency"] > 0
    served = scrape(server_text)  # serve's own /metrics, as RemoteEngine's server sees it
    assert served[("rollout_trio_serve_generate_received_total", ())] >= 2
    assert served[("rollout_trio_serve_output_tokens_total", ())] > 0
    assert served[("rollout_trio_serve_request_seconds_count", (("route", "/generate"),))] >= 2
    assert dict(server_live["counts"])["generate finished"] >= 2


async def test_trace_is_chrome_trace_json_with_each_episode_lifecycle(tmp_path: Path) -> None:
    recorder = TraceRecorder()
    async with ScriptedEngine() as engine:
        traced = TracedEngine(engine, recorder)
        async with open_executor(traced, max_head_offpolicyness=10, observers=[recorder]) as ex:
            ok = ex.submit({"reward": 0.5}, gen_workflow)
            no = ex.submit({}, gen_workflow, should_accept_fn=lambda t: False)
            await ex.wait_for_task(no)
            await ex.wait(1)
    path = tmp_path / "trace.json"
    recorder.write(path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for e in events:  # the Trace Event Format's required fields, per phase
        assert e["ph"] in ("X", "i", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["name"], str) and isinstance(e.get("args", {}), dict)
        if e["ph"] != "M":
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t")

    def lifecycle(task: int) -> dict[str, dict[str, Any]]:
        timed = [e for e in events if e["ph"] != "M" and e["tid"] // 1000 == task]
        by_name = {e["name"]: e for e in timed}
        assert len(by_name) == len(timed)  # each step once
        return by_name

    def end(e: dict[str, Any]) -> float:
        return round(float(e["ts"] + e.get("dur", 0)), 3)  # microseconds with ns precision

    steps = lifecycle(ok)
    assert set(steps) == {"queued", "episode", "generate", "reward", "accepted", "buffered", "consumed"}
    assert end(steps["queued"]) == steps["episode"]["ts"] <= steps["generate"]["ts"]
    assert end(steps["generate"]) <= end(steps["episode"]) == steps["reward"]["ts"] == steps["accepted"]["ts"]
    assert steps["buffered"]["ts"] == end(steps["episode"]) and end(steps["buffered"]) == steps["consumed"]["ts"]
    assert steps["reward"]["args"]["rewards"] == [0.5] and steps["consumed"]["args"]["lag"] == 0
    assert set(lifecycle(no)) == {"queued", "episode", "generate", "reward", "rejected"}
    (gen,) = [e for e in events if e["name"] == "generate" and e["tid"] // 1000 == ok]
    assert gen["args"]["output_tokens"] > 0
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert f"task {ok}" in threads and f"task {ok} slot 0" in threads


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_run_serves_metrics_while_it_runs_and_top_shows_them(tmp_path: Path) -> None:
    """`run --metrics-port 0 --trace`: scrape mid-run, `top --once` on it and on its dump, then Ctrl-C."""
    trace = tmp_path / "trace.json"
    dump = tmp_path / "dump"
    with reaped(WarmPopen(
        [sys.executable, "-m", "rollout_trio", "run", "--groups", "100000", "--group-size", "2",
         "--metrics-port", "0", "--trace", str(trace), "--dump", str(dump)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )) as proc:  # fmt: skip
        assert proc.stderr is not None and proc.stdout is not None
        line = proc.stderr.readline()
        assert "metrics at http://127.0.0.1:" in line, line
        url = line.split("metrics at ")[1].split("/metrics")[0]
        assert proc.stdout.readline().startswith("group  question")
        proc.stdout.readline()  # a group finished: the run is under way (and has 99999 to go)
        samples = scrape(httpx.get(f"{url}/metrics", timeout=60).text)  # a deadline, not an expectation
        top = subprocess.run(
            [sys.executable, "-m", "rollout_trio", "top", "--once", url],
            capture_output=True, text=True, env=dict(_env(), COLUMNS="100"), timeout=60,
        )  # fmt: skip
        top_dump = subprocess.run(
            [sys.executable, "-m", "rollout_trio", "top", "--once", str(dump)],
            capture_output=True, text=True, env=dict(_env(), COLUMNS="100"), timeout=60,
        )  # fmt: skip
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    accepted = samples[("rollout_trio_tasks_finished_total", (("status", "accepted"),))]
    assert accepted >= 1 and samples[("rollout_trio_episodes_total", ())] == 2 * accepted
    assert top.returncode == 0, top.stderr
    assert url in top.stdout and "accepted" in top.stdout and "episodes/s" in top.stdout
    assert top_dump.returncode == 0, top_dump.stderr
    assert "accepted" in top_dump.stdout and "reward by weight version" in top_dump.stdout
    events = json.loads(trace.read_text())["traceEvents"]  # written although the run was interrupted
    assert any(e["name"] == "consumed" for e in events) and any(e["name"] == "generate" for e in events)


def test_top_refreshes_a_live_frame_from_a_dump_being_written(tmp_path: Path) -> None:
    from rich.console import Console

    from rollout_trio.cli._top import DumpSource, render

    folder = tmp_path / "rollout" / "3"
    folder.mkdir(parents=True)
    row = {"task_id": 0, "sample_idx": 0, "seqlen": 10, "prompt_len": 4, "head_version": 3, "tail_version": 3,
           "version_rle": [[3, 6]], "reward": 1.0, "prompt": "p", "completion": "c"}  # fmt: skip
    lines = [json.dumps(dict(row, sample_idx=k, reward=float(k))) + "\n" for k in range(3)]
    (folder / "0.jsonl").write_text(lines[0] + lines[1] + lines[2][:20])  # the third line is half written
    source = DumpSource(str(tmp_path))
    console = Console(file=io.StringIO(), width=100, force_terminal=False, record=True)
    history: dict[str, list[float]] = {}
    console.print(render(source.read(), history))
    with (folder / "0.jsonl").open("a") as fh:  # the writer finishes its line before the next refresh
        fh.write(lines[2][20:])
    console.print(render(source.read(), history))
    text = console.export_text()
    assert "2 accepted" in text and "3 accepted" in text  # the first frame, then the refreshed one
    assert "6 tokens" not in text.split("3 accepted")[1] and "18 tokens" in text


def test_top_names_an_address_it_cannot_reach() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_trio", "top", "--once", "127.0.0.1:1"],
        capture_output=True, text=True, env=_env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and "127.0.0.1:1/metrics: cannot scrape" in proc.stderr
    assert "Traceback" not in proc.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium (apt-get install -y chromium); the page's data, /live.json, is "
    "covered without a browser by test_metrics_scraped_over_http_during_a_run_on_the_tiny_model",
)
def test_live_page_renders_a_running_run_in_headless_chromium(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
               f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    with reaped(WarmPopen(
        [sys.executable, "-m", "rollout_trio", "run", "--groups", "100000", "--group-size", "2", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )) as proc:  # fmt: skip
        assert proc.stderr is not None and proc.stdout is not None
        url = proc.stderr.readline().split("metrics at ")[1].split("/metrics")[0]
        proc.stdout.readline()
        proc.stdout.readline()  # a group finished: the page has something to show
        dom = subprocess.run([*browser, "--dump-dom", f"{url}/live"], capture_output=True, text=True, timeout=60)
        shot = tmp_path / "live.png"
        subprocess.run([*browser, "--window-size=1200,600", f"--screenshot={shot}", f"{url}/live"],
                       capture_output=True, timeout=60, check=True)  # fmt: skip
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    html = dom.stdout
    accepted = int(html.split('data-key="accepted"><b>')[1].split("<")[0].replace(",", ""))
    assert accepted >= 1, html
    assert '<span id="state" class="dim">updated ' in html  # polled live.json without an error
    assert 'data-rate="episodes/s"' in html
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_window_rate_counts_each_series_over_the_window_and_forgets_what_left_it() -> None:
    """Rates per series over the last ``window`` seconds of its clock; events older than the
    window are dropped as new ones arrive, so memory stays bounded with nobody reading."""
    from rollout_trio.observe._metrics import WindowRate

    now = [0.0]
    rate = WindowRate(10.0, lambda: now[0], series=2)
    for t in range(100):  # one event a second: (1 episode, 50 tokens)
        now[0] = float(t)
        rate.add(1, 50)
    assert len(rate._events) == 10  # only the window's events are kept
    assert rate.per_second() == pytest.approx(1.0) and rate.per_second(1) == pytest.approx(50.0)
    now[0] = 200.0
    assert rate.per_second() == 0.0 and rate.per_second(1) == 0.0
    with pytest.raises(ValueError, match="WindowRate.window"):
        WindowRate(0.0)


def test_run_traces_each_phase_and_exports_its_seconds(tmp_path: Path) -> None:
    """Issue 28: the built-in workflow's phases ("generate", "reward") reach the --trace file
    as slices on their slot's track."""
    import json
    import subprocess
    import sys

    trace = tmp_path / "trace.json"
    done = warm_cli.run(
        [sys.executable, "-m", "rollout_trio", "run", "--groups", "2", "--group-size", "2", "--max-new-tokens", "2",
         "--trace", str(trace), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    events = json.loads(trace.read_text())["traceEvents"]
    phases = [e for e in events if e.get("cat") == "phase"]
    assert {e["name"] for e in phases} == {"generate", "reward"}
    assert len(phases) == 2 * 2 * 2  # two phases for each of 2 prompts x 2 slots
    assert all(e["dur"] >= 0 and e["args"]["status"] == "ok" for e in phases)
    assert "phase/generate_seconds" in done.stdout  # and in the run's group statistics
