"""The task store's parts on their own (found by mutation testing): ``IdSet``, an
``Owner``'s counts, and ``TaskStore``'s accounting as results are held, taken, dropped
and handed on. The executor tests reach them through whole calls; these pin each rule.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given

from rollout_trio import Trajectory
from rollout_trio.executor._admission import Admission
from rollout_trio.executor._staleness import RolloutStat, StalenessManager
from rollout_trio.executor._store import IdSet, Owner, Task, TaskStore, _tokens_of


def runs(values: set[int]) -> int:
    """How many maximal runs of consecutive integers ``values`` holds."""
    return sum(1 for v in values if v - 1 not in values)


@given(st.lists(st.tuples(st.booleans(), st.integers(-5, 40)), max_size=80))
def test_idset_equals_a_set_and_keeps_one_range_per_run(ops: list[tuple[bool, int]]) -> None:
    """Invariant: after any sequence of adds and discards an IdSet holds exactly the
    values a Python set would, its length is theirs, and it stores one range per maximal
    run of consecutive values (sorted, disjoint, never touching), so consecutive ids cost
    one range whatever their number."""
    ids, model = IdSet(), set()
    for add, value in ops:
        if add:
            ids.add(value)
            model.add(value)
        else:
            ids.discard(value)
            model.discard(value)
        assert [v for v in range(-6, 42) if v in ids] == sorted(model)
        assert len(ids) == len(model)
        assert len(ids._lo) == len(ids._hi) == runs(model)
        assert all(lo < hi for lo, hi in zip(ids._lo, ids._hi))
        assert all(hi < lo for hi, lo in zip(ids._hi, ids._lo[1:]))  # a gap between ranges


def test_idset_joins_a_value_that_fills_a_gap() -> None:
    ids = IdSet()
    for v in (1, 3, 2):
        ids.add(v)
    assert (ids._lo, ids._hi) == ([1], [4])
    ids.discard(2)
    assert (ids._lo, ids._hi) == ([1, 3], [2, 4])
    ids.discard(7)  # absent: nothing changes
    ids.discard(0)
    assert (ids._lo, ids._hi) == ([1, 3], [2, 4])


def test_an_owner_counts_its_ended_tasks_and_its_run_without_a_trajectory() -> None:
    owner = Owner("batch")
    owner.record("rejected", "should_accept_fn")
    owner.record("failed", None)  # no reason: counted by status
    owner.record("cancelled", None)  # says nothing about the workflow
    assert (owner.ended, owner.unaccepted_run, dict(owner.unaccepted_reasons)) == (
        3, 2, {"should_accept_fn": 1, "failed": 1}
    )  # fmt: skip
    owner.record("accepted", None)
    assert (owner.ended, owner.unaccepted_run, dict(owner.unaccepted_reasons)) == (4, 0, {})


def traj(tokens: int, *, masked: int | None = None) -> Trajectory:
    d: dict[str, torch.Tensor] = {
        "input_ids": torch.ones(1, tokens, dtype=torch.long),
        "attention_mask": torch.ones(1, tokens, dtype=torch.bool),
    }
    if masked is not None:
        d["loss_mask"] = torch.tensor([[int(i < masked) for i in range(tokens)]])
    return Trajectory.from_dict(d)


def test_tokens_of_a_result_are_its_loss_mask_positions_else_its_positions() -> None:
    assert _tokens_of(traj(5, masked=2)) == 2
    assert _tokens_of(traj(4)) == 4
    assert _tokens_of({"a": object()}) == 0


class Version:
    version = 0

    def get_version(self) -> int:
        return self.version


def store() -> TaskStore:
    return TaskStore(Admission(StalenessManager(Version(), 8, 1, 10), queue_size=4))


_ids = iter(range(10**9))


def task(owner: Owner, *, is_eval: bool = False, version: int = 0, result: object = None) -> Task:
    n = next(_ids)
    t = Task(n, None, None, None, is_eval, None, owner, n, version=version)  # type: ignore[arg-type]
    t.status, t.result = "accepted", result if result is not None else traj(3)
    return t


def test_held_results_count_in_the_pool_only_when_the_pool_owns_them() -> None:
    s = store()
    batch = Owner("batch")
    pool_task, own_task = task(s.common), task(batch)
    s.add(pool_task)
    s.add(own_task)
    s.hold(pool_task)
    s.hold(own_task)
    assert (s.buffered, s.admission.pool_buffered) == (2, 1)
    result = own_task.result
    assert s.take(own_task) is result and own_task.result is None
    assert (s.buffered, s.admission.pool_buffered, s.accepted) == (1, 1, 1)
    assert own_task.task_id not in s.tasks and own_task.task_id not in s.resultless
    s.take(pool_task)
    assert (s.buffered, s.admission.pool_buffered, s.accepted) == (0, 0, 2)


def test_taking_a_task_without_a_deliverable_result_remembers_it_resultless() -> None:
    s = store()
    t = task(Owner("batch"))
    t.status = "rejected"
    s.add(t)
    t.owner.finished[t.task_id] = t
    assert s.take(t) is None
    assert t.task_id in s.resultless and t.task_id not in s.tasks and not t.owner.finished
    assert s.accepted == 0


def test_a_resubmitted_id_is_no_longer_resultless() -> None:
    s = store()
    t = task(Owner("batch"))
    s.add(t)
    s.forget(t)
    assert t.task_id in s.resultless and t.task_id in s.seen
    s.add(t)
    assert t.task_id not in s.resultless and s.tasks[t.task_id] is t


def test_a_stale_drop_counts_its_tokens_and_frees_budget_an_abandoned_one_does_not() -> None:
    s = store()
    staleness = s.admission.staleness
    stale, stale_eval = task(s.common, result=traj(6, masked=4)), task(s.common, is_eval=True)
    abandoned = [task(Owner("batch")), task(Owner("batch"))]
    for t in (stale, stale_eval, *abandoned):
        s.add(t)
        s.hold(t)
    for _ in range(3):  # three training rollouts accepted (the evaluation one never counts)
        staleness.on_rollout_enqueued()
        staleness.on_rollout_submitted()
        staleness.on_rollout_accepted()
    s.drop(stale, "stale")
    assert staleness.get_stats().accepted == 2  # its budget returns
    s.drop(stale_eval, "stale")
    assert staleness.get_stats().accepted == 2  # an evaluation result held no budget
    for t in abandoned:
        s.drop(t, "abandoned")
    assert staleness.get_stats().accepted == 2
    assert (s.stale, s.stale_tokens, s.discarded, s.buffered, s.admission.pool_buffered) == (2, 4 + 3, 2, 0, 0)
    assert stale.dropped == "stale" and abandoned[0].dropped == "abandoned" and stale.result is None
    assert not stale.deliverable and s.held == {}


def test_forgetting_or_taking_a_resultless_task_twice_changes_nothing_more() -> None:
    s = store()
    owner = Owner("batch")
    gone, rejected = task(owner), task(owner)
    rejected.status = "rejected"
    for t in (gone, rejected):
        s.add(t)
        owner.finished[t.task_id] = t
    for _ in range(2):
        s.forget(gone)
        assert s.take(rejected) is None
        assert owner.finished == {} and s.tasks == {} and s.accepted == 0
        assert gone.task_id in s.resultless and rejected.task_id in s.resultless


def test_stale_below_picks_old_training_results_and_tracks_the_oldest_left() -> None:
    s = store()
    old, mid, new, old_eval = task(s.common, version=1), task(s.common, version=3), task(s.common, version=5), task(
        s.common, version=0, is_eval=True
    )
    for t in (old, mid, new, old_eval):
        s.add(t)
        s.hold(t)
    assert s.oldest_held == 1  # evaluation results do not count
    assert s.stale_below(3) == [old]
    assert s.oldest_held == 3
    s.drop(old, "stale")  # the executor drops what the sweep found
    assert s.stale_below(0) == [] and s.oldest_held == 3
    for t in (mid, new):
        s.drop(t, "stale")
    assert s.stale_below(100) == []
    assert s.oldest_held > 10**15  # nothing held: no floor finds anything


def test_handing_on_moves_training_results_to_the_pool_and_drops_evaluation_ones() -> None:
    s = store()
    batch = Owner("batch")
    train, ev, rejected = task(batch), task(batch, is_eval=True), task(batch)
    rejected.status = "rejected"
    for t in (train, ev, rejected):
        s.add(t)
        batch.finished[t.task_id] = t
    s.hold(train)
    s.hold(ev)
    assert (s.buffered, s.admission.pool_buffered) == (2, 0)
    for t in (train, ev, rejected):
        s.hand_on(t)
    assert train.owner is s.common and s.common.finished == {train.task_id: train}
    assert (s.buffered, s.admission.pool_buffered, s.discarded) == (1, 1, 1)
    assert ev.dropped == "abandoned" and ev.task_id in s.resultless and ev.task_id not in s.tasks
    assert rejected.task_id in s.resultless and not batch.finished
    assert s.held == {train.task_id: train}


def test_the_staleness_counts_of_a_store_start_at_zero() -> None:
    s = store()
    assert s.admission.staleness.get_stats() == RolloutStat()
    assert (s.buffered, s.accepted, s.stale, s.stale_tokens, s.discarded) == (0, 0, 0, 0, 0)
