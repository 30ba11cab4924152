"""Agents through the real openai SDK under Trio: rewards, discounts, export styles, groups,
failures, cancellation and the subprocess mode (spec/executor.md §8)."""

import json
import os

import openai
import pytest
import torch
import trio

from rollout_trio import GenerationConfig, GroupedRolloutWorkflow, ModelRequest, Interaction, interactions_to_trajectory, resolve_workflow
from rollout_trio.agents import AgentProcessError, AgentRolloutWorkflow, AgentSession, assign_rewards
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.testing import ScriptedEngine
from rollout_trio import workflow_context

from . import agent_subproc_agents as subproc_agents
from .agent_helpers import IM_END, TOKENIZER, text_tokens, texts_engine

QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def sdk(kwargs):
    return openai.AsyncOpenAI(max_retries=0, **kwargs)


class ToolAgent:
    """Asks, runs the tool the model calls, asks again; reward 1.0 if the answer says 5."""

    def __init__(self):
        self.kwargs = []

    async def run(self, data, **kwargs):
        self.kwargs.append(kwargs)
        client = sdk(kwargs)
        messages = list(data["messages"])
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        msg = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        args = json.loads(msg.tool_calls[0].function.arguments)
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": str(args["a"] + args["b"])}]
        final = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        return 1.0 if final.choices[0].message.content == "5" else 0.0


async def test_multi_turn_agent_with_a_tool_call_through_the_openai_sdk():
    engine = texts_engine([CALL, "5"])
    agent = ToolAgent()
    wf = AgentRolloutWorkflow(agent, discount=0.5)
    result = await wf.arun_episode(engine, QUESTION)
    # Exactly the three keyword arguments of spec §8.2.
    [kw] = agent.kwargs
    assert set(kw) == {"base_url", "http_client", "api_key"}
    first, second = result.values()
    assert (first.reward, second.reward) == (0.5, 1.0)  # 1.0 on the last, discounted back
    assert second.messages[-1] == {"role": "tool", "tool_call_id": first.output_message_list[0]["tool_calls"][0]["id"], "content": "5"}
    assert first.model_response.output_tokens == (*text_tokens(CALL), IM_END)
    traj = interactions_to_trajectory(result)
    assert traj.rewards.tolist() == [0.5, 1.0]
    assert traj.versions[traj.loss_mask == 1].unique().tolist() == [3]
    assert wf.endpoint(engine)._sessions == {}  # the session ended


async def test_the_real_engine_behind_the_sdk_multi_turn():
    model, tok = tiny_model()

    class Asker:
        async def run(self, data, **kwargs):
            client = sdk(kwargs)
            messages = list(data["messages"])
            for _ in range(2):
                reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "And 1+1?"}]
            return 1.0

    async with LocalEngine(model, tok, seed=0) as engine:
        result = await resolve_workflow(Asker()).arun_episode(engine, QUESTION)
    first, second = result.values()
    assert second.model_response.input_tokens[: first.model_response.input_len] == first.model_response.input_tokens
    assert [i.reward for i in result.values()] == [1.0, 1.0]  # discount 1: the sum of later rewards
    assert interactions_to_trajectory(result).batch_size == 2


def three_call_agent(returns):
    class Agent:
        async def run(self, data, **kwargs):
            client = sdk(kwargs)
            ids = []
            for k in range(3):
                r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{k}"}])
                ids.append(r.id)
            return returns(ids)

    return Agent()


