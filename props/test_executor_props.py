"""The executor's accounting under random trainer behaviour (Trio's deterministic scheduling
under Hypothesis, virtual time through MockClock, the scripted engine)."""

from __future__ import annotations

from typing import Any

import torch
import trio
import trio.testing
from hypothesis import example, given
from hypothesis import strategies as st

from rollout_trio import ModelRequest, Trajectory, workflow_context
from rollout_trio.executor import TaskOutcome, open_executor
from rollout_trio.testing import ScriptedEngine

KINDS = ["ok", "ok", "none", "empty", "fail", "filter"]
# prepare_batch's source (no "filter": its should_accept_fn is fixed by the first call).
SOURCE = [(1, True, "ok"), (0, False, "none"), (2, False, "ok"), (1, True, "fail"), (0, True, "ok")]

task_specs = st.tuples(st.integers(0, 3), st.booleans(), st.sampled_from(KINDS))
operations = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), task_specs),
        st.tuples(st.just("wait"), st.tuples(st.integers(1, 3), st.integers(0, 4))),
        st.tuples(st.just("wait_for"), st.tuples(st.integers(0, 12), st.integers(0, 4))),
        st.tuples(st.just("cancel"), st.integers(0, 12)),
        st.tuples(st.just("pause"), st.none()),
        st.tuples(st.just("resume"), st.none()),
        st.tuples(st.just("bump"), st.none()),
        st.tuples(st.just("sleep"), st.integers(0, 3)),
        st.tuples(st.just("batch"), st.tuples(st.lists(task_specs, max_size=4), st.integers(0, 6))),
        st.tuples(st.just("prepare"), st.tuples(st.integers(1, 3), st.integers(0, 6))),
    ),
    max_size=30,
)
configs = st.fixed_dictionaries(
    {
        "max_concurrent_rollouts": st.integers(1, 4),
        "consumer_batch_size": st.integers(1, 3),
        "max_head_offpolicyness": st.integers(0, 2),
        "queue_size": st.integers(3, 8),
    }
)


