"""SyncRolloutExecutor from plain (non-Trio) code: a trainer loop, errors, and every way it stops."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
import trio

from rollout_trio import ExecutorFailed, GenerationConfig, ModelRequest, SyncRolloutExecutor, Trajectory
from rollout_trio import workflow_context
from rollout_trio.testing import ScriptedEngine

from .warm_cli import WarmPopen

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


# ------------------------------------------------------------------ cancellation, deadlines, context


class GatedEngine(ScriptedEngine):
    """Holds every answer until ``gate`` (a threading.Event) is set."""

    def __init__(self) -> None:
        super().__init__(script=self._held)
        self.gate = threading.Event()

    async def _held(self, req: ModelRequest) -> None:
        await trio.to_thread.run_sync(self.gate.wait, abandon_on_cancel=True)


def main_thread_is_in(method: str) -> bool:
    """Whether the main thread is inside SyncRolloutExecutor's ``method`` (blocked in it)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == method and frame.f_code.co_filename.endswith("_sync.py"):
            return True
        frame = frame.f_back
    return False


def interrupt_main_when(condition: Any) -> threading.Thread:
    """Sends SIGINT to the main thread (a Ctrl-C) once ``condition()`` holds."""
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, "the condition never held"
            time.sleep(0.01)
        signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_ctrl_c_cancels_the_call_and_its_results_stay_for_the_next_one() -> None:
    """A Ctrl-C while ``wait`` blocks cancels that wait; the results it did not take are
    the next call's (before: the abandoned wait kept running and took them for no one)."""
    assert threading.current_thread() is threading.main_thread()
    engine = GatedEngine()
    with SyncRolloutExecutor(engine, consumer_batch_size=2, max_concurrent_rollouts=2) as ex:
        for _ in range(2):
            ex.submit({}, gen_workflow)
        watcher = interrupt_main_when(lambda: len(engine.in_flight) == 2 and main_thread_is_in("wait"))
        with pytest.raises(KeyboardInterrupt):
            ex.wait(2, timeout=60)
        watcher.join()
        engine.gate.set()
        deadline = time.monotonic() + 60
        while ex.statistics().running:  # both finish before anyone asks for them
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ex.statistics().buffered == 2
        assert len(ex.wait(2, timeout=30)) == 2
        assert ex.statistics().balanced()


def test_start_timeout_raises_and_stops_the_startup_thread() -> None:
    class SlowStart(ScriptedEngine):
        async def __aenter__(self) -> Any:
            await trio.sleep_forever()

    with pytest.raises(TimeoutError, match="did not start within 0.5 s"):
        SyncRolloutExecutor(SlowStart(), start_timeout=0.5)
    assert not executor_threads()


def test_close_raises_when_the_thread_does_not_stop_in_time() -> None:
    release = threading.Event()

    class StuckClose(ScriptedEngine):
        async def __aexit__(self, *exc: object) -> None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(release.wait)

    ex = SyncRolloutExecutor(StuckClose())
    with pytest.raises(TimeoutError, match="did not stop within 0.2 s"):
        ex.close(timeout=0.2)
    (thread,) = executor_threads()
    release.set()
    thread.join(30)
    assert not thread.is_alive()


def test_use_seed_around_the_constructor_reaches_the_executors_tasks() -> None:
    """As ``use_seed`` around ``open_executor`` seeds every task in a Trio program, so it
    does around the constructor, which runs in the trainer's thread (before: ignored)."""
    seen: list[int | None] = []

    async def seeded(engine: Any, data: Any) -> Trajectory:
        seen.append(workflow_context._seed.get())
        return await gen_workflow(engine, data)

    with workflow_context.use_seed(7):
        ex = SyncRolloutExecutor(ScriptedEngine(), max_head_offpolicyness=10)
    with ex:
        ex.submit({}, seeded)
        ex.wait(1, timeout=30)
        ex.rollout_batch([{}], seeded, progress=False)
    with SyncRolloutExecutor(ScriptedEngine(), max_head_offpolicyness=10) as unseeded:
        unseeded.rollout_batch([{}], seeded, progress=False)
    assert seen == [7, 7, None]


def test_ctrl_c_stops_the_sync_trainer_example_with_status_130() -> None:
    """A real SIGINT to a running trainer: it says how many steps finished and exits 130
    (the interrupted call cancelled, the executor closed), instead of a traceback."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "sync_trainer.py"), "--steps", "1000", "--groups-per-batch", "1", "--group-size", "2"]
    with WarmPopen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.startswith("step 0:"), first
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=90)
        finally:
            proc.kill()
    assert proc.returncode == 130, err
    steps = 1 + sum(line.startswith("step ") for line in out.splitlines())
    assert err.strip().splitlines()[-1] in (f"interrupted: {steps} step(s) finished",)
