"""How fast the library and the command line answer (issue 31, issue 32 item 5): ``python -m bench.cli_bench``.

Each figure is seconds from a fresh interpreter's start to its exit (the median of
``--trials`` rounds; the cases alternate within a round, so the machine's load hits them
alike), printed beside its target and beside the baselines measured in the same run:

- ``python -c pass``: the interpreter's own start, the floor of every figure;
- ``python -c "import torch"``: what each figure paid before issue 31 (torch first).

Figures:

- import: ``from rollout_trio import Trajectory`` (target < 1.5 s on a loaded machine), with
  the number of the package's modules it loads and whether torch is among them;
- ``rollout-trio --version``, ``--help``, an unknown command, each command's unknown flag,
  a missing required argument (usage errors, target < 1 s);
- a missing ``--model`` / dump path, an unavailable ``--device`` (failures, target < 1 s);
- ``rollout-trio top --once`` to its first frame, of a metrics endpoint and of a dump
  directory (target < 1 s);
- Ctrl-C and SIGTERM during a ``run``: seconds from the signal to the summary's last line
  and to the process's exit (no target here; printed as before).

Printed as a table, then one JSON object; written to ``bench/results/<date>-cli.json``.
"""

from __future__ import annotations

import argparse
import datetime
import http.server
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RUN = ["run", "--groups", "100000", "--group-size", "8", "--concurrency", "4"]

_METRICS = (
    b"# HELP rollout_trio_tasks_submitted_total x\n# TYPE rollout_trio_tasks_submitted_total counter\n"
    b"rollout_trio_tasks_submitted_total 3.0\n"
)
_IMPORT = (
    "import sys\nfrom rollout_trio import Trajectory\n"
    "print(sum(m.startswith('rollout_trio') for m in sys.modules), 'torch' in sys.modules)"
)


class _Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(_METRICS)))
        self.end_headers()
        self.wfile.write(_METRICS)

    def log_message(self, *args: object) -> None:
        pass


def _env(tree: Path = ROOT) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree), COLUMNS="100")


def _seconds(argv: list[str], expect: int | None = None, tree: Path = ROOT) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, check=False, env=_env(tree), cwd=tree)
    seconds = time.perf_counter() - started
    if expect is not None and proc.returncode != expect:
        raise SystemExit(f"{argv[1:]}: exit {proc.returncode}, expected {expect}: {proc.stderr.decode()[-300:]}")
    return seconds


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollout_trio", *args]


