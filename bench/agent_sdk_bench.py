"""An openai-agents agent in process vs in subprocess mode vs a native Trio agent (issue 29).

Each episode is one ``AgentRolloutWorkflow`` episode against the same instant engine
(``bench/agent_bench.py``'s, or one taking ``--engine-ms`` per completion), ``--agents``
at a time, making one completion:

* native Trio: an agent marked ``on_trio`` posting ``/v1/chat/completions`` with the httpx
  client it is handed, in the episode's Trio task: the baseline;
* openai-agents in process: ``Runner.run`` over the Responses API (its default), hosted on
  the asyncio loop in the trainer's process (the default for agents);
* openai-agents in subprocess mode: the same agent, run by ``mode="subproc"`` in a child
  process per episode (on asyncio, as openai-agents needs) that finds the endpoint on
  loopback in ``OPENAI_BASE_URL``
  (``--subproc-workers`` children at a time).

Printed: completions/s of each, medians of interleaved rounds, and each one's ratio to
native Trio in the same round. Subprocess mode runs fewer episodes (``--subproc-episodes``):
its cost per episode is a process.

Run: python bench/agent_sdk_bench.py [--quick] [--episodes E] [--subproc-episodes S] [--agents N] [--rounds R] [--engine-ms MS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_bench import MESSAGES, InstantEngine  # noqa: E402
from rollout_trio import on_trio  # noqa: E402
from rollout_trio.agents import AgentRolloutWorkflow  # noqa: E402

QUESTION = MESSAGES[-1]["content"]


@on_trio
class NativeTrioAgent:
    """What a Trio author writes: one chat completion with the client it is handed."""

    async def run(self, data: Any, **kwargs: Any) -> float:
        client = kwargs["http_client"]
        reply = await client.post(
            "chat/completions",  # relative to its base URL (the endpoint's /v1)
            json={"model": "m", "messages": data["messages"]},
            headers={"Authorization": f"Bearer {kwargs['api_key']}"},
        )
        reply.raise_for_status()
        return float("42" in reply.json()["choices"][0]["message"]["content"])


class OpenAIAgentsAgent:
    """openai-agents as its users write it; in subprocess mode the client reads ``OPENAI_BASE_URL``."""

    async def run(self, data: Any, **kwargs: Any) -> float:
        import openai
        from agents import Agent, OpenAIResponsesModel, RunConfig, Runner

        client = openai.AsyncOpenAI(max_retries=0, **kwargs)
        agent = Agent(name="solver", instructions=data["messages"][0]["content"], model=OpenAIResponsesModel("m", openai_client=client))
        result = await Runner.run(agent, data["messages"][-1]["content"], run_config=RunConfig(tracing_disabled=True))
        return float("42" in result.final_output)


async def episodes_per_second(workflow: AgentRolloutWorkflow, engine: InstantEngine, episodes: int, agents: int) -> float:
    """Completions/s of ``episodes`` episodes, ``agents`` at a time (one completion each)."""
    limiter = trio.CapacityLimiter(agents)

    async def episode() -> None:
        async with limiter:
            result = await workflow.arun_episode(engine, {"messages": MESSAGES})
            assert result is not None and len(result) == 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(episodes):
            nursery.start_soon(episode)
    return episodes / (time.perf_counter() - start)


async def measure(episodes: int, subproc_episodes: int, agents: int, rounds: int, engine_ms: float, subproc_workers: int) -> dict[str, Any]:
    """Medians over ``rounds`` interleaved rounds of each path, and ratios to native Trio."""
    engine = InstantEngine(engine_ms / 1000)
    paths = {
        "native_trio": (AgentRolloutWorkflow(NativeTrioAgent(), tokenizer=engine.tokenizer), episodes),
        "openai_agents_in_process": (AgentRolloutWorkflow(OpenAIAgentsAgent(), tokenizer=engine.tokenizer), episodes),
        "openai_agents_subproc": (
            AgentRolloutWorkflow(OpenAIAgentsAgent(), mode="subproc", subproc_backend="asyncio", subproc_max_workers=subproc_workers,
                                 tokenizer=engine.tokenizer),  # fmt: skip
            subproc_episodes,
        ),
    }
    for wf, _ in paths.values():  # warm-up: imports, templates, the first child
        await episodes_per_second(wf, engine, min(agents, 4), agents)
    rates: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, (wf, n) in paths.items():
            rates[name].append(await episodes_per_second(wf, engine, n, agents))
    out: dict[str, Any] = {name: statistics.median(v) for name, v in rates.items()}
    for name in ("openai_agents_in_process", "openai_agents_subproc"):
        out[f"{name}_ratio"] = statistics.median(a / b for a, b in zip(rates[name], rates["native_trio"], strict=True))
    out["rounds"] = {name: v for name, v in rates.items()}
    return out


def report(r: dict[str, Any]) -> str:
    return (
        f"  native Trio {r['native_trio']:,.0f}  openai-agents in process {r['openai_agents_in_process']:,.0f}"
        f" ({r['openai_agents_in_process_ratio']:.2f}x)  in subprocess mode {r['openai_agents_subproc']:,.1f}"
        f" ({r['openai_agents_subproc_ratio']:.3f}x)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer episodes and rounds")
    p.add_argument("--episodes", type=int, help="in-process episodes per measurement (default 512, quick 128)")
    p.add_argument("--subproc-episodes", type=int, help="subprocess episodes per measurement (default 32, quick 8)")
    p.add_argument("--agents", type=int, default=64, help="episodes at a time (default 64)")
    p.add_argument("--subproc-workers", type=int, default=4, help="child processes at a time (default 4)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 2)")
    p.add_argument("--engine-ms", type=float, default=0.0, help="engine time per completion (default 0: instant)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    args = p.parse_args()
    for flag in ("episodes", "subproc_episodes", "agents", "subproc_workers", "rounds"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    if args.engine_ms < 0:
        p.error(f"--engine-ms: must be >= 0, got {args.engine_ms:g}")
    episodes = args.episodes or (128 if args.quick else 512)
    subproc = args.subproc_episodes or (8 if args.quick else 32)
    rounds = args.rounds or (2 if args.quick else 5)
    print(f"one completion per episode, {args.agents} at a time, engine {args.engine_ms:g} ms; {rounds} interleaved rounds (completions/s)")
    r = trio.run(measure, episodes, subproc, args.agents, rounds, args.engine_ms, args.subproc_workers)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