@pytest.mark.parametrize(
    ("returns", "discount", "expected"),
    [
        (lambda ids: 1.0, 0.9, [0.81, 0.9, 1.0]),
        (lambda ids: {ids[0]: 0.5, ids[2]: 1.0}, 1.0, [1.5, 1.0, 1.0]),
        (lambda ids: {ids[0]: 1.0, ids[2]: 2.0}, 0.5, [1.5, 1.0, 2.0]),
    ],
)
async def test_spec_worked_examples_of_reward_discount(returns, discount, expected):
    wf = AgentRolloutWorkflow(three_call_agent(returns), discount=discount)
    result = await wf.arun_episode(texts_engine(["a", "b", "c"]), QUESTION)
    assert [i.reward for i in result.values()] == pytest.approx(expected)
    traj = interactions_to_trajectory(result)
    assert traj.rewards.tolist() == pytest.approx(expected)
    assert traj.original_rewards.tolist() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("returns", "match"),
    [
        (lambda ids: 1, "Invalid reward type: <class 'int'>"),
        (lambda ids: True, "Invalid reward type: <class 'bool'>"),
        (lambda ids: None, "Invalid reward type: <class 'NoneType'>"),
        (lambda ids: {"chatcmpl-nope": 1.0}, "no completion of this episode has that id"),
        (lambda ids: {ids[0]: float("nan")}, "must be a finite number"),
    ],
)
async def test_bad_reward_values_are_value_errors(returns, match):
    wf = AgentRolloutWorkflow(three_call_agent(returns))
    engine = texts_engine(["a", "b", "c"])
    with pytest.raises(ValueError, match=match):
        await wf.arun_episode(engine, QUESTION)
    assert wf.endpoint(engine)._sessions == {}


async def test_session_reward_rules():
    s = AgentSession()
    for k in ("1", "2"):
        s.record(Interaction(interaction_id=k))
    assign_rewards(s, 20.0)
    assert [i.reward for i in s.interactions.values()] == [None, 20.0]
    s.set_reward("1", 10)
    assert s.interactions["1"].reward == 10
    s.apply_discount(0.5)
    assert [i.reward for i in s.interactions.values()] == [20.0, 20.0]
    with pytest.raises(RuntimeError, match="only be called once"):
        s.apply_discount(0.5)
    with pytest.raises(ValueError, match="export_style"):
        s.export("bogus")
    with pytest.raises(ValueError, match="made no chat completion"):
        assign_rewards(AgentSession(), 1.0)
    assert AgentSession().export("individual") == {}


class ConversationAgent:
    """Two turns of one conversation: the second request repeats the first and its answer."""

    async def run(self, data, **kwargs):
        client = sdk(kwargs)
        messages = list(data["messages"])
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "sure?"}]
        await client.chat.completions.create(model="m", messages=messages)
        return 1.0


async def test_concat_export_keeps_the_leaf_with_its_history():
    engine = texts_engine(["4", "5"])
    result = await AgentRolloutWorkflow(ConversationAgent(), export_style="concat", discount=0.5).arun_episode(engine, QUESTION)
    [leaf] = result.values()
    parent = leaf.parent
    assert parent is not None and parent.reward == 0.5 and leaf.reward == 1.0
    row = leaf.to_trajectory()
    p_in, p_out = parent.model_response.input_len, parent.model_response.output_len
    n_in = leaf.model_response.input_len
    mask = row.loss_mask[0].tolist()
    # parent prompt 0s, parent answer 1s, the new user turn 0s, the leaf's answer 1s
    assert mask == [0] * p_in + [1] * p_out + [0] * (n_in - p_in - p_out) + [1] * leaf.model_response.output_len
    assert row.versions[0][torch.tensor(mask) == 0].unique().tolist() == [-1]
    assert row.rewards.tolist() == [1.0]
    individual = await AgentRolloutWorkflow(ConversationAgent()).arun_episode(texts_engine(["4", "5"]), QUESTION)
    assert len(individual) == 2 and all(i.parent is None for i in individual.values())


async def test_two_agents_run_concurrently_in_one_group():
    both_in_flight = trio.Event()
    engine_calls = []

    async def script(req):
        engine_calls.append(req.rid)
        if len(engine_calls) == 2:
            both_in_flight.set()
        await both_in_flight.wait()  # only finishes when both agents are waiting on it
        return None

    engine = ScriptedEngine(script)
    engine.tokenizer = TOKENIZER

    class OneShot:
        async def run(self, data, **kwargs):
            r = await sdk(kwargs).chat.completions.create(model="m", messages=data["messages"])
            return 1.0 + workflow_context.get().sample_idx

    group = GroupedRolloutWorkflow(OneShot(), 2)
    with trio.fail_after(10):
        merged = await group.arun_episode(engine, QUESTION)
    assert sorted((i.rollout_index, i.reward) for i in merged.values()) == [(0, 1.0), (1, 2.0)]
    assert set(merged) == {f"chatcmpl-{rid}" for rid in engine_calls}


