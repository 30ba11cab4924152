"""The reward process is a boundary (issue 34 item 1): whatever a process reward does, its call
ends within its deadline with its honest value or a typed error for that call only, nothing
it started outlives it, no byte it sends is unpickled here, and later calls are unaffected."""

import os

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_trio.agents import AgentRolloutWorkflow
from rollout_trio.rewards import RewardError, RewardFunction, RewardResourceError, RewardTimeoutError, RewardWorkerError
from rollout_trio.testing import ScriptedEngine

from . import agent_subproc_agents as subproc_agents
from . import hostile_rewards
from .agent_helpers import TOKENIZER
from .process_helpers import wait_dead

GUARD = 120  # liveness guard: every wait below ends well before it


def pids_in(path):
    return [int(p) for p in path.read_text().split()]


async def test_a_child_holding_the_pipes_does_not_stretch_the_call():
    """(a) before: a call that timed out lasted as long as its child holding the pipes."""
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=3) as reward:
        with trio.fail_after(GUARD):
            assert await reward(1.5, "fork_holding_pipes", 1000) == 1.5
            with pytest.raises(RewardTimeoutError):
                await reward(1.5, "fork_holding_pipes_and_hang", 1000)
            assert await reward(2.5, "honest") == 2.5


async def test_a_pickled_none_on_the_reply_pipe_is_that_calls_typed_error():
    """(b) before: trio-parallel read it as its exit marker and the call hung forever."""
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30) as reward:
        with trio.fail_after(GUARD):
            try:
                assert await reward(1.0, "pickled_none") == 1.0
            except RewardWorkerError as exc:
                assert "could not be read" in str(exc)
            assert await reward(2.0, "honest") == 2.0


@pytest.mark.parametrize("behaviour", ["pickle_exec", "write_pickle_exec"])
async def test_nothing_a_reward_sends_is_unpickled_here(tmp_path, behaviour):
    """(c) before: the trainer unpickled the reward's object and ran its ``exec``."""
    marker = tmp_path / "pwned"
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30) as reward:
        with trio.fail_after(GUARD):
            try:
                assert await reward(1.0, behaviour, str(marker)) == 1.0
            except RewardWorkerError as exc:
                assert "JSON-like" in str(exc) or "could not be read" in str(exc)
            assert await reward(2.0, "honest") == 2.0
    assert not marker.exists()


async def test_trusted_worker_pickles_are_unpickled_as_the_signature_says(tmp_path):
    """The opt-in: with ``trust_worker_pickles=True`` a value crosses as a pickle."""
    marker = tmp_path / "pwned"
    async with RewardFunction(
        hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30, trust_worker_pickles=True
    ) as reward:
        with trio.fail_after(GUARD):
            await reward(1.0, "pickle_exec", str(marker))
    assert marker.exists()


async def test_a_thread_reading_the_command_pipe_never_answers_later_calls():
    """(d) before: three later calls returned the thread's 666.0."""
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30) as reward:
        with trio.fail_after(GUARD):
            try:
                assert await reward(1.0, "forger_thread") in (1.0, 666.0)  # its own call: its own code
            except RewardWorkerError:
                pass
            assert [await reward(float(i), "honest") for i in range(3)] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("behaviour", ["sys_exit", "keyboard_interrupt", "os_exit"])
async def test_a_base_exception_in_a_worker_fails_that_call_only(behaviour):
    """(e) before: SystemExit / KeyboardInterrupt came out of the call and ended the run."""
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30) as reward:
        with trio.fail_after(GUARD):
            with pytest.raises(RewardWorkerError):
                await reward(1.0, behaviour)
            assert await reward(2.0, "honest") == 2.0


@pytest.mark.parametrize("behaviour", ["sys_exit", "keyboard_interrupt"])
async def test_a_base_exception_in_a_reward_thread_fails_that_call_only(behaviour):
    """(e), thread isolation: before, the BaseException came out of ``await reward(...)``."""
    reward = RewardFunction(hostile_rewards.hostile, max_workers=1, timeout=30)
    with trio.fail_after(GUARD), pytest.raises(RewardWorkerError, match="the run goes on"):
        await reward(1.0, behaviour)
    assert await reward(2.0, "honest") == 2.0


@pytest.mark.parametrize("behaviour", ["setsid_child", "daemon"])
async def test_setsid_children_and_daemons_of_a_reward_die_with_its_call(tmp_path, behaviour):
    """(f) before: a ``setsid`` child (or a double-forked daemon) outlived the call and the pool."""
    pid_file = tmp_path / "pids"
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30) as reward:
        with trio.fail_after(GUARD):
            assert await reward(1.0, behaviour, str(pid_file)) == 1.0
        for pid in pids_in(pid_file):
            await wait_dead(pid)


