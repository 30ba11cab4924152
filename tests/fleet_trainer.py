"""One trainer rank on a shared fleet (issue 16 item 3), run as ``python -m tests.fleet_trainer``.

    python -m tests.fleet_trainer ROUTER RANK --updates N [--checkpoint DIR]

Each rank opens a ``RemoteEngine`` on the router and an executor with ``dp_size=2``, and
takes batches once the test says ``start`` on its stdin (after every rank printed
``ready``). Rank 0 publishes weights after each batch (``update_weights`` on every
worker) and prints ``updated V``; the other rank learns V on its stdin (``version V``:
what a trainer's own broadcast would carry) and adopts it with ``set_version``, with its
requests in flight all along. Each prints ``ready V`` once open, ``adopted V``, and one
JSON line of results at the end; a failed or rejected task makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys

import trio

from rollout_trio import GenerationConfig, open_executor
from rollout_trio.engines import RemoteEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflows import rlvr_workflow

DATASET = [{"messages": [{"role": "user", "content": f"What is {a}+2?"}], "answer": a + 2} for a in range(16)]


def say(text: str) -> None:
    print(text, flush=True)


async def rank_main(args: argparse.Namespace) -> int:
    _, tokenizer = tiny_model()
    workflow = rlvr_workflow(
        tokenizer, lambda completion, data: float(completion.strip() == str(data["answer"])),
        GenerationConfig(max_new_tokens=24, ignore_eos=True),
    )
    seen: set[int] = set()
    async with RemoteEngine(router=args.router) as engine, open_executor(
        engine, dp_size=2, consumer_batch_size=8, max_head_offpolicyness=args.updates + 1
    ) as rollout:
        start = engine.get_version()
        say(f"ready {start}")
        target = start + args.updates
        adopted = trio.Event()

        go = trio.Event()

        async def listen() -> None:  # "start" from the test; then the other ranks' broadcast of the published version
            stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
            buffer = b""
            while chunk := await stdin.receive_some():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip() == b"start":
                        go.set()
                        continue
                    version = int(line.split()[1])
                    rollout.set_version(version)
                    say(f"adopted {version}")
                    if version >= target:
                        adopted.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            await go.wait()  # every rank is open (and has read the fleet's version) before rank 0 updates
            batches, after = 0, 0
            while True:
                batch = await rollout.prepare_batch(DATASET, workflow, batch_size=4, group_size=2)
                batches += 1
                for traj in batch:
                    seen.update(v for v in traj.versions.flatten().tolist() if v >= 0)
                if args.rank == 0:
                    if engine.get_version() >= target:
                        break
                    await rollout.pause()
                    version = engine.get_version() + 1
                    await engine.update_weights(args.checkpoint, version=version)
                    rollout.set_version(version)
                    await rollout.resume()
                    say(f"updated {version}")
                elif adopted.is_set():  # until its requests ran on the published weights (bounded), two batches at least
                    after += 1
                    if (target in seen and batches >= 2) or after >= 5:
                        break
            nursery.cancel_scope.cancel()
        stats = rollout.statistics()
        say(json.dumps({
            "rank": args.rank, "batches": batches, "accepted": stats.accepted, "failed": stats.failed,
            "rejected": stats.rejected, "failed_by_reason": dict(stats.failed_by_reason), "versions_seen": sorted(seen), "engine_version": engine.get_version(),
        }))
        return 1 if stats.failed or stats.rejected else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("router")
    p.add_argument("rank", type=int)
    p.add_argument("--updates", type=int, default=2, help="weight updates rank 0 publishes (the others adopt)")
    p.add_argument("--checkpoint", default=None)
    return trio.run(rank_main, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
