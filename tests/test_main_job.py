"""The main job: the RLVR workflow and `rollout-trio run` on the embedded engine."""

import subprocess
import sys

import pytest

from rollout_trio import GenerationConfig, Trajectory, run_group
from rollout_trio.workflows import arithmetic_prompts, arithmetic_reward
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.workflow_context import StatsRecorder
from rollout_trio.workflows import rlvr_workflow

from . import warm_cli


@pytest.mark.parametrize(
    ("text", "answer", "reward"),
    [("7", 7, 1.0), (" 7<|im_end|>", 7, 1.0), ("9", 7, 0.8), ("17", 7, 0.0), ("abc", 3, 0.0), ("", 3, 0.0)],
)
def test_arithmetic_reward(text, answer, reward):
    assert arithmetic_reward(text, {"answer": answer}) == pytest.approx(reward)


def test_arithmetic_prompts_are_seeded_single_digit_sums():
    a, b = arithmetic_prompts(20, seed=3), arithmetic_prompts(20, seed=3)
    assert a == b and a != arithmetic_prompts(20, seed=4)
    for item in a:
        x, y = map(int, item["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split("+"))
        assert x + y == item["answer"] < 10


class CountingTokenizer:
    """The tiny tokenizer, counting chat-template calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def apply_chat_template(self, *a, **kw):
        self.calls += 1
        return self.tok.apply_chat_template(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


async def test_rlvr_group_tokenizes_once_and_scores_each_completion():
    model, tok = tiny_model(seed=0)
    counting = CountingTokenizer(tok)
    seen = []

    def reward(text, data):
        seen.append(text)
        return arithmetic_reward(text, data)

    wf = rlvr_workflow(counting, reward, GenerationConfig(max_new_tokens=6))
    data = arithmetic_prompts(1)[0]
    async with LocalEngine(model, tok, seed=1) as engine:
        out = await run_group(wf, engine, data, 4, stats=StatsRecorder())
    assert isinstance(out, Trajectory) and out.batch_size == 4
    assert counting.calls == 1  # the group's slots share the processor cache
    assert sorted(out.rewards.tolist()) == pytest.approx(sorted(arithmetic_reward(t, data) for t in seen))
    assert out.is_truncated is not None and out.loss_mask.sum() > 0


def run_cli(*args, timeout=120):
    """``python -m rollout_trio ARGS``, forked from the warm CLI (tests/warm_cli.py)."""
    return warm_cli.run(
        [sys.executable, "-m", "rollout_trio", *args], capture_output=True, text=True, timeout=timeout
    )


def test_run_command_prints_rewards_and_group_statistics():
    proc = run_cli("run", "--groups", "3", "--group-size", "4", "--reward-normalization")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum("rewards [" in line for line in lines) == 3
    assert "rollout/usable_slot_count                4.000" in proc.stdout
    assert "12 episodes in" in proc.stdout


def test_run_command_rejects_bad_arguments():
    proc = run_cli("run", "--group-size", "0")
    assert proc.returncode == 2 and "--group-size: must be an integer >= 1" in proc.stderr
    assert run_cli("nope").returncode == 2
