"""ReplayEngine and `rollout-trio replay`: re-running dumped episodes without a model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
import trio.testing

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, run_group, workflow_context
from rollout_trio.cli import main
from rollout_trio.cli._replay import replay_main
from rollout_trio.workflows import arithmetic_reward
from rollout_trio.engines import InferenceEngine, ReplayEngine, ReplayMismatchError
from rollout_trio.executor import TrajectoryDumper, read_dump
from rollout_trio.models import byte_tokenizer
from rollout_trio.workflow_context import StatsRecorder, WorkflowContext
from rollout_trio.workflows import rlvr_workflow

from .dump_helpers import MAX_NEW_TOKENS, write_dump_sync


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dump")
    write_dump_sync(root, groups=5, group_size=3, versions=2, normalize=True)
    return root


def strict_reward_workflow(tokenizer):
    """A factory for --workflow: the main job's workflow with all-or-nothing rewards."""
    return rlvr_workflow(tokenizer, lambda text, data: float(arithmetic_reward(text, data) == 1.0), GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))


async def chat_prefix_workflow(engine, data):
    """A workflow whose prompt differs from the main job's (a system message)."""
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, *data["messages"]]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    resp = await engine.agenerate(ModelRequest(input_ids=list(ids)))
    return Trajectory.from_response(resp, 0.0)


def ctrl_c_on_the_third_task(tokenizer):
    """A factory for --workflow: the main job's workflow, until the third task starts; there,
    Ctrl-C arrives (the process signals itself) and the episode would never end."""
    inner = rlvr_workflow(tokenizer, arithmetic_reward, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))

    async def workflow(engine, data):
        if workflow_context.get().task_id == 2:
            signal.raise_signal(signal.SIGINT)
            await trio.sleep_forever()
        return await inner(engine, data)

    return workflow


def test_replay_engine_is_an_inference_engine():
    assert isinstance(ReplayEngine([]), InferenceEngine)


# ---------------------------------------------------------------- the command


def test_main_job_dump_reproduces(dump_dir, capsys):
    assert main(["replay", str(dump_dir), "--max-new-tokens", str(MAX_NEW_TOKENS)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[:5]] == [["task", str(k)] for k in range(5)]
    assert all(line.endswith("3 rows reproduce") for line in out[:5])
    assert out[-1] == "5 tasks replayed: 5 reproduce, 0 differ"


def test_ctrl_c_prints_the_tasks_replayed_so_far_and_exits_130(dump_dir, capsys):
    argv = ["replay", str(dump_dir), "--workflow", "tests.test_replay:ctrl_c_on_the_third_task"]
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert [line.split()[:2] for line in out.splitlines()[:2]] == [["task", "0"], ["task", "1"]], out
    assert out.splitlines()[-1] == "2 tasks replayed: 2 reproduce, 0 differ, 3 not replayed (interrupted)"
    assert err == "interrupted: stopping; the tasks replayed so far follow\n"


def test_a_workflow_module_in_the_current_directory_is_found(dump_dir, tmp_path):
    """As for ``python -m``, though the console script's sys.path lacks the current directory."""
    (tmp_path / "my_workflow.py").write_text(
        "from rollout_trio import GenerationConfig\n"
        "from rollout_trio.workflows import arithmetic_reward, rlvr_workflow\n\n"
        "def factory(tokenizer):\n"
        f"    return rlvr_workflow(tokenizer, arithmetic_reward, GenerationConfig(max_new_tokens={MAX_NEW_TOKENS}))\n"
    )
    root = Path(__file__).resolve().parent.parent
    # -P: no current directory on sys.path, as under the `rollout-trio` console script
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "rollout_trio", "replay", str(dump_dir), "--workflow", "my_workflow:factory", "--task", "0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(root)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "1 tasks replayed: 1 reproduce, 0 differ"


def test_a_changed_reward_function_is_reported_per_row(dump_dir, capsys):
    records = read_dump(dump_dir)
    assert replay_main([str(dump_dir), "--workflow", "tests.test_replay:strict_reward_workflow", "--task", "0", "--task", "1"]) == 1
    out = capsys.readouterr().out
    partial = [r for r in records if r.task_id in (0, 1) and r.raw_reward not in (0.0, 1.0)]
    assert partial, "the tiny model's dump should hold some partial-credit rewards"
    for r in partial:
        assert f"row #{r.sample_idx}: reward 0 vs dumped {r.raw_reward:.6g}" in out
    assert out.splitlines()[-1].startswith("2 tasks replayed:") and "DIFFERS" in out


def test_a_different_prompt_names_the_task_and_where_it_parts(dump_dir, capsys):
    assert replay_main([str(dump_dir), "--workflow", "tests.test_replay:chat_prefix_workflow", "--task", "2"]) == 1
    out = capsys.readouterr().out
    assert "task 2" in out and "DIFFERS" in out
    assert "prompt matches nothing left in task 2: no recorded prompt is equal" in out
    # They share only '<|im_start|>'; the message shows both sides from there.
    assert "differs from token 1 on: request 'system\\nBe br' vs recorded 'user\\nWhat is'" in out


def test_other_data_is_a_mismatch(dump_dir, capsys):
    assert replay_main([str(dump_dir), "--seed", "1", "--task", "0"]) == 1
    assert "prompt matches nothing left in task 0" in capsys.readouterr().out


def test_data_from_a_file(dump_dir, tmp_path, capsys):
    from rollout_trio.workflows import arithmetic_prompts

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in arithmetic_prompts(5)))
    assert replay_main([str(dump_dir), "--data", str(data), "--max-new-tokens", str(MAX_NEW_TOKENS)]) == 0
    short = tmp_path / "short.json"
    short.write_text(json.dumps(arithmetic_prompts(2)))
    assert replay_main([str(dump_dir), "--data", str(short), "--max-new-tokens", str(MAX_NEW_TOKENS)]) == 1
    out = capsys.readouterr().out
    assert "    --data has 2 items; task 2 has none" in out
    assert out.splitlines()[-1] == "5 tasks replayed: 2 reproduce, 3 differ"  # the tasks with data still ran


