"""The same RLVR workflow against inference servers: ``rollout-trio serve``, SGLang or vLLM.

What it shows: a workflow never knows which engine it talks to. By default this
starts ``rollout-trio serve`` (the embedded engine behind SGLang's HTTP protocol) as a
subprocess on a free port (``--port 0 --port-file``), points a
:class:`~rollout_trio.engines.RemoteEngine` at it, runs grouped rollouts, pushes a
checkpoint to the server as weight version 1 (``update_weights``), and runs again; the server is stopped when the
block ends. With ``--addresses`` it uses servers you started yourself instead (one or
many, SGLang or vLLM, or routers in front of them); give ``--tokenizer`` the model's
checkpoint directory then.

Run it::

    python examples/remote_servers.py --groups 2 --group-size 4
    python examples/remote_servers.py --addresses 10.0.0.1:30000,10.0.0.2:30000 \\
        --backend sglang --tokenizer /models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from rollout_trio import GenerationConfig, Trajectory, run_group
from rollout_trio.engines import RemoteEngine
from rollout_trio.models import byte_tokenizer, tiny_model
from rollout_trio.workflows import rlvr_workflow


def exact_answer(completion: str, data: Any) -> float:
    return 1.0 if completion.strip() == str(data["answer"]) else 0.0


@contextlib.asynccontextmanager
async def local_server(*, startup_timeout: float = 120.0) -> AsyncIterator[str]:
    """Run ``rollout-trio serve --port 0`` in a subprocess; yield its ``host:port``."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        command = [sys.executable, "-m", "rollout_trio", "serve", "--port", "0", "--port-file", str(port_file), "--seed", "0"]
        async with trio.open_nursery() as nursery:
            # Cancelling run_process terminates the server (then kills it if it lingers).
            process = await nursery.start(
                lambda task_status: trio.run_process(
                    command, stdout=subprocess.DEVNULL, env=os.environ, task_status=task_status
                )
            )
            with trio.fail_after(startup_timeout):
                while not port_file.exists():  # written (atomically) once the server listens
                    if process.returncode is not None:
                        raise RuntimeError(f"rollout-trio serve exited with status {process.returncode}")
                    await trio.sleep(0.05)
            yield f"127.0.0.1:{port_file.read_text().strip()}"
            nursery.cancel_scope.cancel()


async def rollouts(engine: RemoteEngine, tokenizer: Any, groups: int, group_size: int) -> list[Any]:
    workflow = rlvr_workflow(tokenizer, exact_answer, GenerationConfig(max_new_tokens=4, temperature=1.0))
    data = [{"messages": [{"role": "user", "content": f"What is {k}+2?"}], "answer": k + 2} for k in range(groups)]
    results: list[Any] = [None] * groups

    async def one(k: int) -> None:
        results[k] = await run_group(workflow, engine, data[k], group_size)

    async with trio.open_nursery() as nursery:
        for k in range(groups):
            nursery.start_soon(one, k)
    return results


def show(label: str, results: list[Trajectory | None]) -> None:
    for k, traj in enumerate(results):
        if traj is None:
            print(f"{label} group {k}: dropped")
            continue
        assert traj.versions is not None and traj.loss_mask is not None and traj.rewards is not None
        versions = sorted(set(traj.versions[traj.loss_mask.bool()].tolist()))
        print(f"{label} group {k}: {traj.batch_size} rows, rewards {traj.rewards.tolist()}, token versions {versions}")


async def main_async(args: argparse.Namespace) -> None:
    tokenizer = byte_tokenizer()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    async with contextlib.AsyncExitStack() as stack:
        checkpoint = args.checkpoint
        if args.addresses:
            addresses = args.addresses.split(",")
        else:
            addresses = [await stack.enter_async_context(local_server())]
            if checkpoint is None:  # a "trained" checkpoint for the server to load
                checkpoint = stack.enter_context(tempfile.TemporaryDirectory())
                await trio.to_thread.run_sync(save_tiny_checkpoint, checkpoint)
        print(f"servers: {addresses} ({args.backend})")
        engine = await stack.enter_async_context(RemoteEngine(addresses, backend=args.backend))
        show("version 0:", await rollouts(engine, tokenizer, args.groups, args.group_size))
        if checkpoint:
            # Pause every server, reload the checkpoint there, stamp version 1, resume.
            await engine.update_weights(checkpoint, version=1)
            show("version 1:", await rollouts(engine, tokenizer, args.groups, args.group_size))


def save_tiny_checkpoint(path: str) -> None:
    """Save a differently seeded tiny model where a server can load it."""
    model, tokenizer = tiny_model(seed=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--addresses", help="comma-separated host:port of running servers (default: start rollout-trio serve)")
    p.add_argument("--backend", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--tokenizer", help="the served model's checkpoint directory (default: the tiny model's tokenizer)")
    p.add_argument("--checkpoint", help="a checkpoint directory to load on every server between the two rounds")
    args = p.parse_args(argv)
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