def _signal_to_exit(signum: int) -> tuple[float, float]:
    env = dict(_env(), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(_cli(*RUN), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    for _ in range(3):  # the header and two groups: the run is under way
        proc.stdout.readline()
    summary: list[float] = []
    sent = time.perf_counter()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if " episodes in " in line:
                summary.append(time.perf_counter() - sent)

    proc.send_signal(signum)
    reader = threading.Thread(target=read)
    reader.start()
    proc.wait()
    exited = time.perf_counter() - sent
    reader.join()
    return (summary[0] if summary else float("nan")), exited


def _write_dump(root: Path) -> None:
    folder = root / "rollout" / "0"
    folder.mkdir(parents=True)
    row = {"task_id": 0, "sample_idx": 0, "seqlen": 10, "prompt_len": 4, "head_version": 0, "tail_version": 0,
           "version_rle": [[0, 6]], "reward": 1.0, "prompt": "p", "completion": "c"}  # fmt: skip
    (folder / "0.jsonl").write_text("".join(json.dumps(dict(row, sample_idx=k)) + "\n" for k in range(4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--no-signals", action="store_true", help="skip the Ctrl-C / SIGTERM figures (they run a model)")
    parser.add_argument(
        "--compare", type=Path, metavar="TREE",
        help="another checkout (say main's) measured in the same rounds: each figure's 'before'",
    )  # fmt: skip
    opts = parser.parse_args()
    server = http.server.HTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = "{}:{}".format(*server.server_address[:2])
    dump = Path(tempfile.mkdtemp(prefix="cli-bench-"))
    _write_dump(dump)
    py = [sys.executable]
    #: name -> (argv, exit status, target seconds or None)
    cases: dict[str, tuple[list[str], int, float | None]] = {
        "baseline_python_start": ([*py, "-c", "pass"], 0, None),
        "baseline_import_torch": ([*py, "-c", "import torch"], 0, None),
        "import_trajectory": ([*py, "-c", _IMPORT], 0, 1.5),
        "version": (_cli("--version"), 0, 1.0),
        "help": (_cli("--help"), 0, 1.0),
        "unknown_command": (_cli("rnu"), 2, 1.0),
        **{f"{c}_bad_flag": (_cli(c, *(["/tmp"] if c in ("inspect", "replay", "top") else []), "--bogus"), 2, 1.0)
           for c in ("run", "serve", "inspect", "replay", "fleet", "top")},  # fmt: skip
        "top_missing_address": (_cli("top"), 2, 1.0),
        "run_missing_model": (_cli("run", "--model", "/nonexistent"), 1, 1.0),
        "run_no_device": (_cli("run", "--device", "cuda:99"), 1, 1.0),
        "inspect_missing_dump": (_cli("inspect", "/nonexistent"), 1, 1.0),
        "top_missing_dump": (_cli("top", "/nonexistent/dump"), 1, 1.0),
        "top_first_frame_metrics": (_cli("top", address, "--once"), 0, 1.0),
        "top_first_frame_dump": (_cli("top", str(dump), "--once"), 0, 1.0),
    }
    load_before = os.getloadavg()[0]
    samples: dict[str, list[float]] = {name: [] for name in cases}
    before: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(opts.trials):
        for name, (argv, status, _target) in cases.items():
            samples[name].append(_seconds(argv, status))
            if opts.compare and not name.startswith("baseline_"):
                before[name].append(_seconds(argv, status, opts.compare))
    out = subprocess.run([*py, "-c", _IMPORT], capture_output=True, text=True, env=_env(), cwd=ROOT, check=True).stdout.split()
    server.shutdown()
    median = statistics.median
    start, torch_s = median(samples["baseline_python_start"]), median(samples["baseline_import_torch"])
    figures: dict[str, dict[str, object]] = {}
    print(f"{'figure':<26} {'median s':>9} {'target':>8} {'met':>4} {'vs start':>9} {'vs torch':>9} {'before s':>9}  range")
    for name, (_, _, target) in cases.items():
        m = median(samples[name])
        met = None if target is None else m < target
        figures[name] = {"median_s": round(m, 3), "min_s": round(min(samples[name]), 3), "max_s": round(max(samples[name]), 3),
                         "target_s": target, "met": met, "vs_python_start": round(m / start, 2),
                         "vs_import_torch": round(m / torch_s, 2)}  # fmt: skip
        was = median(before[name]) if before[name] else None
        if was is not None:
            figures[name]["before_median_s"] = round(was, 3)
        print(
            f"{name:<26} {m:>9.3f} {('< %.1f' % target) if target else '-':>8} {('-' if met is None else 'yes' if met else 'NO'):>4}"
            f" {m / start:>8.2f}x {m / torch_s:>8.2f}x {'-' if was is None else f'{was:.3f}':>9}"
            f"  {min(samples[name]):.3f}-{max(samples[name]):.3f}"
        )
    result: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "trials": opts.trials,
        "compare": None if opts.compare is None else str(opts.compare),
        "load_average_before": round(load_before, 2),
        "import_trajectory_modules": int(out[0]),
        "import_trajectory_loads_torch": out[1] == "True",
        "figures": figures,
    }
    print(f"from rollout_trio import Trajectory: {out[0]} rollout_trio modules, torch loaded: {out[1]}")
    if not opts.no_signals:
        for name, signum in (("sigint", signal.SIGINT), ("sigterm", signal.SIGTERM)):
            runs = [_signal_to_exit(signum) for _ in range(3)]
            result[f"{name}_to_summary_s"] = round(median(r[0] for r in runs), 3)
            result[f"{name}_to_exit_s"] = round(median(r[1] for r in runs), 3)
    result["load_average_after"] = round(os.getloadavg()[0], 2)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{datetime.date.today().isoformat()}-cli.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
