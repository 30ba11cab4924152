"""Chat completions per second through the agent endpoint vs calling the engine directly.

64 agents run concurrently, each making ``--turns`` chat completions in its own session.
Every path does the same work per completion (chat template, an engine call answering
``OUT_TOKENS`` tokens, decoding) against an instant engine, so the figures measure what
the HTTP layer costs:

* direct: the endpoint's chat template, ``engine.agenerate``, decode, no HTTP;
* in-process client: POST /v1/chat/completions with ``OpenAIEndpoint.in_process_client()``
  (an ``httpx.AsyncClient`` on ``InProcessTransport``: no socket, no ASGI messages), the
  client inline agents get;
* in-process openai: the same through ``openai.AsyncOpenAI`` (what agents use);
* in-process httpx + ASGITransport: a plain ``httpx.AsyncClient`` on
  ``httpx.ASGITransport(app=endpoint.app)``, the path before ``InProcessTransport``;
* client alone: the same requests, with the same client, to an app answering a fixed body
  at once, i.e. what the client and its transport cost with no endpoint behind them.
  An in-process completion costs at least that plus a direct one, so
  ``1 / (1 + direct/alone)`` is the best ratio any endpoint could reach (printed);
* loopback: the same app served by Hypercorn's Trio worker on 127.0.0.1, with httpx's
  default pool and with the project's ``TrioTransport``.

With ``--engine-ms`` the engine takes that long per completion (a real server's
decode time), which shows what the HTTP layer costs when generation is not free.

Run: python bench/agent_bench.py [--quick] [--agents N] [--turns T] [--repeats R] [--engine-ms MS]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import openai
import trio

from rollout_trio import GenerationConfig, ModelRequest, ModelResponse
from rollout_trio._http import HTTPApp, InProcessClient, Request, Response, ServerLimits
from rollout_trio.agents import OpenAIEndpoint, serve_app
from rollout_trio.agents._schema import ChatMessage
from rollout_trio.agents._template import ChatTemplate
from rollout_trio.engines._transport import TrioTransport
from rollout_trio.models import byte_tokenizer

TOKENIZER = byte_tokenizer()
ANSWER = [*TOKENIZER.encode("The answer is 42, because 6 times 7 is 42.", add_special_tokens=False)][:31] + [
    TOKENIZER.convert_tokens_to_ids("<|im_end|>")
]
OUT_TOKENS = len(ANSWER)
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 6 times 7? Explain briefly."},
]


class InstantEngine:
    """Answers with ``OUT_TOKENS`` tokens at once (one checkpoint), or after ``latency`` s."""

    tokenizer = TOKENIZER

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await trio.sleep(self.latency) if self.latency else await trio.lowlevel.checkpoint()
        n = min(OUT_TOKENS, req.gconfig.max_new_tokens)
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=ANSWER[:n],
            output_logprobs=[-0.5] * n,
            output_versions=[0] * n,
            stop_reason="stop",
        )

    def get_version(self) -> int:
        return 0


Agent = Callable[[int], Awaitable[None]]

_FIXED = b'{"id":"chatcmpl-0","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"42"}}]}'


async def fixed_answer_app(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
) -> None:
    """An ASGI app that reads the body and answers a fixed completion: the client's own cost."""
    while (await receive()).get("more_body"):
        pass
    await trio.lowlevel.checkpoint()  # as the engine call does
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_FIXED)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": _FIXED})


async def _fixed_answer(request: Request) -> Response:
    await request.body()
    await trio.lowlevel.checkpoint()  # as the engine call does
    return Response(200, _FIXED)


#: The same fixed answer as an HTTPApp, for the in-process client's own cost.
fixed_answer_http_app = HTTPApp(
    {("POST", "/v1/chat/completions"): _fixed_answer}, limits=ServerLimits(), error_body=lambda status, message: b"{}"
)


def fixed_answer_client() -> InProcessClient:
    """The client inline agents get, on an app answering a fixed body at once: its own cost."""
    return InProcessClient(fixed_answer_http_app, base_url="http://agent/v1/")


async def run_agents(agents: int, agent: Agent) -> None:
    async with trio.open_nursery() as nursery:
        for i in range(agents):
            nursery.start_soon(agent, i)


