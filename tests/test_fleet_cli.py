"""`rollout-trio fleet` (issue 16 item 6): N `serve` workers behind a real sglang-router.

Driven as a subprocess, synchronising on what it prints. Usage errors are one line and
exit 2; a failed start is one line and exit 1; Ctrl-C stops the router and the workers
and exits 130 saying what it stopped, SIGTERM the same with 0; a worker that dies is
reported and the router keeps serving from the others; no child ever survives the command.
"""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from rollout_trio.cli import main
from tests.fleet_helpers import FleetProcess, alive, fleet, worker_stats

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--workers", "0"], "--workers: must be an integer >= 1, got '0'"),
        (["--policy", "manual"], "--policy: invalid choice: 'manual'"),
        (["--host", "0.0.0.0"], "--host: the fleet sets it for every worker (workers listen on 127.0.0.1)"),
        (["--port-file=/tmp/p"], "--port-file: the fleet sets it for every worker"),
        (["--segment-tokens", "0"], "--segment-tokens: must be an integer >= 1, got '0'"),  # a serve option
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--work", "3"], "unrecognized arguments: --work 3"),  # no prefix matching of --workers
        (["--devices", "cpu,cpu", "--device", "cpu"], "--devices: give it or --device, not both"),
        (["--devices", "cuda:0", "--ray", "auto"], "--devices: Ray places the workers on its GPUs"),
        (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),  # a serve option
    ],
)
def test_a_bad_option_of_the_fleet_or_its_workers_is_one_line_and_exit_2(capsys, argv, says):
    assert main(["fleet", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout-trio fleet: error: ") and says in lines[0], lines
    assert lines[0].endswith("(see rollout-trio fleet --help)")


def test_devices_give_worker_i_the_i_th_device_round_robin_and_every_one_is_checked(monkeypatch, capsys):
    from rollout_trio.cli import _checkpoint, _fleet

    args = _fleet._parser().parse_args(["--workers", "5", "--devices", "cuda:0,cuda:1,cpu", "--seed", "3"])
    placed = [w.argv[w.argv.index("--device") + 1] for w in _fleet.Fleet(_without_key(args), args.worker_options).workers]
    assert placed == ["cuda:0", "cuda:1", "cpu", "cuda:0", "cuda:1"]
    one = _fleet._parser().parse_args(["--workers", "2", "--device", "cpu"])
    assert all(w.argv.count("--device") == 1 for w in _fleet.Fleet(_without_key(one), one.worker_options).workers)
    # every listed device is checked before anything starts: the second one is absent here
    monkeypatch.setattr(_checkpoint, "_torch_lib_files", lambda: ["libtorch_cuda.so"])
    monkeypatch.setattr(_checkpoint.sys, "platform", "linux")
    monkeypatch.setattr(_checkpoint, "_cuda_device_count", lambda: 1)
    assert main(["fleet", "--devices", "cuda:0,cuda:1"]) == 1
    assert capsys.readouterr().err.strip() == (
        "rollout-trio fleet: error: --device cuda:1: this machine has 1 CUDA device(s), cuda:0 to cuda:0"
    )


def _without_key(args):
    args.key = None
    return args


def test_a_worker_that_cannot_start_is_one_line_exit_1_and_nothing_is_left_running(tmp_path):
    from rollout_trio.models import byte_tokenizer

    not_a_model = tmp_path / "tokenizer-only"  # what the fleet checks is there (a directory, a tokenizer), no model
    byte_tokenizer().save_pretrained(not_a_model)
    process = FleetProcess("--workers", "2", "--model", str(not_a_model))
    try:
        assert process.wait() == 1
    finally:
        process.stop()
    assert process.stdout == []  # nothing was ever ready
    assert len(process.stderr) == 1, process.stderr
    assert re.fullmatch(
        r"rollout-trio fleet: error: worker [01] exited with status 1 before it was ready: "
        rf"rollout-trio serve: error: --model {re.escape(str(not_a_model))}: cannot load a model and tokenizer from it: .*",
        process.stderr[0],
    ), process.stderr
    assert process.survivors() == []


def test_a_missing_checkpoint_is_the_fleets_own_error_before_any_worker_starts():
    process = FleetProcess("--workers", "2", "--model", "/nonexistent/checkpoint")
    try:
        assert process.wait() == 1
    finally:
        process.stop()
    assert process.stderr == ["rollout-trio fleet: error: --model /nonexistent/checkpoint: no such checkpoint directory"]
    assert process.survivors() == []


def test_the_startup_deadline_is_one_line_naming_what_was_not_ready():
    process = FleetProcess("--workers", "2", "--startup-timeout", "0.2")
    try:
        assert process.wait() == 1
    finally:
        process.stop()
    assert process.stderr == [
        "rollout-trio fleet: error: not ready within --startup-timeout 0.2 s: "
        "worker 0, worker 1 still loading (not listening yet)"
    ]
    assert process.survivors() == []


def test_the_fleet_serves_through_the_router_survives_a_dead_worker_and_ctrl_c_stops_all():
    with fleet("--policy", "round_robin", workers=2) as running:
        assert len(set(running.pids)) == 3 and all(map(alive, running.pids))
        assert running.survivors() == sorted([running.proc.pid, *running.pids])
        for url, _ in running.workers:  # each worker answers on its own address
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        rids = [f"through-router-{i}" for i in range(4)]
        for rid in rids:
            answer = httpx.post(running.router + "/generate", json={**GENERATE, "rid": rid}, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["output_ids"], answer.text
        served = [
            [rid for rid in rids if any(f.startswith(rid) for f in worker_stats(url)["finished_rids"])]  # type: ignore[union-attr]
            for url, _ in running.workers
        ]
        assert sorted(served[0] + served[1]) == rids and served[0] and served[1]  # round robin used both

        (dead_url, dead_pid) = running.workers[1]
        running_pids = [p for p in running.pids if p != dead_pid]
        os.kill(dead_pid, signal.SIGKILL)
        running.expect(
            rf"worker 1 at {re.escape(dead_url)} \(pid {dead_pid}\) exited with signal SIGKILL; 1 of 2 workers left",
            stream="err",
            timeout=30,
        )
        for i in range(4):  # the router retries what it sent to the dead worker on the live one
            answer = httpx.post(running.router + "/generate", json={**GENERATE, "rid": f"after-{i}"}, timeout=60)
            assert answer.status_code == 200, answer.text

        running.proc.send_signal(signal.SIGINT)
        assert running.wait() == 130
        last = running.stderr[-1]
        assert last.startswith("rollout-trio fleet: interrupted; stopped router at " + running.router), last
        assert f"worker 0 at {running.workers[0][0]} (pid {running.workers[0][1]})" in last
        assert "worker 1" not in last  # it was dead already: not claimed as stopped
        assert not any(map(alive, running_pids)) and running.survivors() == []


def test_sigterm_stops_the_fleet_with_status_0_and_a_pipe_gets_no_colours():
    # at info, sglang-router logs coloured lines (ESC [ 2 m ...) that the fleet relays to its stderr
    with fleet("--router-log-level", "info", workers=1) as running:
        running.proc.send_signal(signal.SIGTERM)
        assert running.wait() == 0
        assert running.stderr[-1].startswith("rollout-trio fleet: terminated; stopped router at "), running.stderr
        assert running.survivors() == []
    relayed = [line for line in running.stderr if line.startswith("[router] ")]
    assert relayed, running.stderr  # the router did speak
    assert not [line for line in running.stderr + running.stdout if "\x1b" in line]


def test_the_router_dying_is_a_one_line_failure_and_the_workers_are_stopped():
    with fleet(workers=1) as running:
        os.kill(running.router_pid, signal.SIGKILL)
        assert running.wait() == 1
        assert running.stderr[-1] == "rollout-trio fleet: error: sglang-router exited with signal SIGKILL", running.stderr
        assert running.survivors() == []


# -- issue 34 item 3: the fleet's api key reaches every worker and the router -------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--api-key", "has space in it ok"], "--api-key: must be 16-256 characters"),
        (["--api-key=fleet:key:with:colons"], "--api-key: must be 16-256 characters"),
        (["--api-key", "0123456789abcdef", "--no-api-key"], "--no-api-key: not allowed with argument --api-key"),
    ],
)
def test_a_bad_api_key_option_is_one_line_and_exit_2(capsys, argv, says):
    assert main(["fleet", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_no_api_key_with_a_key_file_is_one_line_and_exit_1(capsys, tmp_path):
    assert main(["fleet", "--no-api-key", "--key-file", str(tmp_path / "k")]) == 1
    assert "--key-file: there is no key to write with --no-api-key" in capsys.readouterr().err


def test_a_key_file_planted_as_a_link_is_never_followed(capsys, tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep\n")
    (tmp_path / "k").symlink_to(target)
    assert main(["fleet", "--key-file", str(tmp_path / "k"), "--workers", "1"]) == 1
    assert "--key-file: cannot write" in capsys.readouterr().err and target.read_text() == "keep\n"


def test_the_fleet_generates_a_key_every_worker_and_the_router_require(tmp_path):
    """On main: `fleet` could not give its workers a key; any local user could pause,
    relabel (POST /update_weight_version 1000) or reload them, or edit the router."""
    key_file = tmp_path / "fleet.key"
    with fleet("--key-file", str(key_file), workers=2, keyed=True) as running:
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        key = key_file.read_text().strip()
        assert len(key) >= 16
        good = {"Authorization": f"Bearer {key}"}
        assert f"api key in {key_file}" in running.stdout[-1]
        for url, pid in running.workers:
            relabel = httpx.post(url + "/update_weight_version", json={"new_version": "1000"}, timeout=10)
            assert relabel.status_code == 401
            assert httpx.post(url + "/pause_generation", json={}, timeout=10).status_code == 401
            assert httpx.get(url + "/get_weight_version", headers=good, timeout=10).json() == {"weight_version": "default"}
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert key.encode() not in f.read()  # other users can read a command line
        assert httpx.get(running.router + "/workers", timeout=10).status_code == 401
        assert httpx.delete(running.router + "/workers/any", timeout=10).status_code == 401
        with open(f"/proc/{running.router_pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        answer = httpx.post(running.router + "/generate", json=GENERATE, headers=good, timeout=60)
        assert answer.status_code == 200, answer.text
        assert httpx.get(running.router + "/workers", headers=good, timeout=10).status_code == 200


def test_other_users_are_login_accounts_with_a_home_or_other_users_processes(tmp_path):
    from rollout_trio.cli._fleet_key import other_users

    home = tmp_path / "home"
    home.mkdir()
    me = os.getuid()
    passwd = tmp_path / "passwd"
    passwd.write_text(
        f"root:x:0:0::/root:/bin/bash\nme:x:{me}:{me}::/nowhere:/bin/bash\n"
        f"svc:x:{me + 7}:1::/nonexistent:/usr/sbin/nologin\nghost:x:{me + 8}:1::/nonexistent:/bin/bash\n"
    )
    empty = tmp_path / "proc"
    empty.mkdir()
    assert other_users(str(passwd), str(empty)) == []  # no shell, or no home: nobody can log in
    passwd.write_text(passwd.read_text() + f"alice:x:{me + 9}:1::{home}:/bin/bash\n")
    assert other_users(str(passwd), str(empty)) == ["alice"]
    assert other_users(str(tmp_path / "missing"), str(empty)) == [f"(unknown: {tmp_path / 'missing'} unreadable)"]
