"""SyncRolloutExecutor from plain (non-Trio) code: a trainer loop, errors, and every way it stops."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

from rollout_trio import ExecutorFailed, GenerationConfig, ModelRequest, SyncRolloutExecutor, Trajectory
from rollout_trio.testing import ScriptedEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def gen_workflow(engine: Any, data: Any) -> Trajectory:
    resp = await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=2)))
    return Trajectory.from_response(resp, 1.0)


def executor_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rollout-trio-executor"]


def test_trainer_loop_bumps_the_version() -> None:
    """Off-policyness 0: every batch was generated entirely by the weights of its step."""
    with SyncRolloutExecutor(ScriptedEngine(), consumer_batch_size=2, max_concurrent_rollouts=4) as ex:
        for step in range(3):
            batch = ex.prepare_batch(range(5), gen_workflow, batch_size=2, progress=False)
            assert len(batch) == 2
            generated = torch.cat([t.versions[t.loss_mask.bool()] for t in batch])
            assert set(generated.tolist()) == {step}
            ex.pause()
            ex.update_weights({}, step + 1)
            ex.resume()
        s = ex.statistics()
        assert s.version == 3 and s.accepted == 6 and s.balanced()
    assert not executor_threads()


def test_submit_wait_and_the_other_methods() -> None:
    ex = SyncRolloutExecutor(ScriptedEngine(), max_head_offpolicyness=10, max_concurrent_rollouts=2)
    try:
        tids = [ex.submit({}, gen_workflow) for _ in range(3)]
        assert tids == [0, 1, 2]
        assert len(ex.wait(2, timeout=10)) == 2
        assert isinstance(ex.wait_for_task(2, timeout=10) or ex.wait(1, timeout=10)[0], Trajectory)
        assert len(ex.rollout_batch([{}, {}], gen_workflow, group_size=2, progress=False)) == 2
        assert ex.group_statistics()["rollout/target_slot_count"] == 2.0
        with pytest.raises(TimeoutError):
            ex.wait(1, timeout=0.05)
        ex.set_version(4)
        assert ex.get_version() == 4
    finally:
        ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.submit({}, gen_workflow)


def test_an_error_inside_surfaces_at_the_next_call() -> None:
    async def boom(engine: Any, data: Any) -> None:
        raise RuntimeError("inside")

    ex = SyncRolloutExecutor(ScriptedEngine(), on_workflow_error="raise")
    ex.submit({}, boom)
    with pytest.raises(ExecutorFailed) as info:
        ex.wait(1, timeout=10)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ExecutorFailed):
        ex.submit({}, boom)
    ex.close()  # already reported: closing does not raise it again
    assert not executor_threads()


def test_an_engine_that_fails_to_start_raises_in_the_constructor() -> None:
    class Broken(ScriptedEngine):
        async def __aenter__(self) -> Any:
            raise OSError("no GPU")

    with pytest.raises(OSError, match="no GPU"):
        SyncRolloutExecutor(Broken())
    assert not executor_threads()


def test_garbage_collection_stops_the_thread_and_aborts_in_flight_work() -> None:
    engine = ScriptedEngine(delay=float("inf"))
    ex = SyncRolloutExecutor(engine)
    ex.submit({}, gen_workflow)
    while not ex.statistics().running:
        pass
    (thread,) = executor_threads()
    del ex
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
    assert len(engine.aborted) == 1 and not engine.in_flight


def test_interpreter_exit_stops_the_executor_cleanly() -> None:
    script = textwrap.dedent(
        """
        import trio
        from rollout_trio import SyncRolloutExecutor, ModelRequest
        from rollout_trio.testing import ScriptedEngine

        engine = ScriptedEngine(delay=float("inf"))

        async def wf(engine, data):
            try:
                await engine.agenerate(ModelRequest(input_ids=[1]))
            finally:
                print("episode cancelled, aborted:", len(engine.aborted), flush=True)

        ex = SyncRolloutExecutor(engine)
        ex.submit({}, wf)
        while not ex.statistics().running:
            pass
        print("exiting", flush=True)
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["exiting", "episode cancelled, aborted: 1"]