@given(configs, operations)
@example(  # submits past queue_size: the fourth waits for a wait() (the gate: pool + running < queue_size)
    config={"max_concurrent_rollouts": 4, "consumer_batch_size": 3, "max_head_offpolicyness": 2, "queue_size": 3},
    ops=[("submit", (0, False, "ok"))] * 5 + [("sleep", 1), ("wait", (3, 1))],
)
@example(  # an abandoned batch's 3 results handed to the pool beside a submit's (the pool then held 4 > 3)
    config={"max_concurrent_rollouts": 1, "consumer_batch_size": 2, "max_head_offpolicyness": 1, "queue_size": 3},
    ops=[("submit", (0, False, "ok")), ("batch", ([(0, False, "ok"), (0, False, "ok"), (1, False, "ok")], 1))],
)
def test_every_task_is_accounted_once_and_no_accepted_trajectory_is_lost_or_delivered_twice(
    config: dict[str, int], ops: list[tuple[str, Any]]
) -> None:
    """Invariant: at every instant ``submitted == accepted + rejected + failed + cancelled +
    queued + running + buffered``; every task ends exactly once (one callback); every
    trajectory accepted is either delivered exactly once or still buffered at the end;
    submit's results waiting in the common pool never exceed queue_size; no training trajectory is handed out more than
    ``max_head_offpolicyness`` versions behind the version at that instant — under random
    workflow failures, rejections (None, ``{}``, should_accept_fn), cancellations, pauses,
    version bumps, and *every* consumer call (wait, wait_for_task, rollout_batch,
    prepare_batch) cancelled at a random instant, often the very instant a task finishes."""
    delivered: list[int] = []
    outcomes: list[TaskOutcome] = []
    violations: list[str] = []
    kinds: dict[Any, str] = {}
    source_ids: set[int] = set()  # prepare_batch's tasks: only a later prepare_batch takes them
    submit_ids: set[int] = set()

    def check(ex: Any, where: str) -> None:
        s = ex.statistics()
        if not s.balanced():
            violations.append(f"{where}: {s}")
        # queue_size bounds submit's results waiting in the common pool (for wait()); a call's
        # own results (a rollout_batch's, prepare_batch's leftovers) are the call's (issue 27),
        # and an abandoned batch hands its finished ones to the pool beyond it (none is lost).
        pool = [t for t in ex._store.held.values() if t.owner is ex._store.common]
        if ex._admission.pool_buffered != len(pool):
            violations.append(f"{where}: pool counted {ex._admission.pool_buffered}, holds {len(pool)}")
        from_submit = sum(t.task_id in submit_ids for t in pool)
        if from_submit > ex.queue_size:
            violations.append(f"{where}: pool holds {from_submit} results of submit > queue_size {ex.queue_size}")

    async def main() -> None:
        engine = ScriptedEngine(delay=1)
        async with engine, open_executor(engine, **config) as ex:

            async def wf(engine: Any, data: tuple[int, bool, str]) -> Any:
                steps, use_engine, kind = data
                tid = workflow_context.get().task_id
                kinds[tid] = kind
                for _ in range(steps):
                    check(ex, f"task {tid}")
                    if use_engine:
                        await engine.agenerate(ModelRequest(input_ids=[1]))
                    else:
                        await trio.sleep(1)
                if kind == "fail":
                    raise RuntimeError("injected")
                if kind == "none":
                    return None
                if kind == "empty":
                    return {}
                return Trajectory.from_dict(  # one output token, of the version at the end
                    {
                        "input_ids": torch.tensor([[tid, 0]]),
                        "attention_mask": torch.tensor([[True, True]]),
                        "loss_mask": torch.tensor([[0, 1]]),
                        "versions": torch.tensor([[-1, engine.get_version()]]),
                    }
                )

            def reject_filtered(traj: Trajectory) -> bool:
                return kinds[int(traj.input_ids[0, 0])] != "filter"

            def from_source(outcome: TaskOutcome) -> None:
                source_ids.add(outcome.task_id)
                outcomes.append(outcome)

            def take(results: list[Any]) -> None:
                # Called with no checkpoint after the consumer call returned: this is its instant.
                now = engine.get_version()
                for t in results:
                    if t is None:
                        continue
                    delivered.append(int(t.input_ids[0, 0]))
                    if now - int(t.versions[0, 1]) > config["max_head_offpolicyness"]:
                        violations.append(f"task {int(t.input_ids[0, 0])} of version {int(t.versions[0, 1])} consumed at {now}")

            for op, arg in ops:
                check(ex, op)
                if op == "submit":
                    submit_ids.add(ex.submit(arg, wf, should_accept_fn=reject_filtered, callback=outcomes.append))
                elif op == "wait":
                    count, limit = arg
                    with trio.move_on_after(limit):  # cancelled from outside, not its own timeout
                        take(await ex.wait(count))
                elif op == "wait_for":
                    tid, limit = arg
                    with trio.move_on_after(limit):
                        try:
                            take([await ex.wait_for_task(tid)])
                        except ValueError:
                            pass  # never submitted, already taken, or owned by a batch call
                elif op == "cancel":
                    ex.cancel(arg)
                elif op == "pause" and not ex.paused:
                    await ex.pause()
                elif op == "resume" and ex.paused:
                    await ex.resume()
                elif op == "bump":
                    ex.set_version(engine.get_version() + 1)
                elif op == "sleep":
                    await trio.sleep(arg)
                elif op == "batch":
                    specs, limit = arg
                    with trio.move_on_after(limit):
                        try:
                            take(await ex.rollout_batch(specs, wf, should_accept_fn=reject_filtered, callback=outcomes.append, progress=False))
                        except ValueError as exc:  # a batch the budget can never start: refused at once, nothing queued
                            assert "can never" in str(exc), exc
                elif op == "prepare":
                    size, limit = arg
                    with trio.move_on_after(limit):
                        try:
                            take(await ex.prepare_batch(SOURCE, wf, batch_size=size, callback=from_source, progress=False))
                        except ValueError as exc:
                            assert "can never" in str(exc), exc
                check(ex, op)
            if ex.paused:
                await ex.resume()
            # Nothing is orphaned: every accepted, undelivered result of a submitted task (or
            # of an abandoned rollout_batch) can still be taken, or was dropped as stale.
            for o in outcomes:
                if o.status == "accepted" and o.task_id not in source_ids and o.task_id not in delivered:
                    take([await ex.wait_for_task(o.task_id, timeout=1000)])
        final = ex.statistics()
        check(ex, "after exit")
        assert (final.queued, final.running) == (0, 0)
        assert not engine.in_flight and len(engine.completed) + len(engine.aborted) == len(engine.requests)
        # Every task ended exactly once, as the statistics say.
        ids = [o.task_id for o in outcomes]
        assert len(ids) == len(set(ids)) == final.submitted
        by_status = {s: sum(o.status == s for o in outcomes) for s in ("accepted", "rejected", "failed", "cancelled")}
        assert by_status["rejected"] == final.rejected and by_status["failed"] == final.failed
        assert by_status["cancelled"] == final.cancelled
        dropped = getattr(final, "stale", 0) + getattr(final, "discarded", 0)  # (main 8bad992 had neither)
        assert by_status["accepted"] == final.accepted + final.buffered + dropped
        # No accepted trajectory delivered twice, none lost.
        accepted_ids = {o.task_id for o in outcomes if o.status == "accepted"}
        assert len(delivered) == len(set(delivered)) == final.accepted
        assert set(delivered) <= accepted_ids

    async def bounded() -> None:
        with trio.fail_after(100_000):  # virtual seconds: a hang fails instead of spinning
            await main()

    trio.run(bounded, clock=trio.testing.MockClock(autojump_threshold=0))
    assert not violations, violations[:3]
