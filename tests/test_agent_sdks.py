"""Agent SDKs as their users write them, in process against the endpoint: openai-agents'
``Runner.run`` (the Responses API by default) and LangChain's ``ChatOpenAI``, hosted on asyncio."""

import openai
import pytest

from rollout_trio import interactions_to_trajectory
from rollout_trio.agents import AgentRolloutWorkflow

from .agent_helpers import texts_engine

QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}


class OpenAIAgentsAgent:
    async def run(self, data, **kwargs):
        from agents import Agent, OpenAIResponsesModel, Runner, RunConfig

        client = openai.AsyncOpenAI(max_retries=0, **kwargs)
        agent = Agent(name="solver", instructions="Answer briefly.", model=OpenAIResponsesModel("m", openai_client=client))
        result = await Runner.run(agent, data["messages"][0]["content"], run_config=RunConfig(tracing_disabled=True))
        return 1.0 if result.final_output == "5" else 0.0


class LangChainAgent:
    async def run(self, data, **kwargs):
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model="m", base_url=kwargs["base_url"], api_key=kwargs["api_key"],
                         http_async_client=kwargs["http_client"], max_retries=0)  # fmt: skip
        reply = await llm.ainvoke(data["messages"])
        return 1.0 if reply.content == "5" else 0.0


@pytest.mark.parametrize("agent", [OpenAIAgentsAgent, LangChainAgent])
async def test_an_sdk_agent_runs_in_process_and_its_turn_is_recorded(agent):
    engine = texts_engine(["5"])
    result = await AgentRolloutWorkflow(agent()).arun_episode(engine, QUESTION)
    [inter] = result.values()
    assert inter.reward == 1.0 and inter.output_message_list[0]["content"] == "5"
    assert inter.messages[-1] == QUESTION["messages"][0]
    assert interactions_to_trajectory(result).batch_size == 1