async def test_grouped_multi_turn_agents_normalize_by_their_outcome():
    class Scored:
        async def run(self, data, **kwargs):
            client = sdk(kwargs)
            for k in range(2):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{k}"}])
            return [1.0, 3.0][workflow_context.get().sample_idx]

    group = GroupedRolloutWorkflow(AgentRolloutWorkflow(Scored(), discount=0.5), 2, reward_normalization=True)
    merged = await group.arun_episode(texts_engine(["a"] * 4), QUESTION)
    by_slot = sorted((i.rollout_index, i.original_reward, i.rollout_reward) for i in merged.values())
    # Slot outcomes 1 and 3 normalize to -1 and +1; each row keeps its discounted original.
    assert by_slot == [(0, 0.5, pytest.approx(-1.0)), (0, 1.0, pytest.approx(-1.0)), (1, 1.5, pytest.approx(1.0)), (1, 3.0, pytest.approx(1.0))]


async def test_an_agent_that_raises_rejects_the_episode_and_ends_its_session(caplog):
    class Broken:
        async def run(self, data, **kwargs):
            await sdk(kwargs).chat.completions.create(model="m", messages=data["messages"])
            raise KeyError("tool exploded")

    engine = texts_engine(["a"])
    wf = AgentRolloutWorkflow(Broken())
    with pytest.raises(KeyError, match="tool exploded"):
        await wf.arun_episode(engine, QUESTION)
    assert "Agent task failed (KeyError" in caplog.text
    assert wf.endpoint(engine)._sessions == {}


async def test_an_agent_without_completions_is_rejected():
    class Lazy:
        async def run(self, data, **kwargs):
            return 1.0

    assert await AgentRolloutWorkflow(Lazy()).arun_episode(texts_engine([]), QUESTION) is None


async def test_cancelling_the_episode_cancels_the_agent_and_aborts_its_generation():
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    wf = AgentRolloutWorkflow(ConversationAgent())
    async with trio.open_nursery() as n:
        n.start_soon(wf.arun_episode, engine, QUESTION)
        while not engine.in_flight:
            await trio.lowlevel.checkpoint()
        [rid] = engine.in_flight
        n.cancel_scope.cancel()
    assert engine.aborted == [rid] and engine.completed == []
    assert wf.endpoint(engine)._sessions == {}


async def test_cancelling_an_agent_on_the_real_engine_drops_its_request():
    """Cancelled after its first decode step, the agent's request leaves the engine: it is no
    longer live and takes no step while the engine goes on decoding another request."""
    model, tok = tiny_model(forced_token=65)  # never stops by itself
    wf = AgentRolloutWorkflow(ConversationAgent(), default_max_tokens=4096, max_tokens_limit=4096)
    async with LocalEngine(model, tok, seed=0) as engine:
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                n.start_soon(wf.arun_episode, engine, QUESTION)
                # Live and past its first step (a loaded machine may register it well before).
                while not any(engine.statistics().steps_per_rid.get(r, 0) for r in engine.statistics().live_rids):
                    await trio.sleep(0.01)
                [rid] = engine.statistics().live_rids
                n.cancel_scope.cancel()
            stats = engine.statistics()
            assert rid not in stats.live_rids and 0 < stats.steps_per_rid.get(rid, 0) < 4096
            steps = stats.steps_per_rid.get(rid, 0)
            # The engine decodes 8 more tokens for another request: none of them for ``rid``.
            await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=8)))
            assert engine.statistics().steps_per_rid.get(rid, 0) == steps


def test_constructor_errors():
    class Sync:
        def run(self, data):
            return 1.0

    with pytest.raises(ValueError, match="Invalid mode"):
        AgentRolloutWorkflow(ConversationAgent(), mode="bogus")
    with pytest.raises(ValueError, match="agent is required"):
        AgentRolloutWorkflow(None)
    with pytest.raises(TypeError, match="callable 'run'"):
        AgentRolloutWorkflow(object())
    with pytest.raises(TypeError, match="must be an async function"):
        AgentRolloutWorkflow(Sync())
    with pytest.raises(ValueError, match="export_style"):
        AgentRolloutWorkflow(ConversationAgent(), export_style="tree")
    with pytest.raises(ValueError, match="discount"):
        AgentRolloutWorkflow(ConversationAgent(), discount=0)


