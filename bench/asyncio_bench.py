"""asyncio agents inside the Trio run: what each way of hosting them costs (issue 29).

The same agent (``openai.AsyncOpenAI`` with the client it is handed, ``--turns`` chat
completions per episode, a zero sleep between turns) runs as ``--episodes`` episodes,
``--agents`` at a time, through ``AgentRolloutWorkflow`` against an instant engine (or
one taking ``--engine-ms`` per completion), hosted four ways:

* trio: the native baseline, the agent run in the episode's Trio task (``host="trio"``);
* thread: the library's bridge, ``rollout_trio._asyncio``: one asyncio loop in a worker
  thread, requests crossing to Trio as calls of the episode's portal (``host="asyncio"``);
* trio-asyncio (one loop): ``trio_asyncio.open_loop()`` around the whole run, the agent
  run with ``aio_as_trio``, its requests crossing back with ``trio_as_aio``;
* trio-asyncio (loop per episode): the same with a loop opened per episode, which is
  what one needs when nothing outside the workflow opens one (an executor, a CLI run).

Printed: completions/s of each (median of interleaved rounds) and its ratio to trio in
the same round (> 1 is faster than native Trio). trio-asyncio is optional (``pip install
trio-asyncio``); without it only the first two run.

Run: python bench/asyncio_bench.py [--quick] [--agents N] [--turns T] [--episodes E] [--rounds R] [--engine-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_bench import MESSAGES, InstantEngine  # noqa: E402
from rollout_trio.agents import AgentRolloutWorkflow, OpenAIEndpoint  # noqa: E402
from rollout_trio.agents._workflow import _run_agent  # noqa: E402

try:
    import trio_asyncio
except ImportError:  # pragma: no cover - optional
    trio_asyncio = None


class AsyncioAgent:
    """An agent as agent SDK users write it: asyncio inside."""

    def __init__(self, turns: int) -> None:
        self.turns = turns

    async def run(self, data: Any, *, base_url: str, http_client: Any, api_key: str) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        for _ in range(self.turns):
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=32)
            await asyncio.sleep(0)
        return 1.0


class TrioAgent(AsyncioAgent):
    """The same agent written for Trio."""

    async def run(self, data: Any, *, base_url: str, http_client: Any, api_key: str) -> float:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0)
        for _ in range(self.turns):
            await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=32)
            await trio.sleep(0)
        return 1.0


class _TrioAsyncioTransport(httpx.AsyncBaseTransport):
    """asyncio-side transport of the trio-asyncio variant: each request sent in Trio."""

    def __init__(self, trio_transport: httpx.AsyncBaseTransport) -> None:
        self._trio = trio_transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        status, headers, content = await trio_asyncio.trio_as_aio(self._send)(request)
        return httpx.Response(status, headers=headers, content=content, request=request)

    async def _send(self, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        response = await self._trio.handle_async_request(request)
        content = await response.aread()
        return response.status_code, response.headers.raw, content


class TrioAsyncioWorkflow(AgentRolloutWorkflow):
    """``AgentRolloutWorkflow`` with the agent hosted by trio-asyncio instead."""

    def __init__(self, agent: Any, *, loop_per_episode: bool, **kwargs: Any) -> None:
        super().__init__(agent, host="asyncio", **kwargs)
        self.loop_per_episode = loop_per_episode

    async def _run_inline(self, endpoint: OpenAIEndpoint, session: Any, data: Any) -> Any:
        transport = _TrioAsyncioTransport(endpoint.in_process_transport())
        async with AsyncExitStack() as stack:
            if self.loop_per_episode:
                await stack.enter_async_context(trio_asyncio.open_loop())
            return await trio_asyncio.aio_as_trio(_run_agent)(self.agent, data, "httpx", transport, session.key)


async def one_round(workflow: AgentRolloutWorkflow, engine: InstantEngine, episodes: int, agents: int, shared_loop: bool) -> float:
    limiter = trio.CapacityLimiter(agents)

    async def episode() -> None:
        async with limiter:
            result = await workflow.arun_episode(engine, {"messages": MESSAGES})
            assert result is not None and len(result) == workflow.agent.turns

    async with AsyncExitStack() as stack:
        if shared_loop:
            await stack.enter_async_context(trio_asyncio.open_loop())
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(episodes):
                nursery.start_soon(episode)
        elapsed = time.perf_counter() - start
    return episodes * workflow.agent.turns / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, two rounds")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--engine-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    if args.quick:
        args.agents, args.episodes, args.rounds = 16, 32, 2
    engine = InstantEngine(args.engine_ms / 1000)
    cases: dict[str, tuple[AgentRolloutWorkflow, bool]] = {
        "trio (native)": (AgentRolloutWorkflow(TrioAgent(args.turns), host="trio"), False),
        "thread bridge": (AgentRolloutWorkflow(AsyncioAgent(args.turns)), False),
    }
    if trio_asyncio is not None:
        cases["trio-asyncio, one loop"] = (TrioAsyncioWorkflow(AsyncioAgent(args.turns), loop_per_episode=False), True)
        cases["trio-asyncio, loop/episode"] = (TrioAsyncioWorkflow(AsyncioAgent(args.turns), loop_per_episode=True), False)
    rates: dict[str, list[float]] = {name: [] for name in cases}

    async def run() -> None:
        for name, (wf, shared) in cases.items():  # warm-up: templates, caches, the loop thread
            await one_round(wf, engine, min(args.episodes, 8), args.agents, shared)
        for _ in range(args.rounds):
            for name, (wf, shared) in cases.items():
                rates[name].append(await one_round(wf, engine, args.episodes, args.agents, shared))

    trio.run(run)
    base = rates["trio (native)"]
    print(f"agents={args.agents} turns={args.turns} episodes={args.episodes} rounds={args.rounds} engine_ms={args.engine_ms}")
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        print(
            f"  {name:28s} {statistics.median(values):8.0f} completions/s   "
            f"x{statistics.median(ratios):.2f} of trio (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
