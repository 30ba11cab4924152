"""RewardFunction: threads behind a limiter, killable worker processes (spec/executor.md §9)."""

import os
import threading

import pytest
import trio

from rollout_trio.rewards import (
    RewardFunction,
    RewardStatistics,
    RewardThreadsExhaustedWarning,
    RewardTimeoutError,
    RewardWorkerError,
)

from . import reward_fns
from .process_helpers import wait_dead


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ------------------------------------------------------------------ threads


async def test_thread_rewards_compute_off_the_event_loop():
    reward = RewardFunction(reward_fns.add, max_workers=1)
    assert await reward(3.0, 4.0) == 7.0
    assert [await reward(i, 1.0) for i in range(5)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    caller = threading.get_ident()
    assert await RewardFunction(lambda: threading.get_ident())() != caller


async def test_thread_rewards_share_a_capacity_limiter():
    """Six calls of a two-thread reward: once every call is either running or queued on
    the limiter (state, polled), exactly two run; the others start as those finish."""
    running, peak = 0, 0
    lock = threading.Lock()
    go = threading.Event()

    def held(_):
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        assert go.wait(timeout=30), "never released"
        with lock:
            running -= 1
        return 1.0

    reward = RewardFunction(held, max_workers=2)
    limiter = reward._limiter
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(reward, i)
            while True:  # every call arrived: in a thread (counted) or waiting for one
                stats = limiter.statistics()
                with lock:
                    arrived = running == stats.borrowed_tokens and running + stats.tasks_waiting == 6
                if arrived:
                    break
                await trio.sleep(0.001)
            with lock:
                assert running == 2
            go.set()
    assert peak == 2


async def test_async_reward_timeout_raises_or_returns_timeout_reward(autojump_clock):
    calls = 0

    async def slow():
        nonlocal calls
        calls += 1
        await trio.sleep(100)

    with pytest.raises(RewardTimeoutError, match="timed out after 1.0 s on all 2 attempt"):
        await RewardFunction(slow, timeout=1, retries=1)()
    assert calls == 2
    assert await RewardFunction(slow, timeout=1, timeout_reward=0.0)() == 0.0


async def test_a_hung_thread_is_abandoned_at_the_timeout():
    release = threading.Event()
    reward = RewardFunction(release.wait, timeout=0.2)
    with pytest.raises(RewardTimeoutError):
        await reward()
    release.set()


@pytest.mark.parametrize("retries", [0, 2])
async def test_reward_exceptions_propagate_after_the_retries(retries):
    calls = 0

    def failing():
        nonlocal calls
        calls += 1
        reward_fns.fail()

    with pytest.raises(ValueError, match="intentional error from reward fn"):
        await RewardFunction(failing, retries=retries)()
    assert calls == retries + 1


async def test_import_strings_resolve_on_first_call():
    assert await RewardFunction("tests.reward_fns.add")(1, 2) == 3
    with pytest.raises(ValueError, match="Expected format"):
        await RewardFunction("nodots")()


def test_constructor_errors_name_the_field():
    with pytest.raises(ValueError, match="isolation"):
        RewardFunction(reward_fns.add, isolation="fiber")
    with pytest.raises(ValueError, match="timeout"):
        RewardFunction(reward_fns.add, timeout=0)
    with pytest.raises(ValueError, match="max_workers"):
        RewardFunction(reward_fns.add, max_workers=0)
    with pytest.raises(ValueError, match="retries"):
        RewardFunction(reward_fns.add, retries=-1)
    with pytest.raises(TypeError, match="picklable"):
        RewardFunction(lambda: 1, isolation="process")
    with pytest.raises(TypeError, match="fn: must be a callable"):
        RewardFunction(3)


# ------------------------------------------------------------------ processes


async def test_process_rewards_run_in_worker_processes():
    async with RewardFunction(reward_fns.pid, isolation="process", max_workers=2) as reward:
        pids = [await reward() for _ in range(3)]
        # each call in a fresh child of a worker (its state dies with the call)
        assert os.getpid() not in pids and len(set(pids)) == 3 and not set(pids) & reward.worker_pids
    async with RewardFunction("tests.reward_fns.add", isolation="process") as by_name:
        assert await by_name(1, 2) == 3


async def test_a_hung_worker_is_killed_at_the_timeout_and_replaced(tmp_path):
    pid_file = tmp_path / "pid"
    async with RewardFunction(reward_fns.add_or_hang, isolation="process", timeout=2, max_workers=2) as reward:
        assert await reward(1, 1) == 2  # a worker is up
        with trio.fail_after(30), pytest.raises(RewardTimeoutError):
            await reward(0, 0, pid_file=str(pid_file))
        await wait_dead(int(pid_file.read_text()))
        results = []

        async def call(i):
            results.append(await reward(i, 1))

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for i in range(100):
                    n.start_soon(call, i)
        assert sorted(results) == list(range(1, 101))
        assert len(reward.worker_pids) <= 2


async def test_timeout_reward_is_returned_for_a_hung_process(tmp_path):
    async with RewardFunction(reward_fns.hang, isolation="process", timeout=1, timeout_reward=0.0) as reward:
        with trio.fail_after(30):
            assert await reward(str(tmp_path / "pid")) == 0.0
        await wait_dead(int((tmp_path / "pid").read_text()))


@pytest.mark.parametrize(("fn", "how"), [(reward_fns.hard_exit, "exited with status 7"), (reward_fns.segfault, "killed by signal SIGSEGV")])
async def test_a_crashing_worker_is_a_typed_error_and_is_replaced(fn, how):
    async with RewardFunction(fn, isolation="process", max_workers=1) as crash:
        with trio.fail_after(30), pytest.raises(RewardWorkerError, match=how):
            await crash()
        assert len(crash.worker_pids) == 1  # the worker lives on: only the call's child died
    async with RewardFunction(reward_fns.add, isolation="process", max_workers=1) as add:
        assert await add(2, 2) == 4


async def test_a_crash_is_retried_on_a_fresh_worker(tmp_path):
    async with RewardFunction(reward_fns.exit_once, isolation="process", retries=1) as reward:
        with trio.fail_after(30):
            assert await reward(str(tmp_path / "marker")) == 1.0


async def test_process_reward_exceptions_propagate_with_the_remote_traceback():
    async with RewardFunction(reward_fns.fail, isolation="process", retries=2) as reward:
        with trio.fail_after(30), pytest.raises(ValueError, match="intentional error") as info:
            await reward()
        assert any("raised in the reward worker process" in n for n in info.value.__notes__)
    async with RewardFunction(reward_fns.raise_unpicklable, isolation="process") as reward:
        with trio.fail_after(30), pytest.raises(RewardWorkerError, match="Unpicklable: 1/2"):
            await reward()


async def test_the_pool_shuts_down_with_its_async_with_block():
    reward = RewardFunction(reward_fns.pid, isolation="process", max_workers=3)
    assert await reward() != os.getpid()  # started by the call
    async with reward:
        async with trio.open_nursery() as n:
            for _ in range(3):
                n.start_soon(reward)
        pids = set(reward.worker_pids)
        assert len(pids) == 3
    assert all(gone(p) for p in pids) and reward.worker_pids == set()
    with pytest.raises(RuntimeError, match="has been shut down"):
        await reward()


async def test_cancelling_a_process_call_kills_its_worker(tmp_path):
    pid_file = tmp_path / "pid"
    async with RewardFunction(reward_fns.hang, isolation="process", timeout=600) as reward:
        async with trio.open_nursery() as n:
            n.start_soon(reward, str(pid_file))
            with trio.fail_after(30):
                while not pid_file.exists() or not pid_file.read_text():
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()
        await wait_dead(int(pid_file.read_text()))


# ------------------------------------------------------------------ hostile and careless rewards


async def test_a_killed_reward_takes_its_children_with_it(tmp_path):
    pid_file = tmp_path / "child"
    async with RewardFunction(reward_fns.spawn_sleeper_and_hang, isolation="process", timeout=2) as reward:
        with trio.fail_after(60), pytest.raises(RewardTimeoutError):
            await reward(str(pid_file))
        await wait_dead(int(pid_file.read_text()))


@pytest.mark.parametrize("forged_value", [-1.0, "stray"])
async def test_a_forged_reply_never_reaches_the_next_call(forged_value):
    """A reward that writes a reply of its own onto the channel: the call gets its own
    value or a typed error, and the next call its own answer (before: the forged value,
    then the next call got the first one's real reply)."""
    async with RewardFunction(reward_fns.forge_reply, isolation="process", max_workers=1) as reward:
        with trio.fail_after(60):
            try:
                assert await reward(forged_value) == 1.0
            except RewardWorkerError as exc:
                assert "not this call's" in str(exc) or "could not be read" in str(exc)
            assert await reward(forged_value, forge=False) == 2.0


@pytest.mark.parametrize("kind", ["junk", "huge"])
async def test_garbage_on_the_reply_channel_is_a_typed_error(kind):
    async with RewardFunction(reward_fns.write_garbage, isolation="process", max_workers=1) as reward:
        with trio.fail_after(60), pytest.raises(RewardWorkerError, match="could not be read"):
            await reward(kind)


async def test_an_exception_that_is_not_built_in_keeps_its_traceback_and_its_worker():
    """It is never unpickled here (untrusted worker): a typed error with the traceback text."""
    async with RewardFunction(reward_fns.pid, isolation="process", max_workers=1) as pid:
        first = await pid()
    async with RewardFunction("tests.reward_fns.raise_unloadable", isolation="process", max_workers=1) as reward:
        with trio.fail_after(60), pytest.raises(RewardWorkerError, match="Unloadable") as info:
            await reward()
        assert "raise_unloadable" in str(info.value) and "Unloadable: 1/2" in str(info.value)
        (worker,) = reward.worker_pids
        with trio.fail_after(60), pytest.raises(RewardWorkerError):
            await reward()
        assert reward.worker_pids == {worker} and first != worker


async def test_thread_rewards_starved_by_hung_calls_are_counted_and_warned():
    release = threading.Event()

    def hang_or_add(a, b):
        if a is None:
            release.wait()
        return a + b if a is not None else 0.0

    reward = RewardFunction(hang_or_add, max_workers=1, timeout=1, timeout_reward=0.0)
    try:
        assert await reward(None, 0) == 0.0  # hangs: its thread is abandoned, holding the one slot
        assert reward.statistics.hung_threads == 1 and reward.statistics.not_started == 0
        with pytest.warns(RewardThreadsExhaustedWarning, match="without running: all 1 threads are held by 1 hung"):
            assert await reward(1, 2) == 0.0  # never ran: not a verdict on (1, 2)
        assert reward.statistics == RewardStatistics(calls=2, timeouts=2, not_started=1, hung_threads=1)
    finally:
        release.set()
    with trio.fail_after(30):
        while reward.statistics.hung_threads:
            await trio.sleep(0.01)
    assert await reward(1, 2) == 3