def test_usage_and_runtime_errors_are_one_line(dump_dir, tmp_path, capsys):
    assert replay_main([]) == 2
    assert replay_main([str(dump_dir), "--workflow", "no_colon"]) == 2
    assert replay_main([str(tmp_path / "missing")]) == 1
    assert replay_main([str(dump_dir), "--task", "99"]) == 1
    assert replay_main([str(dump_dir), "--workflow", "no_such_module_xyz:wf"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and all(line.startswith("rollout-trio replay: ") for line in err)
    assert "MODULE:NAME" in err[1] and "does not exist" in err[2] and "[99] are not in the dump" in err[3]


# ---------------------------------------------------------------- the engine


def multi_turn_trajectory() -> Trajectory:
    """Prompt [1,2], turn one [3,4] at v5, feedback [9], turn two [5,6] at v6; then a second row."""
    return Trajectory(
        input_ids=torch.tensor([[1, 2, 3, 4, 9, 5, 6], [1, 2, 7, 0, 0, 0, 0]]),
        attention_mask=torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]]),
        loss_mask=torch.tensor([[0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 0, 0, 0, 0]]),
        logprobs=torch.tensor([[0, 0, -0.5, -0.25, 0, -1.0, -2.0], [0, 0, -3.0, 0, 0, 0, 0]]),
        versions=torch.tensor([[-1, -1, 5, 5, -1, 6, 6], [-1, -1, 6, -1, -1, -1, -1]]),
        rewards=torch.tensor([1.0, 0.0]),
        is_truncated=torch.tensor([False, True]),
    )


class Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


async def dump_records(tmp_path, traj, task_id=7, is_eval=False):
    async with TrajectoryDumper(tmp_path, "e", "t", Tok()) as dumper:
        await dumper.dump(traj, task_id=task_id, is_eval=is_eval)
    return read_dump(tmp_path)


async def test_multi_turn_rows_answer_their_turns_in_order(tmp_path):
    engine = ReplayEngine(await dump_records(tmp_path, multi_turn_trajectory()))
    assert engine.get_version() == 6 and engine.remaining() == 3
    async with engine:
        with workflow_context.use(WorkflowContext(task_id=7)):
            first = await engine.agenerate(ModelRequest(input_ids=[1, 2]))
            second = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4, 9]))
            third = await engine.agenerate(ModelRequest(input_ids=[1, 2]))  # the second row, same prompt
    assert (first.output_tokens, first.output_logprobs, first.output_versions) == ((3, 4), (-0.5, -0.25), (5, 5))
    assert (second.output_tokens, second.output_versions, second.stop_reason) == ((5, 6), (6, 6), "stop")
    assert (third.output_tokens, third.output_logprobs, third.stop_reason) == ((7,), (-3.0,), "length")
    assert engine.remaining() == 0 and engine.answered == 3


