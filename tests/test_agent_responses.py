"""``POST /v1/responses`` on the agent endpoint, through the real openai SDK and plain httpx."""

import json

import httpx
import openai
import pytest

from rollout_trio import interactions_to_trajectory
from rollout_trio.agents import AgentRolloutWorkflow, OpenAIEndpoint
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model

from .agent_helpers import IM_END, text_tokens, texts_engine

QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}
TOOLS = [{"type": "function", "name": "add", "description": "add", "parameters": {"type": "object"}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class ResponsesToolAgent:
    """Asks through ``client.responses.create``, runs the called tool, asks again."""

    async def run(self, data, **kwargs):
        client = openai.AsyncOpenAI(max_retries=0, **kwargs)
        items = list(data["messages"])
        first = await client.responses.create(model="m", input=items, tools=TOOLS, instructions="Be brief.")
        [call] = [o for o in first.output if o.type == "function_call"]
        assert call.name == "add"
        args = json.loads(call.arguments)
        items += [
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])},
        ]
        final = await client.responses.create(model="m", input=items, tools=TOOLS, instructions="Be brief.")
        return 1.0 if final.output_text == "5" else 0.0


async def test_responses_with_a_tool_call_through_the_openai_sdk_are_recorded_as_chat_turns():
    engine = texts_engine([CALL, "5"])
    wf = AgentRolloutWorkflow(ResponsesToolAgent(), discount=0.5)
    result = await wf.arun_episode(engine, QUESTION)
    first, second = result.values()
    assert (first.reward, second.reward) == (0.5, 1.0)
    assert first.interaction_id.startswith("resp_")
    [tool_call] = first.output_message_list[0]["tool_calls"]
    assert first.messages == [{"role": "system", "content": "Be brief."}, *QUESTION["messages"]]
    assert second.messages[-2]["tool_calls"][0]["id"] == tool_call["id"]
    assert second.messages[-1] == {"role": "tool", "tool_call_id": tool_call["id"], "content": "5"}
    assert first.model_response.output_tokens == (*text_tokens(CALL), IM_END)
    traj = interactions_to_trajectory(result)
    assert traj.versions[traj.loss_mask == 1].unique().tolist() == [3]


async def test_responses_match_chat_completions_on_the_real_engine():
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        ep = OpenAIEndpoint(engine)
        with ep.session() as s:
            client = openai.AsyncOpenAI(api_key=s.key, base_url="http://agent/v1/", max_retries=0,
                                        http_client=httpx.AsyncClient(transport=ep.in_process_transport()))  # fmt: skip
            r = await client.responses.create(model="m", input="What is 2+3?", max_output_tokens=6, temperature=0,
                                              include=["message.output_text.logprobs"])  # fmt: skip
            c = await client.chat.completions.create(model="m", messages=QUESTION["messages"], max_tokens=6, temperature=0)
        ri, ci = s.interactions[r.id], s.interactions[c.id]
        assert ri.messages == ci.messages == QUESTION["messages"]
        assert ri.model_response.input_tokens == ci.model_response.input_tokens
        assert ri.model_response.output_tokens == ci.model_response.output_tokens  # greedy
        assert r.output_text == c.choices[0].message.content
        assert r.usage.output_tokens == ri.model_response.output_len == c.usage.completion_tokens
        assert [t.logprob for t in r.output[0].content[0].logprobs] == pytest.approx(list(ri.model_response.output_logprobs))
        assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "mystery"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "max_output_tokens": 10**9}, "max_tokens"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ],
)
async def test_bad_responses_bodies_get_openai_errors(body, param):
    ep = OpenAIEndpoint(texts_engine([]))
    with ep.session() as s:
        async with httpx.AsyncClient(transport=ep.in_process_transport(), base_url="http://agent/v1/",
                                     headers={"authorization": f"Bearer {s.key}"}) as c:  # fmt: skip
            r = await c.post("responses", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


async def test_responses_need_a_live_session_key():
    ep = OpenAIEndpoint(texts_engine([]))
    async with httpx.AsyncClient(transport=ep.in_process_transport(), base_url="http://agent/v1/") as c:
        r = await c.post("responses", json={"input": "hi"}, headers={"authorization": "Bearer sk-nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
