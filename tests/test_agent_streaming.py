"""``stream=true`` on chat completions, responses and messages: the SDKs' streaming clients,
interactions identical to unstreamed runs of the same seeded episode, abandoned streams abort."""

import anthropic
import httpx
import httpx2
import openai
import pytest
import trio

from rollout_trio.agents import OpenAIEndpoint, serve_app
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.testing import ScriptedEngine

from .agent_helpers import TOKENIZER, texts_engine

USER = [{"role": "user", "content": "What is 2+3?"}]
# openai's AsyncStream stops at [DONE] leaving its inner async generators for the collector,
# which Trio (not asyncio) reports as ResourceWarnings: the SDK's, not the endpoint's.
SDK_STREAM_LEFTOVERS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def oai(ep, key):
    return openai.AsyncOpenAI(api_key=key, base_url="http://agent/v1/", max_retries=0,
                              http_client=httpx.AsyncClient(transport=ep.in_process_transport()))  # fmt: skip


def claude(ep, key):
    return anthropic.AsyncAnthropic(api_key=key, base_url="http://agent", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=ep.app)))  # fmt: skip


async def chat(ep, key, stream):
    c = oai(ep, key)
    if not stream:
        r = await c.chat.completions.create(model="m", messages=USER, max_tokens=8, logprobs=True)
        return r.id, r.choices[0].message.content
    text, rid = "", None
    async with await c.chat.completions.create(model="m", messages=USER, max_tokens=8, logprobs=True, stream=True) as chunks:
        async for chunk in chunks:
            rid = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
    return rid, text


async def responses(ep, key, stream):
    c = oai(ep, key)
    if not stream:
        r = await c.responses.create(model="m", input=USER, max_output_tokens=8)
        return r.id, r.output_text
    final = None
    async with await c.responses.create(model="m", input=USER, max_output_tokens=8, stream=True) as events:
        async for event in events:
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    return final.id, final.output_text


async def messages(ep, key, stream):
    c = claude(ep, key)
    if not stream:
        m = await c.messages.create(model="m", max_tokens=8, messages=USER)
        return m.id, m.content[0].text
    async with c.messages.stream(model="m", max_tokens=8, messages=USER) as s:
        m = await s.get_final_message()
    return m.id, m.content[0].text


def recorded(inter):
    r = inter.model_response
    return (inter.messages, inter.output_message_list[0]["content"], r.input_tokens, r.output_tokens, r.output_logprobs, r.output_versions)


@SDK_STREAM_LEFTOVERS
@pytest.mark.parametrize("api", [chat, responses, messages])
async def test_streamed_and_unstreamed_runs_of_a_seeded_episode_record_identical_interactions(api):
    model, tok = tiny_model()
    runs = []
    for stream in (False, True):
        async with LocalEngine(model, tok, seed=7) as engine:
            ep = OpenAIEndpoint(engine)
            with ep.session() as s:
                rid, text = await api(ep, s.key, stream)
            [inter] = s.interactions.values()
            assert inter.interaction_id == rid and inter.output_message_list[0]["content"] == text
            runs.append(recorded(inter))
    assert runs[0] == runs[1]


@SDK_STREAM_LEFTOVERS
async def test_streamed_tool_calls_reach_each_sdk():
    ep = OpenAIEndpoint(texts_engine([CALL, CALL, CALL]))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with ep.session() as s:
        calls = []
        async with await oai(ep, s.key).chat.completions.create(model="m", messages=USER, tools=tools, stream=True) as chunks:
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.tool_calls:
                    calls += [(t.function.name, t.function.arguments) for t in chunk.choices[0].delta.tool_calls]
        assert calls == [("add", '{"a": 2, "b": 3}')]
        rtools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
        async with await oai(ep, s.key).responses.create(model="m", input="hi", tools=rtools, stream=True) as events:
            done = [e.response async for e in events if e.type == "response.completed"]
        [fc] = done[0].output
        assert (fc.type, fc.name, fc.arguments) == ("function_call", "add", '{"a": 2, "b": 3}')
        atools = [{"name": "add", "input_schema": {"type": "object"}}]
        async with claude(ep, s.key).messages.stream(model="m", max_tokens=64, messages=USER, tools=atools) as st:
            m = await st.get_final_message()
        assert m.stop_reason == "tool_use" and m.content[0].input == {"a": 2, "b": 3}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("chat/completions", {"messages": USER, "stream": True}),
        ("responses", {"input": "hi", "stream": True}),
        ("messages", {"messages": USER, "max_tokens": 8, "stream": True}),
    ],
)
async def test_a_streamed_request_the_client_abandons_aborts_its_generation(path, body):
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    ep = OpenAIEndpoint(engine)
    with trio.fail_after(60), ep.session() as s:
        async with trio.open_nursery() as server:
            base = await server.start(serve_app, ep.app)
            async with httpx.AsyncClient(base_url=f"{base}/v1/", headers={"authorization": f"Bearer {s.key}"}) as c:

                async def stream():
                    async with c.stream("POST", path, json=body) as r:
                        await r.aread()

                async with trio.open_nursery() as n:
                    n.start_soon(stream)
                    while not engine.in_flight:
                        await trio.lowlevel.checkpoint()
                    [rid] = engine.in_flight
                    n.cancel_scope.cancel()  # the client leaves, its connection closes
            while not engine.aborted:
                await trio.lowlevel.checkpoint()
            server.cancel_scope.cancel()
    assert engine.aborted == [rid] and s.interactions == {}