async def test_a_used_up_or_unknown_prompt_is_a_typed_error_naming_the_task(tmp_path):
    engine = ReplayEngine(await dump_records(tmp_path, multi_turn_trajectory()), tokenizer=Tok())
    with workflow_context.use(WorkflowContext(task_id=7)):
        await engine.agenerate(ModelRequest(input_ids=[1, 2]))
        await engine.agenerate(ModelRequest(input_ids=[1, 2]))
        with pytest.raises(ReplayMismatchError, match=r"task 7: its recorded generations are all used") as used:
            await engine.agenerate(ModelRequest(input_ids=[1, 2]))
        with pytest.raises(ReplayMismatchError, match=r"task 7: no recorded prompt is equal .*differs from token 2 on: request '8 8' vs recorded '3 4 9'"):
            await engine.agenerate(ModelRequest(input_ids=[1, 2, 8, 8]))
    assert used.value.tasks == [(False, 7)] and used.value.prompt == (1, 2)
    assert isinstance(used.value, LookupError)
    with workflow_context.use(WorkflowContext(task_id=8)), pytest.raises(ReplayMismatchError, match=r"task 8 is not in the dump \(it holds task 7\)"):
        await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4, 9]))
    with workflow_context.use(WorkflowContext(task_id=7, is_eval=True)), pytest.raises(ReplayMismatchError, match="eval task 7"):
        await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4, 9]))


async def test_without_a_task_in_context_every_task_is_searched(tmp_path):
    await dump_records(tmp_path, multi_turn_trajectory(), task_id=1)
    records = await dump_records(tmp_path, multi_turn_trajectory(), task_id=2, is_eval=True)
    engine = ReplayEngine(records)
    assert engine.tasks == [(False, 1), (True, 2)] and engine.rows((True, 2)) == 2
    answers = [await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4, 9])) for _ in range(2)]
    assert [a.output_tokens for a in answers] == [(5, 6), (5, 6)]
    assert engine.remaining((False, 1)) == engine.remaining((True, 2)) == 2
    with pytest.raises(ReplayMismatchError, match=r"task 1, eval task 2"):
        await engine.agenerate(ModelRequest(input_ids=[1, 2, 3, 4, 9]))


def test_records_without_tokens_are_refused(tmp_path):
    d = tmp_path / "rollout" / "0"
    d.mkdir(parents=True)
    line = {"task_id": 3, "sample_idx": 1, "seqlen": 2, "prompt_len": 1, "head_version": 0, "tail_version": 0,
            "version_rle": [[0, 1]], "reward": 1.0, "prompt": "a", "completion": "b"}  # an AReaL dump line
    (d / "3.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match="task 3 row 1 has no 'tokens'"):
        ReplayEngine.from_dump(tmp_path, read=read_dump)


async def test_pause_holds_answers_until_resume(tmp_path):
    engine = ReplayEngine(await dump_records(tmp_path, multi_turn_trajectory()))
    got = []

    async def ask():
        got.append(await engine.agenerate(ModelRequest(input_ids=[1, 2])))

    await engine.pause()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [] and engine.answered == 0
        await engine.resume()
    assert [g.output_tokens for g in got] == [(3, 4)]


async def test_a_group_on_the_replay_engine_rebuilds_the_dumped_rows(dump_dir):
    """A trainer-side re-run: the same group through run_group gives the dumped rows back."""
    records = [r for r in read_dump(dump_dir) if r.task_id == 3]
    tok = byte_tokenizer()
    from rollout_trio.workflows import arithmetic_prompts

    workflow = rlvr_workflow(tok, arithmetic_reward, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))
    async with ReplayEngine(records) as engine:
        with workflow_context.use(WorkflowContext(task_id=3)):
            traj = await run_group(workflow, engine, arithmetic_prompts(5)[3], 3, stats=StatsRecorder(), reward_normalization=True)
    assert traj is not None and engine.remaining() == 0
    # Normalization ran again over the same raw rewards: the normalized ones come back too.
    got = sorted((traj.input_ids[i][traj.attention_mask[i]].tolist(), traj.original_rewards[i].item(), traj.rewards[i].item()) for i in range(3))
    want = sorted((list(r.tokens.input_ids), r.original_reward, r.reward) for r in records)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[1:] for g in got] == [pytest.approx(w[1:]) for w in want]
