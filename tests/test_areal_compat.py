"""AReaL 1.0.4's own workflow files run unchanged under ``rollout_trio.compat.areal`` (issue 28).

The files come from AReaL's wheel on the package index (downloaded once, cached under
``/.whl/``, which git ignores), never copied into the repository; the hook serves their
``import areal.…`` from the compat layer. Each runs single and grouped on ``LocalEngine``
with the tiny model, its result checked by the contract with its row count.
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import trio

from rollout_trio import GenerationConfig, check_trajectory_format, run_group, workflow_context
from rollout_trio.compat import areal as compat
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflow_context import StatsRecorder, WorkflowContext
from tests import reward_fns

AREAL_VERSION = "1.0.4"
CACHE = Path(__file__).resolve().parent.parent / ".whl"
DATA = {"messages": [{"role": "user", "content": "What is 1+2?"}], "answer": 3}


@pytest.fixture(scope="session")
def areal_sources(tmp_path_factory):
    """AReaL 1.0.4's wheel, unpacked (its files as published)."""
    wheels = sorted(CACHE.glob(f"areal-{AREAL_VERSION}-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"areal=={AREAL_VERSION}", "--no-deps", "-q", "-d", str(CACHE)],
            capture_output=True, text=True,
        )  # fmt: skip
        wheels = sorted(CACHE.glob(f"areal-{AREAL_VERSION}-*.whl"))
        if done.returncode != 0 or not wheels:
            pytest.skip(f"the package index cannot be reached to download areal=={AREAL_VERSION}: {done.stderr[-300:]}")
    root = tmp_path_factory.mktemp("areal-wheel")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(root)
    return root


@pytest.fixture
def hook(areal_sources):
    assert compat.install(areal_sources)
    yield areal_sources
    compat.uninstall()


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model()


def gconfig(**kw):
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(max_new_tokens=kw.pop("max_new_tokens", 5), **kw)


async def run_single_and_grouped(workflow, model, tok, group_size=3):
    """The workflow's single result and a group's, each checked by the contract with its row count."""
    stats = StatsRecorder()
    async with LocalEngine(model, tok) as engine:
        with workflow_context.use_stats_recorder(stats), workflow_context.use(WorkflowContext(task_id=0)):
            single = await workflow.arun_episode(engine, DATA)
            grouped = await run_group(workflow, engine, DATA, group_size, stats=stats)
    assert check_trajectory_format(single, batch_size=1)
    grouped = grouped.to_dict() if hasattr(grouped, "to_dict") else grouped
    assert check_trajectory_format(grouped, batch_size=group_size)
    return single, grouped, stats.summaries()


async def test_rlvr_workflow_file_runs_unchanged_single_and_grouped(hook, model_and_tokenizer):
    model, tok = model_and_tokenizer
    rlvr = importlib.import_module("areal.workflow.rlvr")
    assert Path(rlvr.__file__).is_relative_to(hook)  # AReaL's own file, not a copy
    wf = rlvr.RLVRWorkflow(reward_fns.areal_length_reward, gconfig(), tok)
    assert tok.eos_token_id in wf.gconfig.stop_token_ids  # new_with_stop_and_pad_token_ids
    single, grouped, stats = await run_single_and_grouped(wf, model, tok)
    n_out = int(single["loss_mask"].sum())
    assert single["rewards"].item() == float(n_out % 2 == 0)  # the reward ran on this completion
    assert stats["rollout/reward"].count == 4
    # @trace_session("reward") and atrace_session_phase("generate"): one duration per sample
    assert stats["rollout/phase/reward_seconds"].count == 4
    assert stats["rollout/phase/generate_seconds"].count == 4


async def test_multi_turn_workflow_file_runs_a_second_turn(hook, model_and_tokenizer):
    model, tok = model_and_tokenizer
    multi_turn = importlib.import_module("areal.workflow.multi_turn")
    wf = multi_turn.MultiTurnWorkflow(reward_fns.areal_zero_reward, gconfig(max_new_tokens=3), tok, max_turns=2, turn_discount=0.5)
    single, grouped, stats = await run_single_and_grouped(wf, model, tok)
    # turn 2 happened: its prompt extends turn 1's sequence (the list comparison held)
    assert stats["rollout/num_turns"].min == 2
    assert int(single["loss_mask"].sum()) > 0
    assert (single["loss_mask"][0].diff() != 0).sum() >= 2  # gen, prompt amend, gen


SEED_WORKFLOW = '''
# The seed's CustomTaskWorkflow (docs "Implementing Custom Rollout Workflows"), with the
# two edits it needs on AReaL itself: the AsyncRewardWrapper import it forgets, and
# return_dict=False for transformers 5.
import uuid
import torch
from transformers import PreTrainedTokenizerFast
from areal.api.workflow_api import RolloutWorkflow
from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import ModelRequest
from areal.api.reward_api import AsyncRewardWrapper  # edit 1
from areal.utils.logging import getLogger
from areal.utils.perf_tracer import trace_session, session_context

logger = getLogger("CustomTaskWorkflow")

class CustomTaskWorkflow(RolloutWorkflow):
    """Single-generation workflow with scalar reward computation."""

    def __init__(self, reward_fn, tokenizer: PreTrainedTokenizerFast, gconfig):
        self.reward_fn = reward_fn
        self.async_reward_fn = AsyncRewardWrapper(reward_fn)
        self.tokenizer = tokenizer
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)

    @trace_session("reward")
    async def _compute_reward(self, resp, prompt_str, task_data):
        completions = self.tokenizer.decode(resp.output_tokens)
        return await self.async_reward_fn(prompt_str, completions, resp.input_tokens, resp.output_tokens, **task_data)

    @session_context()
    async def _generate(self, engine: InferenceEngine, req: ModelRequest, prompt_str, task_data):
        resp = await engine.agenerate(req)
        reward = await self._compute_reward(resp, prompt_str, task_data)
        return resp, reward

    async def arun_episode(self, engine: InferenceEngine, data: dict):
        input_ids = self.tokenizer.apply_chat_template(
            data["messages"], tokenize=True, add_generation_prompt=True, return_dict=False  # edit 2
        )
        req = ModelRequest(
            rid=uuid.uuid4().hex,
            input_ids=list(input_ids),
            gconfig=self.gconfig.new(n_samples=1),
            tokenizer=self.tokenizer,
        )
        prompt_str = self.tokenizer.decode(input_ids)
        resp, reward = await self._generate(engine, req, prompt_str, data)
        seq = resp.input_tokens + resp.output_tokens
        loss_mask = [0] * resp.input_len + [1] * resp.output_len
        logprobs = [0.0] * resp.input_len + resp.output_logprobs
        versions = [-1] * resp.input_len + resp.output_versions
        result = {
            "input_ids": torch.tensor(seq, dtype=torch.int32),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.int32),
            "logprobs": torch.tensor(logprobs, dtype=torch.float32),
            "versions": torch.tensor(versions, dtype=torch.int32),
            "rewards": torch.tensor(reward, dtype=torch.float32),
            "attention_mask": torch.ones(len(seq), dtype=torch.bool),
        }
        return {k: v.unsqueeze(0) for k, v in result.items()}
'''


async def test_seed_custom_task_workflow_runs_with_its_two_edits(hook, model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    path = tmp_path / "custom_task.py"
    path.write_text(textwrap.dedent(SEED_WORKFLOW))
    spec = importlib.util.spec_from_file_location("custom_task", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    wf = mod.CustomTaskWorkflow(reward_fns.areal_length_reward, tok, gconfig())
    single, grouped, stats = await run_single_and_grouped(wf, model, tok, group_size=2)
    assert stats["rollout/phase/reward_seconds"].count == 3


# AReaL's workflow/vision_rlvr.py: tests/test_areal_vision.py (with the tiny VLM).


class RunsArealsMathAgent:
    """AReaL's ``build_math_agent()`` (openai-agents, handoffs as tools) run by ``Runner.run``,
    as AReaL's openai-agents workflow runs it, over the endpoint's Responses API."""

    def __init__(self, build):
        self.build = build

    async def run(self, data, **kwargs):
        import openai
        from agents import OpenAIResponsesModel, RunConfig, Runner

        model = OpenAIResponsesModel("default", openai_client=openai.AsyncOpenAI(max_retries=0, **kwargs))
        config = RunConfig(model=model, tracing_disabled=True)
        result = await Runner.run(self.build(), data["messages"][-1]["content"], run_config=config, max_turns=2)
        return float(str(data["answer"]) in str(result.final_output))


async def test_arealss_openai_agents_math_agent_file_runs_unchanged_single_and_grouped(hook):
    from rollout_trio import interactions_to_trajectory
    from rollout_trio.agents import AgentRolloutWorkflow

    model, tok = tiny_model()
    # AReaL's instructions and handoff tools template to ~2600 tokens; the tiny model's
    # rotary positions extend past its configured 2048.
    model.config.max_position_embeddings = 4096
    math_agent = importlib.import_module("areal.workflow.openai_agent.math_agent")
    assert Path(math_agent.__file__).is_relative_to(hook)  # AReaL's own file, not a copy
    wf = AgentRolloutWorkflow(RunsArealsMathAgent(math_agent.build_math_agent), gconfig=GenerationConfig(max_new_tokens=6))
    async with LocalEngine(model, tok, seed=0) as engine:
        single = await wf.arun_episode(engine, DATA)
        grouped = await run_group(wf, engine, DATA, 3)
    [turn] = single.values()  # the tiny model calls no handoff: one turn, its instructions the system prompt
    assert turn.interaction_id.startswith("resp_") and turn.messages[0]["role"] == "system"
    assert "Math Problem Solver" in turn.messages[0]["content"] or "math problem" in turn.messages[0]["content"]
    assert interactions_to_trajectory(single).batch_size == 1
    assert len(grouped) == 3


@pytest.mark.parametrize("cls", ["MathAgent", "MathToolAgent"])
async def test_arealss_langchain_math_agent_file_runs_unchanged_single_and_grouped(hook, cls):
    from rollout_trio import interactions_to_trajectory
    from rollout_trio.agents import AgentRolloutWorkflow

    model, tok = tiny_model()
    model.config.max_position_embeddings = 4096  # the tool agent's six tools template long
    math_agent = importlib.import_module("areal.workflow.langchain.math_agent")
    assert Path(math_agent.__file__).is_relative_to(hook)  # AReaL's own file, not a copy
    wf = AgentRolloutWorkflow(getattr(math_agent, cls)(max_completion_tokens=6, temperature=1.0))
    async with LocalEngine(model, tok, seed=0) as engine:
        single = await wf.arun_episode(engine, DATA)
        grouped = await run_group(wf, engine, DATA, 3)
    assert single and all(t.interaction_id.startswith("chatcmpl-") for t in single.values())
    assert interactions_to_trajectory(single).batch_size == len(single)
    assert len(grouped) == 3


@pytest.mark.parametrize("cls", ["MathAgent", "MultiTurnMathAgent"])
async def test_arealss_openai_client_math_agent_file_runs_unchanged_single_and_grouped(hook, cls):
    """AReaL's ``workflow/openai/math_agent.py``: a plain ``AsyncOpenAI`` client on the
    http_client the endpoint hands it, its reward through AReaL's AsyncRewardWrapper."""
    from rollout_trio import interactions_to_trajectory
    from rollout_trio.agents import AgentRolloutWorkflow

    model, tok = tiny_model()
    math_agent = importlib.import_module("areal.workflow.openai.math_agent")
    assert Path(math_agent.__file__).is_relative_to(hook)  # AReaL's own file, not a copy
    kwargs = {"max_completion_tokens": 6, "temperature": 1.0}
    agent = getattr(math_agent, cls)(max_turns=2, **kwargs) if cls == "MultiTurnMathAgent" else math_agent.MathAgent(**kwargs)
    wf = AgentRolloutWorkflow(agent)
    async with LocalEngine(model, tok, seed=0) as engine:
        single = await wf.arun_episode(engine, DATA)
        grouped = await run_group(wf, engine, DATA, 3)
    assert single and all(t.interaction_id.startswith("chatcmpl-") for t in single.values())
    turns = 2 if cls == "MultiTurnMathAgent" else 1  # the tiny model never answers right: every turn runs
    assert len(single) == turns
    assert interactions_to_trajectory(single).batch_size == len(single)
    assert len(grouped) == 3 * turns  # each slot's interactions, kept


async def test_arealss_anthropic_math_agent_file_runs_unchanged_in_process_single_and_grouped(hook):
    """AReaL's ``workflow/anthropic/math_agent.py``: ``AsyncAnthropic(base_url=..., http_client=...)``
    with what the endpoint hands it. anthropic 2.16 takes only httpx2 clients: the agent's
    module uses only that SDK, so it gets one (it raised TypeError with the httpx client)."""
    from rollout_trio import interactions_to_trajectory
    from rollout_trio.agents import AgentRolloutWorkflow

    model, tok = tiny_model()
    math_agent = importlib.import_module("areal.workflow.anthropic.math_agent")
    assert Path(math_agent.__file__).is_relative_to(hook)  # AReaL's own file, not a copy
    wf = AgentRolloutWorkflow(math_agent.MathAgent(max_tokens=6))
    assert wf.http_library == "httpx2"
    data = {**DATA, "messages": [{"role": "system", "content": "Be brief."}, *DATA["messages"]]}
    async with LocalEngine(model, tok, seed=0) as engine:
        single = await wf.arun_episode(engine, data)
        grouped = await run_group(wf, engine, data, 3)
    [(key, turn)] = single.items()
    assert key.startswith("msg_") and turn.messages == data["messages"]  # its system prompt sent as Anthropic's ``system``
    assert interactions_to_trajectory(single).batch_size == 1
    assert len(grouped) == 3


def test_run_command_runs_arealss_rlvr_file_with_the_flag(areal_sources, capsys):
    from rollout_trio.cli import main

    try:
        assert main(["run", "--groups", "2", "--group-size", "2", "--max-new-tokens", "3", "--areal-compat", str(areal_sources)]) == 0
        assert sys.modules["areal.workflow.rlvr"].__file__.startswith(str(areal_sources))
    finally:
        compat.uninstall()
    out = capsys.readouterr().out
    assert "rollout/phase/reward_seconds" in out and out.count("rewards [") == 2  # its phases reached the stats


def test_run_command_names_a_directory_without_arealss_sources(tmp_path, capsys):
    from rollout_trio.cli import main

    assert main(["run", "--areal-compat", str(tmp_path)]) != 0
    assert "rlvr.py" in capsys.readouterr().err


AREAL_CLIENT_WORKFLOW = '''
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai import ArealOpenAI


class OneCallAgent(RolloutWorkflow):
    """Written as AReaL's docs write an ArealOpenAI workflow."""

    def __init__(self, tokenizer, turns=2):
        self.tokenizer = tokenizer
        self.turns = turns

    async def arun_episode(self, engine, data):
        client = ArealOpenAI(engine=engine, tokenizer=self.tokenizer, chat_template_type="concat")
        messages = list(data["messages"])
        for turn in range(self.turns):
            comp = await client.chat.completions.create(messages=messages, max_completion_tokens=4, temperature=1.0, store=True)
            seen = client.get_interaction(comp.id)
            assert isinstance(seen.model_response.output_tokens, list)  # AReaL's list-typed response
            client.set_reward(comp.id, float(len(seen.model_response.output_tokens)))
            messages += [{"role": "assistant", "content": comp.choices[0].message.content or ""},
                         {"role": "user", "content": "again"}]
        client.apply_reward_discount(turn_discount=0.5)
        return client.export_interactions(style="concat")
'''


async def test_an_arealopenai_workflow_runs_single_and_grouped_with_its_rows_checked(hook, model_and_tokenizer, tmp_path):
    """ArealOpenAI was a typed error: its chat.completions, get_interaction, set_reward,
    apply_reward_discount and export_interactions now run over the agent endpoint."""
    from rollout_trio.executor import open_executor

    model, tok = model_and_tokenizer
    (tmp_path / "areal_client_wf.py").write_text(AREAL_CLIENT_WORKFLOW)
    sys.path.insert(0, str(tmp_path))
    try:
        wf = importlib.import_module("areal_client_wf").OneCallAgent(tok)
    finally:
        sys.path.remove(str(tmp_path))
    async with LocalEngine(model, tok) as engine, open_executor(engine, max_head_offpolicyness=10) as ex:
        single = await ex.rollout_batch([DATA], wf)
        grouped = await ex.rollout_batch([DATA], wf, group_size=3)
    (one,) = single
    assert check_trajectory_format(one.to_dict(), batch_size=1)  # concat: the leaf of the conversation is one row
    (group,) = grouped
    assert check_trajectory_format(group.to_dict(), batch_size=3)


async def test_arealopenai_refuses_what_it_does_not_serve(hook, model_and_tokenizer):
    from areal.experimental.openai import ArealOpenAI

    model, tok = model_and_tokenizer
    async with LocalEngine(model, tok) as engine:
        with pytest.raises(compat.ArealCompatError, match="lora_name"):
            ArealOpenAI(engine=engine, tokenizer=tok, lora_name="adapter")
        with pytest.raises(compat.ArealCompatError, match="tool_call_parser"):
            ArealOpenAI(engine=engine, tokenizer=tok, tool_call_parser="hermes")
        client = ArealOpenAI(engine=engine, tokenizer=tok)
        with pytest.raises(KeyError, match="not found"):
            client.set_reward("chatcmpl-missing", 1.0)
        with pytest.raises(RuntimeError, match="No interaction"):
            client.set_last_reward(1.0)
