"""Data-parallel GRPO with the trainer ranks and the inference servers placed by Ray.

What it shows:

* :func:`rollout_trio.ray.open_ray_fleet` starts ``--servers`` inference servers as Ray
  actors (one placement group each) with sglang-router in front, and keeps them running;
* ``--ranks`` trainer ranks are Ray actors too; each runs its own ``trio.run`` with a
  ``RemoteEngine`` on the shared router and ``open_executor(engine, dp_size=ranks)``, which
  gives each rank its share of the concurrency and of the batch;
* the ranks form a ``torch.distributed`` group (gloo) and average their gradients, so every
  rank holds the same weights after each step;
* rank 0 publishes each version as docs/fleet.md describes: it saves the weights under
  ``--shared-dir`` (a directory every node can read: NFS, a shared volume; here a local
  directory, since every node is this machine), calls ``engine.update_weights(path,
  version=v)``, which pauses, reloads and relabels every server with requests in flight,
  and broadcasts ``v``; every rank then calls ``set_version(v)``.

Weights travel by the shared directory, not Ray's object store: the servers load a
checkpoint from a path (``/update_weights_from_disk``), and a path is what SGLang and
vLLM servers take too; ``bench/ray_fleet_bench.py`` measures the object store's put/get of
a 0.5B-sized state dict beside the directory's save/load for comparison.

Run it on a running cluster (``--address``, after ``ray start --head``), or alone (a local
Ray instance, counted as this machine's cores or what the servers and ranks reserve if that
is more)::

    python examples/ray_grpo.py --servers 2 --ranks 2 --steps 4 --shared-dir /tmp/ray_grpo

It prints one line per step and, last, one JSON line with what each rank saw.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from typing import Any

import trio

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


class TrainerRank:
    """One data-parallel rank: rollouts from the shared fleet, a GRPO step, gradients averaged."""

    def __init__(self, rank: int, ranks: int, master: str, router: str, api_key: str | None, shared_dir: str) -> None:
        self.rank, self.ranks, self.master = rank, ranks, master
        self.router, self.api_key, self.shared_dir = router, api_key, shared_dir

    def run(self, steps: int, groups_per_rank: int, group_size: int, seed: int) -> dict[str, Any]:
        return trio.run(self._main, steps, groups_per_rank, group_size, seed)

    async def _main(self, steps: int, groups_per_rank: int, group_size: int, seed: int) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        sys.path.insert(0, EXAMPLES)
        from train_grpo import Trainer

        from rollout_trio import GenerationConfig, concat_trajectories, open_executor
        from rollout_trio.engines import RemoteEngine
        from rollout_trio.models import tiny_model
        from rollout_trio.workflows import arithmetic_prompts, arithmetic_reward, rlvr_workflow

        dist.init_process_group("gloo", init_method=f"tcp://{self.master}", rank=self.rank, world_size=self.ranks)
        torch.manual_seed(seed)
        model, tokenizer = tiny_model()  # what every `rollout-trio serve` starts with
        trainer = Trainer(model, lr=1e-3)
        workflow = rlvr_workflow(tokenizer, arithmetic_reward, GenerationConfig(max_new_tokens=3, temperature=1.0))
        prompts = arithmetic_prompts(256, seed=seed + self.rank)
        rewards: list[float] = []
        async with RemoteEngine(router=self.router, api_key=self.api_key, health_interval=1.0) as engine:
            async with open_executor(
                engine, dp_size=self.ranks, consumer_batch_size=groups_per_rank * self.ranks, max_head_offpolicyness=1
            ) as rollout:
                for step in range(steps):
                    groups = await rollout.prepare_batch(
                        prompts, workflow, batch_size=groups_per_rank, group_size=group_size, reward_normalization=True
                    )
                    batch = concat_trajectories(groups)
                    assert batch.original_rewards is not None
                    rewards.append(float(batch.original_rewards.mean()))
                    await trio.to_thread.run_sync(self._step, trainer, batch, dist)
                    version = torch.tensor([engine.get_version() + 1])
                    if self.rank == 0:
                        path = os.path.join(self.shared_dir, f"v{int(version)}")
                        await trio.to_thread.run_sync(self._save, trainer, tokenizer, path)
                        await engine.update_weights(path, version=int(version))
                    await trio.to_thread.run_sync(dist.broadcast, version, 0)  # the trainer's own channel
                    rollout.set_version(int(version))
                    if self.rank == 0:
                        print(f"step {step}: version {int(version)} published; rank 0 mean reward {rewards[-1]:.3f}", flush=True)
                stats = rollout.statistics()
        dist.destroy_process_group()
        return {
            "rank": self.rank,
            "steps": steps,
            "rewards": rewards,
            "accepted": stats.accepted,
            "failed": stats.failed,
            "rejected": stats.rejected,
            "version": int(version),
        }

    @staticmethod
    def _step(trainer: Any, batch: Any, dist: Any) -> None:
        """One GRPO step with gradients averaged over the ranks (blocking: run in a thread)."""
        import torch

        from train_grpo import grpo_loss

        trainer.optimizer.zero_grad(set_to_none=True)
        loss, _ = grpo_loss(trainer.model, batch)
        loss.backward()
        for p in trainer.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        trainer.optimizer.step()

    @staticmethod
    def _save(trainer: Any, tokenizer: Any, path: str) -> None:
        trainer.model.save_pretrained(path)
        tokenizer.save_pretrained(path)


def _start_ray(address: str | None, needed: float) -> float:
    """Join the cluster at ``address``, or start a local one with ``needed`` CPUs at least
    (Ray's CPUs count reservations, not cores: a 2-core machine would otherwise place the 2
    servers and leave the ranks pending forever). Returns the cluster's CPUs. Blocking."""
    import ray

    if address is None:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needed)), include_dashboard=False)
    else:
        ray.init(address=address, include_dashboard=False)
    return float(ray.cluster_resources().get("CPU", 0.0))


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Open the fleet, start the ranks, wait for their results."""
    import ray

    from rollout_trio.ray import open_ray_fleet
    from rollout_trio.ray._process import free_port

    needed = args.servers * args.server_cpus + args.ranks * args.rank_cpus
    total = await trio.to_thread.run_sync(_start_ray, args.address, needed)
    if total < needed:  # the ranks would never be placed: say so now, not never
        raise SystemExit(
            f"ray_grpo: the cluster has {total:g} CPU; {args.servers} servers x {args.server_cpus:g} and "
            f"{args.ranks} ranks x {args.rank_cpus:g} need {needed:g}"
        )
    serve = ["--threads", "1", "--seed", str(args.seed)]
    async with open_ray_fleet(args.servers, server_options=serve, num_cpus=args.server_cpus) as fleet:
        master = f"{ray.util.get_node_ip_address()}:{free_port(ray.util.get_node_ip_address())}"
        remote_rank: Any = ray.remote(TrainerRank)
        ranks = [
            remote_rank.options(num_cpus=args.rank_cpus).remote(
                r, args.ranks, master, fleet.router_url, fleet.api_key, args.shared_dir
            )
            for r in range(args.ranks)
        ]
        refs = [rank.run.remote(args.steps, args.groups_per_rank, args.group_size, args.seed) for rank in ranks]
        results: list[dict[str, Any]] = await trio.to_thread.run_sync(ray.get, refs, abandon_on_cancel=True)
        for rank in ranks:
            ray.kill(rank)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="the Ray cluster to join (default: start a local one)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups-per-rank", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--server-cpus", type=float, default=1.0)
    p.add_argument("--rank-cpus", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-dir", default=None, help="a directory every node can read (default: a new temporary one)")
    args = p.parse_args(argv)
    args.shared_dir = args.shared_dir or tempfile.mkdtemp(prefix="ray_grpo-")
    results = trio.run(run, args)
    print(json.dumps({"ranks": results}), flush=True)
    return 0 if all(r["failed"] == 0 and r["rejected"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
