"""Process isolation as a user meets it: a subprocess agent's children die with it, and a
script's ``__main__`` functions run in reward worker processes (spec/executor.md §8-9)."""

import os
import subprocess
import sys

import trio

from rollout_trio.agents import AgentRolloutWorkflow
from rollout_trio.testing import ScriptedEngine

from . import agent_subproc_agents as subproc_agents
from .agent_helpers import TOKENIZER
from .process_helpers import wait_dead

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}


async def test_cancelling_a_subprocess_agent_kills_its_children_too(tmp_path):
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    pid_file = tmp_path / "child"
    wf = AgentRolloutWorkflow(subproc_agents.SpawningAgent(), mode="subproc")
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(wf.arun_episode, engine, {**QUESTION, "pid_file": str(pid_file)})
            while not engine.in_flight:
                await trio.sleep(0.01)
            n.cancel_scope.cancel()
    await wait_dead(int(pid_file.read_text()))


SCRIPT = """
import os
import trio
from rollout_trio.rewards import RewardFunction

def square_and_pid(x):
    return x * x, os.getpid()

async def main():
    async with RewardFunction(square_and_pid, isolation="process", max_workers=1, timeout=60) as reward:
        value, pid = await reward(7)
        print(value, pid != os.getpid())
"""


def run_script(tmp_path, text):
    script = tmp_path / "train.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_a_scripts_main_functions_run_in_reward_worker_processes(tmp_path):
    """As with the standard library's process pools (before: TypeError at construction)."""
    out = run_script(tmp_path, SCRIPT + '\nif __name__ == "__main__":\n    trio.run(main)\n')
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["49", "True"]


def test_a_script_without_a_main_guard_gets_a_typed_error_that_says_so(tmp_path):
    """Workers import the script as multiprocessing does; unguarded, the worker cannot start."""
    out = run_script(tmp_path, SCRIPT + "\ntrio.run(main)\n")
    assert out.returncode == 1
    assert "RewardWorkerError" in out.stderr and "must guard its entry point" in out.stderr