def direct(engine: InstantEngine, turns: int) -> Agent:
    gconfig = GenerationConfig(max_new_tokens=OUT_TOKENS).with_stop_and_pad_token_ids(TOKENIZER)
    template = ChatTemplate(TOKENIZER)  # the endpoint's templating, so both sides do the same work
    messages = tuple(ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES)  # type: ignore[arg-type]

    async def agent(i: int) -> None:
        for _ in range(turns):
            ids = await template.aprompt_ids(messages, ())
            resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig, tokenizer=TOKENIZER))
            TOKENIZER.decode(resp.output_tokens, skip_special_tokens=True)

    return agent


def via_httpx(endpoint: OpenAIEndpoint, turns: int, client: httpx.AsyncClient) -> Agent:
    async def agent(i: int) -> None:
        with endpoint.session() as s:
            headers = {"authorization": f"Bearer {s.key}"}
            for _ in range(turns):
                r = await client.post("chat/completions", json={"messages": MESSAGES, "max_tokens": OUT_TOKENS}, headers=headers)
                r.raise_for_status()

    return agent


def via_openai(endpoint: OpenAIEndpoint, turns: int, client: httpx.AsyncClient) -> Agent:
    async def agent(i: int) -> None:
        with endpoint.session() as s:
            sdk = openai.AsyncOpenAI(base_url=client.base_url, api_key=s.key, http_client=client, max_retries=0)
            for _ in range(turns):
                await sdk.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=OUT_TOKENS)  # type: ignore[arg-type]

    return agent


async def measure(agent: Agent, agents: int, turns: int, repeats: int) -> float:
    await run_agents(agents, agent)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        await run_agents(agents, agent)
        rates.append(agents * turns / (time.perf_counter() - start))
    return statistics.median(rates)


async def main(args: argparse.Namespace) -> None:
    engine = InstantEngine(args.engine_ms / 1000)
    endpoint = OpenAIEndpoint(engine)  # type: ignore[arg-type]
    n, t, r = args.agents, args.turns, args.repeats
    # One client per path (its connection pool shared by the agents), built outside the timing.
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    results: dict[str, float] = {}
    results["direct (template + agenerate + decode)"] = await measure(direct(engine, t), n, t, r)
    async with endpoint.in_process_client() as client:  # what AgentRolloutWorkflow hands inline agents
        results["in-process client"] = await measure(via_httpx(endpoint, t, client), n, t, r)
        results["in-process openai SDK"] = await measure(via_openai(endpoint, t, client), n, t, r)
    async with fixed_answer_client() as client:
        results["in-process client alone (fixed answer)"] = await measure(via_httpx(endpoint, t, client), n, t, r)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=endpoint.app), base_url="http://agent/v1/", timeout=60) as client:
        results["in-process httpx + ASGITransport"] = await measure(via_httpx(endpoint, t, client), n, t, r)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fixed_answer_app), base_url="http://agent/v1/", timeout=60) as client:
        results["httpx + ASGITransport alone (fixed answer)"] = await measure(via_httpx(endpoint, t, client), n, t, r)
    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_app, endpoint.app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"{base}/v1/", limits=limits, timeout=60) as client:
            results["loopback httpx (httpcore pool)"] = await measure(via_httpx(endpoint, t, client), n, t, r)
        # The project's own O(1)-pool client transport (httpcore's pool rescans every
        # connection on every event, which dominates at 64 connections).
        async with httpx.AsyncClient(transport=TrioTransport(), base_url=f"{base}/v1/", timeout=60) as client:
            results["loopback httpx (TrioTransport)"] = await measure(via_httpx(endpoint, t, client), n, t, r)
            results["loopback openai SDK (TrioTransport)"] = await measure(via_openai(endpoint, t, client), n, t, r)
        nursery.cancel_scope.cancel()
    baseline = results["direct (template + agenerate + decode)"]
    kind = f"an engine taking {args.engine_ms} ms per completion" if args.engine_ms else "an instant engine"
    print(f"{n} concurrent agents x {t} completions, {OUT_TOKENS} output tokens each, {kind}, median of {r}")
    print(f"{'path':<40} {'completions/s':>14} {'vs direct':>10}")
    for name, rate in results.items():
        print(f"{name:<40} {rate:>14.0f} {rate / baseline:>9.2f}x")
    alone = results["in-process client alone (fixed answer)"]
    print(f"best in-process ratio the in-process client allows: 1 / (1 + direct/alone) = {1 / (1 + baseline / alone):.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engine-ms", type=float, default=0.0, help="engine latency per completion (default 0: instant)")
    p.add_argument("--quick", action="store_true", help="2 repeats of 2 turns (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.turns, a.repeats = 2, 2
    trio.run(main, a)