async def test_a_setsid_child_of_a_subprocess_agent_dies_with_its_episode(tmp_path):
    """(f), subprocess agents: before, the agent's ``setsid`` child outlived the episode."""
    engine = ScriptedEngine()
    engine.tokenizer = TOKENIZER
    pid_file = tmp_path / "child"
    wf = AgentRolloutWorkflow(subproc_agents.SetsidSpawningAgent(), mode="subproc")
    with trio.fail_after(GUARD):
        await wf.arun_episode(engine, {"messages": [], "pid_file": str(pid_file)})
    await wait_dead(int(pid_file.read_text()))


async def test_workers_are_ready_at_async_with(monkeypatch):
    """(g) before: no worker ran until the first call, which paid its start-up."""
    async with RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=2) as reward:
        assert len(reward.worker_pids) == 2


async def test_a_calls_timeout_counts_from_its_start_on_a_ready_worker(monkeypatch):
    """(g) a verifier whose import takes longer than the timeout: the first call, and the first
    after a kill, get their value (before: both paid the import inside their timeout)."""
    monkeypatch.setenv("ROLLOUT_TRIO_TEST_IMPORT_S", "8")
    async with RewardFunction("tests.slow_import_reward.score", isolation="process", max_workers=1, timeout=4) as reward:
        with trio.fail_after(GUARD):
            assert await reward(3) == 6
            with pytest.raises(RewardTimeoutError):
                await reward(0, hang=True)
            assert await reward(5) == 10


def test_a_reward_built_outside_trio_starts_its_pool_on_the_first_call():
    """For wrappers (AReaL's AsyncRewardWrapper): no Trio object at construction, a lazy pool
    on the first call without ``async with``, a fresh one in a later Trio run (before:
    RuntimeError "use it inside `async with`")."""
    reward = RewardFunction(hostile_rewards.hostile, isolation="process", max_workers=1, timeout=30)

    async def use(value):
        with trio.fail_after(GUARD):
            return await reward(value, "honest")

    assert trio.run(use, 1.0) == 1.0
    assert trio.run(use, 2.0) == 2.0

    async def close():
        await reward.aclose()

    trio.run(close)


@pytest.mark.parametrize("limit", ["address_space", "cpu_seconds", "open_files"])
async def test_resource_limits_are_typed_errors(limit):
    value = {"address_space": 1 << 30, "cpu_seconds": 1, "open_files": 64}[limit]
    async with RewardFunction(
        hostile_rewards.greedy, isolation="process", max_workers=1, timeout=60, limits={limit: value}
    ) as reward:
        with trio.fail_after(GUARD), pytest.raises(RewardResourceError, match=limit):
            await reward(limit)


def test_limits_name_the_field():
    with pytest.raises(ValueError, match="limits: unknown limit 'memory'"):
        RewardFunction(hostile_rewards.hostile, isolation="process", limits={"memory": 1})
    with pytest.raises(ValueError, match=r"limits\['cpu_seconds'\]"):
        RewardFunction(hostile_rewards.hostile, isolation="process", limits={"cpu_seconds": 0})


QUICK = ["honest", "fork_holding_pipes", "fork_holding_pipes_and_hang", "pickled_none", "forger_thread", "sys_exit", "keyboard_interrupt",
         "os_exit", "huge", "not_json", "pickle_exec", "write_pickle_exec", "setsid_child", "daemon", "sleep"]  # fmt: skip
TIMEOUT = 5.0


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(QUICK), min_size=1, max_size=4), st.integers(1, 2))
def test_every_hostile_call_ends_in_its_deadline_with_its_value_or_its_own_typed_error(tmp_path_factory, behaviours, workers):
    """Property: for any sequence of hostile behaviours on a pool of 1-2 workers, each call ends
    within its timeout (plus the guard) with its honest value or a RewardError; no marker is
    written here by an unpickled value, nothing a call started lives on, and an honest call
    after each one gets its own value."""
    tmp = tmp_path_factory.mktemp("hostile")
    marker, pid_file = tmp / "pwned", tmp / "pids"
    args = {"fork_holding_pipes": 1000, "fork_holding_pipes_and_hang": 1000, "sleep": 1000, "huge": 64 << 20, "pickle_exec": str(marker),
            "write_pickle_exec": str(marker), "setsid_child": str(pid_file), "daemon": str(pid_file)}  # fmt: skip

    async def main():
        async with RewardFunction(
            hostile_rewards.hostile, isolation="process", max_workers=workers, timeout=TIMEOUT
        ) as reward:
            for i, behaviour in enumerate(behaviours):
                with trio.fail_after(GUARD):
                    try:
                        assert await reward(float(i), behaviour, args.get(behaviour)) == float(i)
                    except RewardError:
                        pass
                    assert await reward(i + 0.5, "honest") == i + 0.5
                if pid_file.exists():
                    for pid in pids_in(pid_file):
                        await wait_dead(pid)

    trio.run(main)
    assert not marker.exists()
