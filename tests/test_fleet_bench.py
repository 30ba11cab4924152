"""bench/fleet_bench.py runs (a tiny --quick smoke run) and prints every figure with its target
and its bare-client floor."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest_remote import ROOT

pytestmark = pytest.mark.slow


def test_fleet_bench_quick_prints_every_figure_with_its_target():
    run = subprocess.run(
        [sys.executable, "bench/fleet_bench.py", "--quick", "--servers", "4", "--episodes", "200", "--seconds", "0.2"],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for figure, target in [
        ("client CPU per request", "target <= 50 us"),
        ("Trio loop lag p99", "target < 10 ms"),
        ("pause fan-out p99 (4 servers)", "target < 50 ms"),
        ("resume fan-out p99 (4 servers)", "target < 50 ms"),
        ("update fan-out p99 (4 servers)", "target < 50 ms"),
    ]:
        assert re.search(rf"{re.escape(figure)}\s+\d+\.\d \w+\s+{re.escape(target)}\s+(ok|MISSED)", out), out
    # Each figure beside the same-process floor: a bare Trio socket client on the same servers.
    assert re.search(r"bare Trio socket client \d+\.\d us: ours / bare \d+\.\d\dx", out), out
    assert len(re.findall(r"bare client under the same load \d+\.\d ms; idle: ours \d+\.\d, bare \d+\.\d ms", out)) == 3, out
    assert re.search(r"through sglang-router\s+\d+\.\d req/s\s+direct\s+\d+\.\d req/s\s+router / direct \d+\.\d\dx", out), out
    assert re.search(r"the router process's own CPU per routed request \d+ us", out), out
    assert re.search(r"the full run \(python bench/fleet_bench.py\) takes about \d+ s", out), out


def test_fleet_bench_curve_reports_every_figure_for_every_n(tmp_path):
    out_file = tmp_path / "curve.json"
    run = subprocess.run(
        [sys.executable, "bench/fleet_bench.py", "--curve", "--quick", "--servers", "8,16", "--episodes", "100",
         "--control-rounds", "5", "--json", str(out_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    from bench.fleet_curve import FIGURES

    out = run.stdout
    assert re.search(r"load average \d+\.\d\d before, \d+\.\d\d after", out), out
    number = r"\s+-?\d+\.\d\d"
    for _key, label, unit in FIGURES:  # N=8, N=16, the ratio to N=8, the growth exponent
        assert re.search(rf"{re.escape(label)}\s+{unit}{number}{number}{number}\s+k=(-?\d+\.\d\d|nan)", out), (label, out)
    import json

    saved = json.loads(out_file.read_text())
    assert [point["n"] for point in saved["points"]] == [8, 16]
    assert len(saved["loadavg_before"]) == 3
    for point in saved["points"]:
        assert {key for key, _, _ in FIGURES} <= point.keys()


def test_fleet_bench_servers_must_be_counts():
    run = subprocess.run([sys.executable, "bench/fleet_bench.py", "--servers", "8,x"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "--servers" in run.stderr and "comma-separated" in run.stderr, run.stderr
