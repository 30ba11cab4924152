"""A Ray-placed fleet under load, one node lost mid-run (issue 33), as one process.

    unshare --net sh -c 'ip link set lo up && exec python -m tests.ray_scenario OUT.json'

Run by tests/test_ray_fleet.py inside a network namespace of its own that has only
loopback (Ray binds to the host's address otherwise). It starts a Ray cluster of a head
(no CPUs: the driver and the router) and four one-CPU nodes, then:

1. a fleet of 3 ``rollout-trio serve`` servers (one per node; the fourth node is spare);
2. grouped rollouts through the router while the node of server 1 is removed, with a
   weight update during the loss; every group must be accepted;
3. the lost server's replacement: healthy and registered, on the spare node;
4. ``scale(2)`` then ``scale(3)`` then ``scale(2)``, load between each;
5. leaving the fleet: every server and router process is gone;
6. ``rollout-trio fleet --ray ADDRESS --workers 2``: its lines, its key file, SIGTERM;
7. ``examples/ray_grpo.py``: two trainer ranks as Ray actors on a fleet of two servers; and
   with more ranks than the cluster has CPUs for, its one-line refusal.

It writes what it saw as JSON (the test asserts on it) and exits 0 unless it crashed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import trio

from rollout_trio import GenerationConfig, open_executor
from rollout_trio.engines import RemoteEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflows import rlvr_workflow

DATASET = [{"messages": [{"role": "user", "content": f"What is {a}+2?"}], "answer": a + 2} for a in range(16)]
SERVE = ["--threads", "1", "--seed", "0", "--segment-tokens", "4", "--step-delay", "0.02"]


def processes(pattern: str) -> list[int]:
    """Pids whose command line contains ``pattern``: this scenario's own (it runs in a pid
    namespace of its own, test_ray_fleet.UNSHARE)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if pattern.encode() in f.read().replace(b"\0", b" "):
                        found.append(int(pid))
            except OSError:
                pass
    return found


async def scenario(cluster: Any, nodes: list[Any], out: dict[str, Any]) -> None:
    from rollout_trio.ray import open_ray_fleet

    _, tokenizer = tiny_model()
    workflow = rlvr_workflow(
        tokenizer,
        lambda completion, data: float(completion.strip() == str(data["answer"])),
        GenerationConfig(max_new_tokens=16, ignore_eos=True),
    )
    out["too_small"] = await _error_of(open_ray_fleet(10, server_options=SERVE, startup_timeout=30))
    out["not_installed"] = await _error_of(open_ray_fleet(1, server="vllm", startup_timeout=30))
    out["after_errors_left"] = processes("rollout_trio serve") + processes("sglang_router.launch_router")
    checkpoint = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "checkpoint")
    model, _ = tiny_model()
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    started = time.monotonic()
    async with open_ray_fleet(3, server_options=SERVE, num_cpus=1, health_interval=0.5, startup_timeout=240) as fleet:
        out["startup_s"] = time.monotonic() - started
        out["nodes_at_start"] = sorted({s.node_ip or "" for s in fleet.servers})
        out["pids_at_start"] = [s.pid for s in fleet.servers]
        async with RemoteEngine(router=fleet.router_url, api_key=fleet.api_key, health_interval=0.5) as engine:
            async with open_executor(engine, consumer_batch_size=4, max_head_offpolicyness=1000) as rollout:
                accepted = 0

                async def load(batches: int) -> None:
                    nonlocal accepted
                    for _ in range(batches):
                        batch = await rollout.prepare_batch(DATASET, workflow, batch_size=4, group_size=2)
                        accepted += len(batch)

                await load(2)
                victim = fleet.servers[1]
                victim_node = victim.node_id
                lost_node = next(n for n in nodes if _node_runs(n, victim.pid))
                removed_at = time.monotonic()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(load, 6)
                    await trio.to_thread.run_sync(cluster.remove_node, lost_node)
                    out["removed_node_of_server"] = victim.index
                    await rollout.pause()
                    version = engine.get_version() + 1
                    await engine.update_weights(checkpoint, version=version)
                    rollout.set_version(version)
                    await rollout.resume()
                    out["updated_to"] = version
                with trio.fail_after(240):  # the replacement: a second server for slot 1, up
                    while not (victim.starts >= 2 and victim.up):
                        await trio.sleep(0.1)
                out["loss_to_replacement_s"] = time.monotonic() - removed_at
                out["heal_times_s"] = list(fleet.heal_times)
                out["replacement_on_another_node"] = victim.node_id != victim_node
                out["nodes_in_use"] = len({s.node_id for s in fleet.servers})
                with trio.move_on_after(120):  # the engine brings the replacement to the fleet's version
                    while not (victim.url in _serving(engine, version)):
                        await trio.sleep(0.1)
                out["replacement_serves_version"] = victim.url in _serving(engine, version)
                await load(2)
                sizes = []
                for n in (2, 3, 2):
                    await fleet.scale(n)
                    sizes.append(len(fleet.worker_urls))
                    await load(1)
                out["scaled_sizes"] = sizes
                stats = rollout.statistics()
                out["accepted_trajectories"] = accepted
                out["stats"] = {
                    "accepted": stats.accepted,
                    "rejected": stats.rejected,
                    "failed": stats.failed,
                    "failed_by_reason": dict(stats.failed_by_reason),
                }
                out["engine_version"] = engine.get_version()
        out["server_pids"] = sorted({s.pid for s in fleet.servers if s.pid})


