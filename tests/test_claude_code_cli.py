"""The Claude Code CLI against the agent endpoint served on loopback (issue 29).

The CLI is pointed at the endpoint through ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY``
(the session key), as a user points it at any Anthropic-compatible server. It streams
``POST /v1/messages?beta=true`` with system blocks carrying ``cache_control``, ``thinking``,
``context_management``, ``output_config`` and a mid-conversation ``system`` message; the
endpoint answers in Anthropic's shapes and records each completion.

Two ways in, each skipping with the reason when its part is missing:
- the CLI itself (``claude -p``), from npm (``.ci/run`` installs it) or bundled with
  ``claude-agent-sdk``;
- AReaL's ``workflow/anthropic/claude_math_agent.py`` (1.0.4 and main hold the same file),
  unchanged from the wheel: ``claude_agent_sdk`` starts the CLI, whose calculator tools are an
  in-process MCP server of the agent. It runs in subprocess mode, where the endpoint is served
  on 127.0.0.1 (inline mode hands the agent an in-process URL, which a CLI in a process of its
  own cannot reach).
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

import pytest
import trio

from rollout_trio import ModelResponse, check_trajectory_format, run_group, workflow_context
from rollout_trio.agents import AgentRolloutWorkflow, OpenAIEndpoint, serve_app
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import WorkflowContext
from tests.agent_helpers import IM_END, TOKENIZER, text_tokens
from tests.test_areal_compat import areal_sources  # noqa: F401  (the fixture)

#: Where .ci/run installs the CLI with npm (``npm install --prefix`` there).
CI_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollout-trio" / "claude-code"
DATA = {"messages": [{"role": "user", "content": "What is 1+2?"}], "answer": "3"}
CALL = '<tool_call>\n{"name": "mcp__calc__add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
#: What keeps the CLI off the network besides the endpoint: no telemetry, error reports or updates.
QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
         "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1"}  # fmt: skip


def claude_cli() -> str:
    """The CLI's path: $ROLLOUT_TRIO_CLAUDE_CLI, ``claude`` on PATH, .ci/run's npm cache, or claude-agent-sdk's bundle."""
    candidates = [os.environ.get("ROLLOUT_TRIO_CLAUDE_CLI"), shutil.which("claude"), str(CI_CACHE / "node_modules" / ".bin" / "claude")]
    try:
        import claude_agent_sdk

        candidates.append(str(Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"))
    except ImportError:
        pass
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("the Claude Code CLI is not installed: no `claude` on PATH, in .ci/run's npm cache "
                f"({CI_CACHE}) or bundled with claude-agent-sdk (npm install -g @anthropic-ai/claude-code)")  # fmt: skip


def needs_claude_agent_sdk() -> None:
    try:
        import claude_agent_sdk  # noqa: F401
    except ImportError:
        pytest.skip("claude-agent-sdk is not installed (the test extra has it): AReaL's claude_math_agent imports it")


async def test_claude_print_mode_completes_a_turn_on_the_loopback_endpoint(tmp_path):
    cli = claude_cli()
    model, tok = tiny_model()
    async with LocalEngine(model, tok, seed=0) as engine:
        ep = OpenAIEndpoint(engine)
        async with trio.open_nursery() as nursery:
            base_url = await nursery.start(serve_app, ep.app)
            with ep.session() as s:
                env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "CLAUDE_CONFIG_DIR": str(tmp_path / ".claude"),
                       "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": s.key, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8", **QUIET}  # fmt: skip
                # --bare and a short system prompt without tools: the CLI's own prompt (~78k
                # characters) is past the tiny model's context.
                argv = [cli, "-p", "What is 2+3?", "--bare", "--system-prompt", "Answer briefly.", "--tools", ""]
                done = await trio.run_process(argv, env=env, cwd=tmp_path, capture_stdout=True, capture_stderr=True, check=False)
            nursery.cancel_scope.cancel()
    assert done.returncode == 0, (done.stdout.decode()[-2000:], done.stderr.decode()[-2000:])
    [turn] = s.interactions.values()
    system, user = turn.messages[0], [m for m in turn.messages if m["role"] == "user"][-1]
    # (later CLIs add a mid-conversation system message after the user's: its environment)
    assert system["role"] == "system" and "Answer briefly." in system["content"]
    assert "What is 2+3?" in user["content"]
    out = turn.model_response
    assert out.output_len > 0 and len(out.output_logprobs) == len(out.output_versions) == out.output_len
    assert done.stdout.decode().strip() == turn.output_message_list[0]["content"].strip()


class ClaudeMathAgentInChild:
    """AReaL's ``MathToolAgent``, built in the agent's child process under the compat hook.

    The child is a fresh interpreter without the parent's import hook, so the agent is named
    by its module here and imported there from the wheel's own file (unchanged).
    """

    def __init__(self, sources: Path, workdir: Path, **kwargs: object) -> None:
        self.sources, self.workdir, self.kwargs = sources, workdir, kwargs

    async def run(self, data: dict) -> float:
        from rollout_trio.compat import areal as compat

        assert compat.install(self.sources)
        module = importlib.import_module("areal.workflow.anthropic.claude_math_agent")
        assert Path(module.__file__).is_relative_to(self.sources)  # AReaL's own file, not a copy
        # The CLI's config and cwd: a directory of its own, not the repository or ~/.claude.
        os.environ["CLAUDE_CONFIG_DIR"] = str(self.workdir / ".claude")
        os.chdir(self.workdir)
        return await module.MathToolAgent(**self.kwargs).run(data)


def calculator_engine() -> ScriptedEngine:
    """Calls the CLI's ``mcp__calc__add`` tool, then answers 3 once the tool result is in the prompt."""

    def script(req):
        answered = "<tool_response>" in TOKENIZER.decode(req.input_ids)
        out = [*text_tokens("3" if answered else CALL), IM_END]
        n = len(out)
        return ModelResponse(input_tokens=req.input_ids, output_tokens=out, output_logprobs=[-0.5] * n,
                             output_versions=[2] * n, stop_reason="stop")  # fmt: skip

    engine = ScriptedEngine(script)
    engine.tokenizer = TOKENIZER
    return engine


async def test_arealss_claude_math_agent_file_drives_the_cli_through_a_tool_call(areal_sources, tmp_path):  # noqa: F811
    needs_claude_agent_sdk()
    wf = AgentRolloutWorkflow(ClaudeMathAgentInChild(areal_sources, tmp_path, max_turns=4), mode="subproc",
                              subproc_backend="asyncio")  # fmt: skip
    with workflow_context.use(WorkflowContext(task_id=0)):
        result = await wf.arun_episode(calculator_engine(), DATA)
    assert result is not None
    call, answer = result.values()
    assert call.output_message_list[0]["tool_calls"][0]["function"]["name"] == "mcp__calc__add"
    # The CLI ran AReaL's calculator tool (in the agent's process) and sent its result back.
    assert answer.messages[-1]["role"] == "tool" and answer.messages[-1]["content"] == "3"  # add(1, 2)
    assert answer.messages[-2]["tool_calls"][0]["id"] == call.output_message_list[0]["tool_calls"][0]["id"]
    assert answer.output_message_list[0]["content"] == "3"
    assert call.reward == answer.reward == 1.0  # AReaL's math_verify reward of the CLI's final text
    assert set(answer.model_response.output_versions) == {2}


async def test_arealss_claude_math_agent_file_runs_grouped_on_local_engine(areal_sources, tmp_path):  # noqa: F811
    needs_claude_agent_sdk()
    model, tok = tiny_model()
    model.config.max_position_embeddings = 8192  # the CLI's system prompt and six tools: ~3.9k tokens
    wf = AgentRolloutWorkflow(ClaudeMathAgentInChild(areal_sources, tmp_path, max_turns=2), mode="subproc",
                              subproc_backend="asyncio")  # fmt: skip
    async with LocalEngine(model, tok, seed=0) as engine:
        with workflow_context.use(WorkflowContext(task_id=0)):
            grouped = await run_group(wf, engine, DATA, 2)
    grouped = grouped.to_dict() if hasattr(grouped, "to_dict") else grouped
    # One completion per episode: the tiny model answers digits and calls no tool.
    assert check_trajectory_format(grouped, batch_size=2)
