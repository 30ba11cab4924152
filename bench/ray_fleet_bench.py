"""The fleet on Ray against the fleet on one machine: start-up, requests/s, healing, weight transport.

    python bench/ray_fleet_bench.py [--quick] [--servers 4] [--rounds 3] [--seconds 3]
                                    [--concurrency 32] [--params 500000000]

Runs itself inside a network namespace of its own with only loopback (``unshare --net``,
as root), since Ray binds to the host's address otherwise. In one process, on a Ray
cluster of ``--servers + 1`` one-CPU nodes (``ray.cluster_utils.Cluster``; its own start-up
is printed but not compared):

1. start-up: ``open_ray_fleet(servers)`` to its yield, against ``rollout-trio fleet
   --workers servers`` to its ``router:`` line (the same ``rollout-trio serve`` workers);
2. requests/s through each fleet's router (``RemoteEngine(router=...)``), alternating
   rounds of ``--seconds`` with ``--concurrency`` requests in flight; medians and ratio;
3. healing: the node of one Ray server removed; seconds until its replacement is healthy
   and registered (from the removal, and from the supervisor noticing);
4. weight transport for a ``--params``-parameter bf16 state dict (0.5B: 1 GB): Ray's
   object store (``ray.put`` here, ``ray.get`` in an actor) against a shared directory
   (``torch.save`` here, ``torch.load`` in the actor).

``--quick``: 2 servers, one short round, a 25M-parameter state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FULL = {"servers": 4, "rounds": 3, "seconds": 3.0, "concurrency": 32, "params": 500_000_000}
QUICK = {"servers": 2, "rounds": 1, "seconds": 1.0, "concurrency": 16, "params": 25_000_000}
SERVE = ["--threads", "1", "--seed", "0"]
_IN_NAMESPACE = "ROLLOUT_TRIO_BENCH_NETNS"


async def throughput(router: str, api_key: str | None, seconds: float, concurrency: int) -> float:
    """Requests/s through ``router`` for ``seconds`` with ``concurrency`` in flight."""
    import trio

    from rollout_trio import GenerationConfig, ModelRequest
    from rollout_trio.engines import RemoteEngine

    gconfig = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    count = 0
    async with RemoteEngine(router=router, api_key=api_key) as engine:
        await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig))
        end = trio.current_time() + seconds

        async def worker() -> None:
            nonlocal count
            while trio.current_time() < end:
                await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig))
                count += 1

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        return count / (time.perf_counter() - start)


class Loader:
    """An actor on another node that receives a state dict one way or the other."""

    def ready(self) -> bool:
        return True

    def from_store(self, refs: list[Any]) -> float:
        import ray

        started = time.perf_counter()
        state = ray.get(refs[0])
        assert state
        return time.perf_counter() - started

    def from_path(self, path: str) -> float:
        import torch

        started = time.perf_counter()
        state = torch.load(path, mmap=False, weights_only=True)
        assert state
        return time.perf_counter() - started


def transport(params: int, workdir: str) -> dict[str, float]:
    """Seconds to move a bf16 state dict of ``params`` parameters to another node's actor."""
    import ray
    import torch

    state = {f"layer{i}": torch.zeros(params // 8, dtype=torch.bfloat16) for i in range(8)}
    loader: Any = ray.remote(Loader).options(num_cpus=1).remote()
    out: dict[str, float] = {"gigabytes": params * 2 / 1e9}
    ray.get(loader.ready.remote())  # its process started: not part of either way's time
    started = time.perf_counter()
    ref = ray.put(state)
    out["store_put_s"] = time.perf_counter() - started
    out["store_get_s"] = ray.get(loader.from_store.remote([ref]))
    path = os.path.join(workdir, "state.pt")
    started = time.perf_counter()
    torch.save(state, path)
    out["dir_save_s"] = time.perf_counter() - started
    out["dir_load_s"] = ray.get(loader.from_path.remote(path))
    ray.kill(loader)
    return out


async def ray_part(cluster: Any, nodes: list[Any], cfg: dict[str, Any], out: dict[str, Any]) -> None:
    import trio

    from rollout_trio.ray import open_ray_fleet

    started = time.perf_counter()
    async with open_ray_fleet(cfg["servers"], server_options=SERVE, num_cpus=1, health_interval=0.5) as fleet:
        out["ray_startup_s"] = time.perf_counter() - started
        out["ray_rps"] = [
            await throughput(fleet.router_url, fleet.api_key, cfg["seconds"], cfg["concurrency"]) for _ in range(cfg["rounds"])
        ]
        victim = fleet.servers[0]
        from rollout_trio.ray._process import descends_from

        node = next(n for n in nodes if descends_from(victim.pid or 0, {p.process.pid for p in n.all_processes.get("raylet", [])}))
        removed = time.monotonic()
        await trio.to_thread.run_sync(cluster.remove_node, node)
        with trio.fail_after(300):
            while not (victim.starts >= 2 and victim.up):
                await trio.sleep(0.05)
        out["heal_from_loss_s"] = time.monotonic() - removed
        out["heal_from_notice_s"] = fleet.heal_times[-1]


def local_part(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    import trio

    from bench.fleet_bench import Fleet

    fleet = Fleet(cfg["servers"])
    try:
        out["local_startup_s"] = fleet.startup_s
        out["local_rps"] = [
            trio.run(throughput, fleet.router, None, cfg["seconds"], cfg["concurrency"]) for _ in range(cfg["rounds"])
        ]
    finally:
        fleet.stop()


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    import ray
    import trio
    from ray.cluster_utils import Cluster

    out: dict[str, Any] = {"config": cfg}
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(cfg["servers"] + 1)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        out["cluster_startup_s"] = time.perf_counter() - started
        local_part(cfg, out)  # first: the Ray part removes a node
        trio.run(ray_part, cluster, nodes, cfg, out)
        with tempfile.TemporaryDirectory() as workdir:
            out["transport"] = transport(cfg["params"], workdir)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def report(out: dict[str, Any]) -> None:
    ray_rps, local_rps = statistics.median(out["ray_rps"]), statistics.median(out["local_rps"])
    t = out["transport"]
    print(f"ray cluster of {out['config']['servers'] + 1} nodes up in {out['cluster_startup_s']:.1f} s (not compared)")
    print(f"start-up, {out['config']['servers']} servers: Ray {out['ray_startup_s']:.1f} s, "
          f"rollout-trio fleet {out['local_startup_s']:.1f} s (ratio {out['ray_startup_s'] / out['local_startup_s']:.2f}x)")
    print(f"requests/s through the router: Ray {ray_rps:.0f}, local {local_rps:.0f} (ratio {ray_rps / local_rps:.2f}x, "
          f"medians of {len(out['ray_rps'])} rounds)")
    print(f"healing after a node loss: {out['heal_from_loss_s']:.1f} s from the removal "
          f"({out['heal_from_notice_s']:.1f} s from the supervisor noticing)")
    print(f"weights, {t['gigabytes']:.2f} GB bf16: object store put {t['store_put_s']:.2f} s + get {t['store_get_s']:.2f} s; "
          f"shared directory save {t['dir_save_s']:.2f} s + load {t['dir_load_s']:.2f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--json", default=None, help="also write the figures here")
    for name, value in FULL.items():
        p.add_argument(f"--{name}", type=type(value), default=None, help=f"(full run: {value})")
    args = p.parse_args()
    if os.environ.get(_IN_NAMESPACE) != "1":  # Ray must see only loopback: run again inside a namespace
        command = " ".join(["ip link set lo up && exec", sys.executable, *map(_quote, sys.argv)])
        env = dict(os.environ, **{_IN_NAMESPACE: "1"}, PYTHONPATH=ROOT, RAY_USAGE_STATS_ENABLED="0")
        return subprocess.run(["unshare", "--net", "sh", "-c", command], env=env).returncode
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else (QUICK if args.quick else FULL)[k]) for k in FULL}
    out = measure(cfg)
    report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)


if __name__ == "__main__":
    sys.exit(main())
