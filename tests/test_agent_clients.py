"""Which ``http_client`` an in-process agent is handed (``httpx`` or ``httpx2``), and the
Anthropic SDK (which takes only ``httpx2`` clients) in process on both hosts, grouped."""

import sys
import types

import pytest

from rollout_trio import GroupedRolloutWorkflow, on_trio, workflow_context
from rollout_trio._asyncio import current_portal
from rollout_trio.agents import AgentRolloutWorkflow

from .agent_helpers import hanging_engine, texts_engine

QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}

CLAUDE_AGENT = '''
import anthropic


class Solver:
    async def run(self, data, **kwargs):
        client = anthropic.AsyncAnthropic(max_retries=0, **kwargs)
        msg = await client.messages.create(model="m", max_tokens=16, system="Be brief.", messages=data["messages"])
        return 1.0 if msg.content[0].text == "5" else 0.0
'''


def agent_module(name: str, source: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A module made from ``source`` and registered as ``name``, as an agent file would be imported."""
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)  # noqa: S102 - an agent file, as imported
    return module


@pytest.mark.parametrize(
    ("imports", "library"),
    [
        ("import anthropic", "httpx2"),
        ("from anthropic import AsyncAnthropic", "httpx2"),
        ("import anthropic\nimport openai", "httpx"),  # an httpx SDK beside it keeps httpx
        ("from langchain_openai import ChatOpenAI\nimport anthropic", "httpx"),
        ("import openai", "httpx"),
        ("import json", "httpx"),
    ],
)
def test_the_client_library_follows_the_sdks_the_agents_module_uses(imports, library, monkeypatch):
    module = agent_module("agent_rule_probe", f"{imports}\n\nclass A:\n    async def run(self, data, **kw):\n        return 0.0\n", monkeypatch)
    assert AgentRolloutWorkflow(module.A()).http_library == library


def test_an_agent_defined_in_a_script_is_judged_by_the_globals_its_run_sees():
    """As a script run with ``python`` or a pasted block: ``__main__`` in sys.modules is
    not the namespace the class was made in."""
    namespace = {"__name__": "__main__"}
    exec(compile(CLAUDE_AGENT, "<pasted>", "exec"), namespace)  # noqa: S102 - an agent file, as imported
    assert AgentRolloutWorkflow(namespace["Solver"]()).http_library == "httpx2"


def test_http_library_overrides_the_rule_and_an_unknown_one_names_the_field(monkeypatch):
    module = agent_module("agent_override_probe", CLAUDE_AGENT, monkeypatch)
    assert AgentRolloutWorkflow(module.Solver(), http_library="httpx").http_library == "httpx"
    with pytest.raises(ValueError, match=r"http_library: must be one of .*'requests'"):
        AgentRolloutWorkflow(module.Solver(), http_library="requests")


@pytest.mark.parametrize("host", ["asyncio", "trio"])
async def test_an_anthropic_agent_runs_in_process_on_either_host(host, monkeypatch):
    module = agent_module(f"claude_agent_{host}", CLAUDE_AGENT, monkeypatch)
    agent = module.Solver() if host == "asyncio" else on_trio(module.Solver())
    wf = AgentRolloutWorkflow(agent)
    assert (wf.host, wf.http_library) == (host, "httpx2")
    result = await wf.arun_episode(texts_engine(["5"]), QUESTION)
    [(key, inter)] = result.items()
    assert key.startswith("msg_") and inter.reward == 1.0
    assert inter.messages == [{"role": "system", "content": "Be brief."}, *QUESTION["messages"]]


async def test_a_failing_slot_cancels_its_anthropic_siblings_and_aborts_their_generations(monkeypatch):
    engine, both_generate = hanging_engine(2)
    module = agent_module("claude_agent_group", CLAUDE_AGENT, monkeypatch)

    class Failing(module.Solver):
        async def run(self, data, **kwargs):
            if workflow_context.get().sample_idx == 2:
                await current_portal().run_trio(both_generate.wait)
                raise ValueError("slot 2 failed")
            return await super().run(data, **kwargs)

    wf = AgentRolloutWorkflow(Failing())
    assert wf.http_library == "httpx2"  # its base's module uses anthropic, its own only rollout_trio
    with pytest.raises(ExceptionGroup) as info:
        await GroupedRolloutWorkflow(wf, 3).arun_episode(engine, QUESTION)
    assert info.group_contains(ValueError, match="slot 2 failed")
    assert len(engine.aborted) == 2 and engine.completed == [] and not engine.in_flight
