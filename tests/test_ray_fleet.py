"""rollout_trio.ray (issue 33): a fleet placed by Ray on a real multi-node cluster.

The cluster test runs tests/ray_scenario.py in a network namespace of its own that has only
loopback (``unshare --net``; and its own pids, ``--pid``): Ray binds to the host's network address even when told
127.0.0.1, and nothing here may send traffic anywhere but loopback. It needs root (as CI
has) and Ray (the test extra installs it); elsewhere it says why it skips.

The process-ownership tests need no cluster: a fleet's server must die with the actor that
started it, and stopping it must reach its whole process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from rollout_trio.ray._process import OwnedProcess, RayFleetError, missing_binary, router_argv, server_argv

from .own_deadline import own_deadline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_server_process_dies_with_the_process_that_owns_it():
    """SIGKILL of the owner (what a lost node or ``ray.kill`` does to an actor) kills its server."""
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import os, sys, time
                from rollout_trio.ray._process import OwnedProcess
                child = OwnedProcess("server 0", [sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
                print(child.pid, flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert _alive(child)
        owner.kill()
        owner.wait()
        assert _wait_gone(child), f"the server (pid {child}) outlived its owner"
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


def test_stop_reaches_the_servers_own_children():
    """A server's children (its process group) stop with it; a SIGTERM-deaf one is killed."""
    script = textwrap.dedent(
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kid = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print(kid.pid, flush=True)
        time.sleep(600)
        """
    )
    owned = OwnedProcess("server 0", [sys.executable, "-c", script], os.environ)
    deadline = time.monotonic() + 60
    kid = None
    while kid is None and time.monotonic() < deadline:
        with open(owned.log_path) as f:
            first = f.readline().strip()
        kid = int(first) if first.isdigit() else None
        time.sleep(0.05)
    assert kid is not None and _alive(kid)
    owned.stop(0.5)
    assert not owned.alive()
    assert _wait_gone(kid), "the server's child survived stop()"
    assert not os.path.exists(owned.log_path)


def test_a_failed_start_names_the_last_thing_the_server_said():
    owned = OwnedProcess("server 3", [sys.executable, "-c", "import sys; print('no such model: /ckpt'); sys.exit(4)"], os.environ)
    owned.process.wait(60)
    assert owned.describe_exit() == "server 3 exited with status 4: no such model: /ckpt"
    owned.stop(1.0)


def test_command_lines_carry_the_key_where_each_server_reads_it():
    """rollout-trio serve reads its key from the environment (not visible in ps); SGLang and
    vLLM take --api-key; the router uses the key with its workers and for its control plane."""
    ours = server_argv("rollout-trio", ["--seed", "0"], "10.1.2.3", 9000, "k")
    assert ours[1:] == ["-m", "rollout_trio", "serve", "--seed", "0", "--host", "10.1.2.3", "--port", "9000"]
    assert server_argv("sglang", [], "h", 1, "-k")[-1] == "--api-key=-k"  # a key may start with "-"
    assert server_argv("vllm", ["m"], "h", 1, None) == ["vllm", "serve", "m", "--host", "h", "--port", "1"]
    router = router_argv([], "h", 2, 3, ["http://h:1"], "-k")
    assert "--api-key=-k" in router
    assert any(a.startswith("--control-plane-api-keys=") and a.endswith(":admin:-k") for a in router)
    with pytest.raises(ValueError, match="server kind: must be one of rollout-trio, sglang, vllm, got 'tgi'"):
        server_argv("tgi", [], "h", 1, None)


def test_missing_binary_names_what_is_missing():
    assert missing_binary("rollout-trio") is None
    if not any(os.access(os.path.join(d, "vllm"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        assert missing_binary("vllm") == "the vllm command"


async def test_open_ray_fleet_refuses_bad_arguments_before_touching_ray():
    from rollout_trio.ray import open_ray_fleet

    for kwargs, message in [
        ({"servers": 0}, "servers: must be at least 1, got 0"),
        ({"servers": 1, "server": "tgi"}, "server: must be one of"),
        ({"servers": 1, "num_cpus": -1}, "num_cpus: must be a finite number >= 0"),
        ({"servers": 1, "num_cpus": 0}, "a server must reserve something"),
        ({"servers": 1, "health_interval": 0}, "health_interval: must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            async with open_ray_fleet(**kwargs):
                pass
    assert isinstance(RayFleetError("x"), RuntimeError)


def _namespace_unavailable() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install -e '.[ray]')"
    if os.geteuid() != 0:
        return "needs root for a loopback-only network namespace (unshare --net)"
    probe = subprocess.run([*UNSHARE, "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --net failed here: {probe.stderr.strip()[:200]}"
    return None


# A network namespace with only loopback, and a pid namespace of its own, so that the
# scenario's count of servers left running sees only its own processes (the other tests, on
# other xdist workers, start servers of the same name).
UNSHARE = ["unshare", "--net", "--pid", "--fork", "--mount-proc"]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, pytestconfig):
    """tests/ray_scenario.py's findings: a 4-node cluster, 3 servers, a node lost under load."""
    why = _namespace_unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("ray") / "out.json"
    command = f"ip link set lo up && exec {sys.executable} -m tests.ray_scenario {out}"
    with own_deadline(pytestconfig):  # the run's own timeout below
        run = subprocess.run(
            [*UNSHARE, "sh", "-c", command],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT, RAY_USAGE_STATS_ENABLED="0"),
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert run.returncode == 0, f"the scenario crashed:\n{run.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_node_lost_under_load_loses_no_group_and_is_replaced_elsewhere(scenario):
    """3 servers on 3 nodes; the node of server 1 is removed mid-run with a weight update
    during the loss: every group is accepted, the replacement starts on the spare node and
    serves the fleet's new version."""
    assert len(set(scenario["pids_at_start"])) == 3
    assert scenario["stats"]["failed"] == 0 and scenario["stats"]["rejected"] == 0, scenario["stats"]
    assert scenario["stats"]["accepted"] == scenario["accepted_trajectories"] == 13 * 4  # 13 batches of 4
    assert scenario["updated_to"] == scenario["engine_version"] == 1
    assert scenario["replacement_on_another_node"] is True
    assert scenario["nodes_in_use"] == 3
    assert scenario["replacement_serves_version"] is True
    assert len(scenario["heal_times_s"]) == 1


@pytest.mark.slow
def test_scale_adds_and_drains_servers(scenario):
    assert scenario["scaled_sizes"] == [2, 3, 2]


@pytest.mark.slow
def test_a_cluster_too_small_or_a_missing_binary_is_a_typed_error_at_once(scenario):
    assert scenario["too_small"].startswith("RayFleetError: the cluster is too small for 10 servers: needs 10 CPU")
    assert "the cluster has 4)" in scenario["too_small"]
    assert scenario["not_installed"].startswith("RayFleetError: server 0 on node 127.0.0.1")
    assert scenario["not_installed"].endswith("the vllm command is not installed there")
    assert scenario["after_errors_left"] == []


@pytest.mark.slow
def test_leaving_the_fleet_leaves_no_server_or_router_running(scenario):
    assert scenario["left_running"] == []
    assert all(not _alive(pid) for pid in scenario["server_pids"])


@pytest.mark.slow
def test_fleet_cli_on_ray_prints_its_lines_guards_every_server_and_stops_on_sigterm(scenario):
    """``rollout-trio fleet --ray ADDRESS``: the local fleet's lines, a 0600 key file whose
    key the router and every worker require, and SIGTERM stopping everything (exit 0)."""
    cli = scenario["cli"]
    assert [line.split(":")[0] for line in cli["lines"]] == ["worker 0", "worker 1", "router"]
    assert cli["key_file_mode"] == "0o600"
    assert cli["workers_without_key"] == 401 and cli["worker_without_key"] == 401
    assert cli["healthy_workers"] == 2
    assert cli["status"] == 0, cli["stderr_tail"]
    assert "terminated; stopped the router and 2 workers on Ray" in cli["stderr_tail"]
    assert cli["left_running"] == []


@pytest.mark.slow
def test_two_trainer_ranks_as_ray_actors_publish_and_adopt_every_version(scenario):
    """examples/ray_grpo.py: two ranks (Ray actors) on a Ray-placed fleet; rank 0 publishes
    3 versions through a shared directory, both ranks end on version 3 with nothing lost."""
    example = scenario["example"]
    assert example["status"] == 0, example["stderr"]
    ranks = json.loads(example["stdout"].strip().splitlines()[-1])["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["version"] == 3 and r["steps"] == 3 and len(r["rewards"]) == 3
        assert r["failed"] == 0 and r["rejected"] == 0 and r["accepted"] == 12
    assert scenario["left_running"] == []


@pytest.mark.slow
def test_the_ray_example_refuses_more_ranks_than_the_cluster_can_place(scenario):
    """Ranks Ray cannot place would wait forever: the example says so at once and exits 1."""
    refused = scenario["example_too_many_ranks"]
    assert refused["status"] == 1, refused["stderr"]
    last = refused["stderr"].strip().splitlines()[-1]
    # 3 of the 4 one-CPU nodes are left: the scenario removed one.
    assert last == "ray_grpo: the cluster has 3 CPU; 2 servers x 1 and 9 ranks x 0.5 need 6.5", refused["stderr"]
