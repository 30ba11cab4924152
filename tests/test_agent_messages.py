"""``POST /v1/messages`` (Anthropic Messages, tool use) on the agent endpoint, through the real
anthropic SDK and plain httpx; session keys across the three APIs."""

import anthropic
import httpx
import httpx2
import openai
import pytest

from rollout_trio import interactions_to_trajectory
from rollout_trio.agents import OpenAIEndpoint
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model

from .agent_helpers import IM_END, text_tokens, texts_engine

USER = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [{"name": "add", "description": "add", "input_schema": {"type": "object"}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def claude(ep, key):
    return anthropic.AsyncAnthropic(api_key=key, base_url="http://agent", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=ep.app)))  # fmt: skip


async def test_a_tool_use_loop_through_the_anthropic_sdk_is_recorded_as_chat_turns():
    ep = OpenAIEndpoint(texts_engine([CALL, "5"]))
    with ep.session() as s:
        client = claude(ep, s.key)
        first = await client.messages.create(model="m", max_tokens=64, system="Be brief.", messages=USER, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert (use.name, use.input) == ("add", {"a": 2, "b": 3})
        messages = [*USER, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]  # fmt: skip
        final = await client.messages.create(model="m", max_tokens=64, system="Be brief.", messages=messages, tools=TOOLS)
        assert final.stop_reason == "end_turn" and final.content[0].text == "5"
    a, b = s.interactions[first.id], s.interactions[final.id]
    assert a.messages == [{"role": "system", "content": "Be brief."}, *USER]
    assert a.output_message_list[0]["tool_calls"][0]["id"] == use.id
    assert b.messages[-2]["tool_calls"][0]["id"] == use.id
    assert b.messages[-1] == {"role": "tool", "tool_call_id": use.id, "content": "5"}
    assert a.model_response.output_tokens == (*text_tokens(CALL), IM_END)
    assert first.usage.output_tokens == a.model_response.output_len
    a.reward = b.reward = 1.0
    traj = interactions_to_trajectory({first.id: a, final.id: b})
    assert traj.versions[traj.loss_mask == 1].unique().tolist() == [3]


async def test_messages_match_chat_completions_on_the_real_engine():
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        ep = OpenAIEndpoint(engine)
        with ep.session() as s:
            m = await claude(ep, s.key).messages.create(model="m", max_tokens=6, messages=USER, extra_body={"temperature": 0})
            oa = openai.AsyncOpenAI(api_key=s.key, base_url="http://agent/v1/", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=ep.in_process_transport()))  # fmt: skip
            c = await oa.chat.completions.create(model="m", messages=USER, max_tokens=6, temperature=0)
    mi, ci = s.interactions[m.id], s.interactions[c.id]
    assert mi.messages == ci.messages == USER
    assert mi.model_response.input_tokens == ci.model_response.input_tokens
    assert mi.model_response.output_tokens == ci.model_response.output_tokens
    assert m.content[0].text == c.choices[0].message.content
    assert m.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": USER}, "max_tokens"),
        ({"max_tokens": 8}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages[0].content[0].type"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 8, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]},
         "messages[0].content[0].input"),
        ({"max_tokens": 10**9, "messages": USER}, "max_tokens"),
        ({"max_tokens": 8, "messages": USER, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 8, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools[0].type"),
        ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ],
)
async def test_bad_messages_bodies_get_anthropic_errors(body, field):
    ep = OpenAIEndpoint(texts_engine([]))
    with ep.session() as s:
        async with httpx.AsyncClient(transport=ep.in_process_transport(), base_url="http://agent/v1/",
                                     headers={"x-api-key": s.key}) as c:  # fmt: skip
            r = await c.post("messages", json=body)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and field in body["error"]["message"]


async def test_the_sdk_sees_anthropic_errors_as_its_own_exceptions():
    ep = OpenAIEndpoint(texts_engine([]), max_tokens_limit=100, default_max_tokens=10)
    with ep.session() as s:
        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            await claude(ep, s.key).messages.create(model="m", max_tokens=101, messages=USER)
    with pytest.raises(anthropic.AuthenticationError):
        await claude(ep, s.key).messages.create(model="m", max_tokens=8, messages=USER)  # the session ended


async def test_a_session_key_works_for_every_api_of_its_session_only():
    ep = OpenAIEndpoint(texts_engine(["a", "b", "c", "d"]))
    with ep.session() as s1, ep.session() as s2:
        async with httpx.AsyncClient(transport=ep.in_process_transport(), base_url="http://agent/v1/") as c:
            r1 = await c.post("messages", json={"max_tokens": 8, "messages": USER}, headers={"x-api-key": s1.key})
            r2 = await c.post("responses", json={"input": "hi"}, headers={"authorization": f"Bearer {s1.key}"})
            r3 = await c.post("chat/completions", json={"messages": USER}, headers={"authorization": f"Bearer {s1.key}"})
            r4 = await c.post("messages", json={"max_tokens": 8, "messages": USER}, headers={"authorization": f"Bearer {s2.key}"})
            bad = await c.post("messages", json={"max_tokens": 8, "messages": USER}, headers={"x-api-key": "sk-other"})
    assert [r.status_code for r in (r1, r2, r3, r4)] == [200] * 4
    assert set(s1.interactions) == {r1.json()["id"], r2.json()["id"], r3.json()["id"]}
    assert set(s2.interactions) == {r4.json()["id"]}
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"


async def test_a_mid_conversation_system_message_becomes_a_chat_system_message():
    """The Claude Code CLI sends ``{"role": "system"}`` inside ``messages`` (a beta) and system
    blocks with ``cache_control``; both are templated as chat system messages."""
    ep = OpenAIEndpoint(texts_engine(["5"]))
    body = {"max_tokens": 8, "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [*USER, {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}],
            "thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "low"}}  # fmt: skip
    with ep.session() as s:
        async with httpx.AsyncClient(transport=ep.in_process_transport(), base_url="http://agent") as client:
            r = await client.post("/v1/messages?beta=true", json=body, headers={"x-api-key": s.key})
    assert r.status_code == 200, r.text
    [turn] = s.interactions.values()
    assert turn.messages == [{"role": "system", "content": "Be brief."}, *USER, {"role": "system", "content": "# Environment"}]