async def _error_of(fleet: Any) -> str:
    """What opening ``fleet`` raised (type and message), within a deadline."""
    with trio.fail_after(120):
        try:
            async with fleet:
                return "opened"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"


def _serving(engine: Any, version: int) -> set[str]:
    """The workers the engine has in service at ``version``."""
    return {s.base_url for s in engine.servers if s.up and s.version == version}


def _node_runs(node: Any, pid: int | None) -> bool:
    """Whether ``pid`` descends from one of ``node``'s Ray processes (its raylet)."""
    from rollout_trio.ray._process import descends_from

    return descends_from(pid or 0, {p.process.pid for p in node.all_processes.get("raylet") or []})


def cli_phase(address: str) -> dict[str, Any]:
    """``rollout-trio fleet --ray``: ready lines, a working key, SIGTERM stops everything."""
    import httpx

    key_file = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "fleet.key")
    command = [sys.executable, "-m", "rollout_trio", "fleet", "--ray", address, "--workers", "2", "--key-file", key_file]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, Any] = {"lines": []}
    try:
        assert child.stdout is not None
        for line in child.stdout:
            seen["lines"].append(line.rstrip())
            if line.startswith("router: "):
                break
        router = seen["lines"][-1].split()[1]
        key = open(key_file).read().strip()
        seen["key_file_mode"] = oct(os.stat(key_file).st_mode & 0o777)
        with httpx.Client(trust_env=False, timeout=10) as client:
            seen["workers_without_key"] = client.get(router + "/workers").status_code
            listed = client.get(router + "/workers", headers={"Authorization": f"Bearer {key}"}).json()["workers"]
            seen["healthy_workers"] = sum(1 for w in listed if w.get("is_healthy"))
            worker = seen["lines"][0].split()[2]
            seen["worker_without_key"] = client.post(worker + "/pause_generation").status_code
        child.send_signal(signal.SIGTERM)
        seen["status"] = child.wait(120)
        seen["stderr_tail"] = child.stderr.read()[-3000:] if child.stderr else ""  # Ray's own lines come last
    finally:
        child.kill()
        child.wait()
    seen["left_running"] = processes("rollout_trio serve") + processes("sglang_router.launch_router")
    return seen


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    out: dict[str, Any] = {}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(4)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False)
        trio.run(scenario, cluster, nodes, out)
        out["left_after_fleet"] = processes("rollout_trio serve") + processes("sglang_router.launch_router")
        out["cli"] = cli_phase(cluster.address)
        example = subprocess.run(
            [sys.executable, "examples/ray_grpo.py", "--address", cluster.address, "--steps", "3"],
            capture_output=True, text=True, timeout=600,
        )
        out["example"] = {"status": example.returncode, "stdout": example.stdout[-3000:], "stderr": example.stderr[-3000:]}
        too_many = subprocess.run(  # 9 ranks x 0.5 CPU and 2 servers on the 3 CPUs left
            [sys.executable, "examples/ray_grpo.py", "--address", cluster.address, "--ranks", "9"],
            capture_output=True, text=True, timeout=120,
        )
        out["example_too_many_ranks"] = {"status": too_many.returncode, "stderr": too_many.stderr[-3000:]}
    finally:
        ray.shutdown()
        cluster.shutdown()
        time.sleep(1.0)
        out["left_running"] = processes("rollout_trio serve") + processes("sglang_router.launch_router")
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
