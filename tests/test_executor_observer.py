"""Observers see every task transition once, in order, and the lag of what is consumed."""

from __future__ import annotations

from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout_trio
from rollout_trio import ExecutorObserver, open_executor
from rollout_trio.testing import ScriptedEngine

from .test_executor import gen_workflow


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, Any]] = []

    def task_queued(self, task_id: int, *, is_eval: bool, time: float) -> None:
        self.events.append(("queued", task_id, is_eval))

    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        self.events.append(("started", task_id, version))

    def task_finished(self, task_id: int, *, status: str, reason: str | None, result: object, time: float) -> None:
        self.events.append(("finished", task_id, (status, reason)))

    def task_consumed(self, task_id: int, *, version: int, lag: int, time: float) -> None:
        self.events.append(("consumed", task_id, (version, lag)))


class Broken(Recorder):
    def task_started(self, task_id: int, *, version: int, time: float) -> None:
        raise RuntimeError("observer bug")


def test_observer_protocol_is_exported() -> None:
    assert isinstance(Recorder(), ExecutorObserver)
    assert rollout_trio.ExecutorObserver is rollout_trio.executor.ExecutorObserver


async def test_every_transition_is_seen_once_in_order() -> None:
    rec = Recorder()
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10, observers=[rec]) as ex:
        ok = ex.submit({"reward": 1.0}, gen_workflow)
        rejected = ex.submit({}, gen_workflow, should_accept_fn=lambda t: False)
        await ex.wait_for_task(rejected)
        engine.set_version(2)
        (traj,) = await ex.wait(1)
    by_task: dict[int, list[str]] = {}
    for kind, tid, _ in rec.events:
        by_task.setdefault(tid, []).append(kind)
    assert by_task[ok] == ["queued", "started", "finished", "consumed"]
    assert by_task[rejected] == ["queued", "started", "finished"]
    consumed = [detail for kind, tid, detail in rec.events if kind == "consumed"]
    assert consumed == [(2, 2)]  # generated at version 0, consumed at 2


async def test_a_failing_observer_is_logged_and_the_task_still_runs(caplog: Any) -> None:
    rec = Broken()
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10, observers=[rec]) as ex:
        ex.submit({}, gen_workflow)
        assert len(await ex.wait(1)) == 1
    assert "observer" in caplog.text and "task_started" in caplog.text
    assert [k for k, _, _ in rec.events] == ["queued", "finished", "consumed"]


async def test_queued_then_cancelled_never_starts() -> None:
    rec = Recorder()
    async with ScriptedEngine() as engine, open_executor(engine, max_head_offpolicyness=10, observers=[rec]) as ex:
        await ex.pause()
        tid = ex.submit({}, gen_workflow)
        assert ex.cancel(tid)
    assert [(k, d) for k, t, d in rec.events if t == tid] == [("queued", False), ("finished", ("cancelled", "cancelled"))]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(-1, 50), min_size=1, max_size=40), min_size=1, max_size=4),
    long=st.booleans(),
)
def test_oldest_version_is_the_least_non_negative_version_whatever_the_length(rows: list[list[int]], long: bool) -> None:
    """Invariant: oldest_version is min(v for v in versions if v >= 0) (None when there is
    none), on the short-row path and on the tensor path for long rows alike, whatever the
    tensor's memory layout."""
    import torch

    from rollout_trio import Trajectory
    from rollout_trio.executor._observer import oldest_version

    width = max(map(len, rows)) * (40 if long else 1)
    # a column slice of a wider tensor, as splitting a batch can give: not contiguous
    versions = torch.full((len(rows), width + 3), -1, dtype=torch.int32)[:, :width]
    for i, row in enumerate(rows):
        versions[i, : len(row)] = torch.tensor(row)
    n = versions.shape[1]
    traj = Trajectory(
        input_ids=torch.ones(len(rows), n, dtype=torch.int32),
        attention_mask=torch.ones(len(rows), n, dtype=torch.bool),
        loss_mask=(versions >= 0).int(),
        versions=versions,
    )
    flat = [v for row in rows for v in row if v >= 0]
    assert oldest_version(traj) == (min(flat) if flat else None)