async def test_subprocess_agent_reaches_the_endpoint_over_loopback():
    engine = texts_engine(["five"])
    wf = AgentRolloutWorkflow(subproc_agents.EnvAgent(), mode="subproc")
    with trio.fail_after(60):
        result = await wf.arun_episode(engine, QUESTION)
    [inter] = result.values()
    assert inter.reward == 4.5 and inter.output_message_list[0]["content"] == "five"


async def test_subprocess_agent_finds_the_endpoint_in_the_anthropic_variables():
    engine = texts_engine(["five"])
    wf = AgentRolloutWorkflow(subproc_agents.ClaudeEnvAgent(), mode="subproc")
    with trio.fail_after(60):
        result = await wf.arun_episode(engine, QUESTION)
    [inter] = result.values()
    assert inter.reward == 4.5 and inter.output_message_list[0]["content"] == "five"
    assert inter.interaction_id.startswith("msg_")


async def test_subprocess_agent_errors_reject_the_episode():
    wf = AgentRolloutWorkflow(subproc_agents.FailingAgent(), mode="subproc")
    with trio.fail_after(60), pytest.raises(LookupError, match="no answer for What is 2") as info:
        await wf.arun_episode(texts_engine([]), QUESTION)
    assert any("raised in the agent process" in note for note in info.value.__notes__)


async def test_cancelling_a_subprocess_agent_kills_it_and_aborts_its_generation(tmp_path):
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    pid_file = tmp_path / "pid"
    wf = AgentRolloutWorkflow(subproc_agents.HangingAgent(), mode="subproc")
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(wf.arun_episode, engine, {**QUESTION, "pid_file": str(pid_file)})
            while not engine.in_flight:
                await trio.sleep(0.01)
            [rid] = engine.in_flight
            n.cancel_scope.cancel()
    assert engine.aborted == [rid]
    pid = int(pid_file.read_text())
    assert _dead(pid), f"the agent process {pid} still runs after its episode was cancelled"


def _dead(pid: int) -> bool:
    """Gone, or killed and not yet reaped by its parent (a zombie runs no code)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def test_a_subprocess_agent_dying_without_a_result_is_a_typed_error():
    wf = AgentRolloutWorkflow(subproc_agents.ExitingAgent(), mode="subproc")
    with trio.fail_after(60), pytest.raises(AgentProcessError, match="exited with status 3 without a result"):
        await wf.arun_episode(texts_engine([]), QUESTION)


def test_public_names_live_at_the_root_and_in_their_subpackages():
    import inspect

    import rollout_trio
    from rollout_trio import agents, rewards, workflows

    for name, sub in [("OpenAIEndpoint", agents), ("AgentRolloutWorkflow", agents), ("RewardFunction", rewards),
                      ("RewardTimeoutError", rewards), ("RLVRWorkflow", workflows), ("MultiTurnWorkflow", workflows)]:
        obj = getattr(rollout_trio, name)
        assert obj is getattr(sub, name) and inspect.getdoc(obj) and obj.__module__ == "rollout_trio", name
    assert issubclass(rollout_trio.RewardTimeoutError, rollout_trio.RolloutError)


async def test_the_session_is_named_after_the_task_and_slot():
    seen = []

    class Peek:
        async def run(self, data, **kwargs):
            seen.extend(s.label for s in wf.endpoint(engine)._sessions.values())
            await sdk(kwargs).chat.completions.create(model="m", messages=data["messages"])
            return 1.0

    engine = texts_engine(["a", "b"])
    wf = AgentRolloutWorkflow(Peek())
    with workflow_context.use(workflow_context.WorkflowContext(task_id=42, sample_idx=1)):
        await wf.arun_episode(engine, QUESTION)
    with workflow_context.use(workflow_context.WorkflowContext(task_id=42)):
        await wf.arun_episode(engine, QUESTION)
    assert seen == ["42:1", "42"]
