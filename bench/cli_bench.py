"""How fast the command line answers (issue 32 item 5): ``python -m bench.cli_bench``.

- a missing ``--model``, an unavailable ``--device``: seconds from start to the error line,
  as a ratio to ``rollout-trio --version`` in the same session (the interpreter's own start);
- Ctrl-C and SIGTERM during a ``run``: seconds from the signal to the summary's last line
  and to the process's exit.

Printed as one JSON object; the median of ``--trials`` runs each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

RUN = ["run", "--groups", "100000", "--group-size", "8", "--concurrency", "4"]


def _start_to_exit(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rollout_trio", *argv], capture_output=True, check=False)
    return time.perf_counter() - started


def _signal_to_exit(signum: int) -> tuple[float, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_trio", *RUN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    trials = parser.parse_args().trials
    median = statistics.median
    baseline = median(_start_to_exit(["--version"]) for _ in range(trials))
    result: dict[str, object] = {"version_s": round(baseline, 3), "load_average": round(os.getloadavg()[0], 2)}
    for name, argv in (("missing_model", ["run", "--model", "/nonexistent"]), ("no_device", ["run", "--device", "cuda:99"])):
        seconds = median(_start_to_exit(argv) for _ in range(trials))
        result[f"{name}_s"] = round(seconds, 3)
        result[f"{name}_vs_version"] = round(seconds / baseline, 2)
    for name, signum in (("sigint", signal.SIGINT), ("sigterm", signal.SIGTERM)):
        runs = [_signal_to_exit(signum) for _ in range(trials)]
        result[f"{name}_to_summary_s"] = round(median(r[0] for r in runs), 3)
        result[f"{name}_to_exit_s"] = round(median(r[1] for r in runs), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
