"""What each slot of a group receives and what the group hands on: the data, the context,
the workflow's keyword arguments, the metrics hook's arguments, the processor cache's
closing, the finalizer's messages, the option rules' exact messages, and the thread
assembly of large groups (mutants of _group.py that survived the other tests, issue 32)."""

import logging
import traceback

import pytest
import torch
import trio

from rollout_trio import GroupedRolloutWorkflow, GroupRolloutError, run_group, workflow_context
from rollout_trio._group import INLINE_ASSEMBLY_POSITIONS, assembly_limiter
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflow_context import StatsRecorder, WorkflowContext

from .group_helpers import I, traj


async def one(engine, data):
    return traj(1)


async def test_every_slot_gets_the_data_and_the_groups_context():
    data = {"prompt": "x"}
    seen = []

    async def wf(engine, got):
        ctx = workflow_context.get()
        seen.append((got is data, ctx.is_eval, ctx.task_id, ctx.sample_idx, ctx.group_size))
        return traj(ctx.sample_idx)

    with workflow_context.use(WorkflowContext(is_eval=True, task_id=7)):
        out = await run_group(wf, ScriptedEngine(), data, 3, stats=StatsRecorder())
    assert out.batch_size == 3
    assert sorted(seen, key=lambda s: s[3]) == [(True, True, 7, i, 3) for i in range(3)]


async def test_the_groups_own_context_has_no_sample_index():
    """The finalizer gets the group's context: its size, its cache, and no slot index."""
    got = []

    async def hook(ctx):
        got.append((ctx.sample_idx, ctx.group_size, ctx.processor_cache is not None))

    async def wf(engine, data):
        return traj(1)

    with workflow_context.use(WorkflowContext(sample_idx=5)):
        await run_group(wf, ScriptedEngine(), {}, 2, finalize_hook=hook, stats=StatsRecorder())
    assert got == [(None, 2, True)]


async def test_workflow_kwargs_reach_a_function_workflow():
    async def wf(engine, data, *, scale):
        return traj(scale)

    out = await run_group(wf, ScriptedEngine(), {}, 2, workflow_kwargs={"scale": 9}, stats=StatsRecorder())
    assert out.input_ids.flatten().tolist() == [9, 9]


async def test_a_class_workflow_runs_its_own_arun_episode():
    class WF:
        def __init__(self):
            self.data = []

        async def arun_episode(self, engine, data):
            self.data.append(data)
            return traj(4)

    wf = WF()
    out = await run_group(wf, ScriptedEngine(), "item", 2, stats=StatsRecorder())
    assert out.batch_size == 2 and wf.data == ["item", "item"]


@pytest.mark.parametrize("fail", [False, True])
async def test_the_metrics_hook_gets_the_data(fail):
    calls = []

    class WF:
        async def arun_episode(self, engine, data):
            if fail and workflow_context.get().sample_idx == 1:
                raise ValueError("slot 1")
            return {f"c{workflow_context.get().sample_idx}": I(0.5)}

        def record_group_metrics(self, data, rewards, group_size):
            calls.append((data, group_size))

    if fail:
        with pytest.raises(GroupRolloutError):
            await run_group(WF(), ScriptedEngine(), {"k": 1}, 2, stats=StatsRecorder())
    else:
        await run_group(WF(), ScriptedEngine(), {"k": 1}, 2, stats=StatsRecorder())
    assert calls == [({"k": 1}, 2)]


async def test_a_group_error_keeps_its_traceback():
    async def wf(engine, data):
        raise ValueError("boom")

    with pytest.raises(GroupRolloutError) as info:
        await run_group(wf, ScriptedEngine(), {}, 2, stats=StatsRecorder())
    # It carries the group's own traceback, down into the nursery that raised it.
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(info.value.__traceback__)]
    assert any(f.endswith("trio/_core/_run.py") for f in frames), frames
    assert sorted(info.value.slots) == [0, 1]


async def test_the_processor_cache_is_closed_after_the_group_with_or_without_a_finalizer():
    caches = []

    async def wf(engine, data):
        caches.append(workflow_context.get().processor_cache)
        return traj(1)

    async def hook(ctx):
        pass

    await run_group(wf, ScriptedEngine(), {}, 1, stats=StatsRecorder())
    await run_group(wf, ScriptedEngine(), {}, 1, finalize_hook=hook, stats=StatsRecorder())
    assert len(caches) == 2 and all(c.closed is True for c in caches)


async def test_the_finalizers_warnings_are_its_own_words(caplog, autojump_clock):
    async def failing(ctx):
        raise OSError("disk gone")

    async def hanging(ctx):
        await trio.sleep_forever()

    async def wf(engine, data):
        return traj(1)

    with caplog.at_level(logging.WARNING, logger="rollout_trio.group"):
        await run_group(wf, ScriptedEngine(), {}, 1, finalize_hook=failing, stats=StatsRecorder())
        await run_group(wf, ScriptedEngine(), {}, 1, finalize_hook=hanging, finalize_timeout=2.5, stats=StatsRecorder())
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to finalize rollout group resources (OSError: disk gone).",
        "Finalizing rollout group resources timed out after 2.5 s.",
    ]


def test_the_default_finalize_timeout_is_ten_seconds():
    assert GroupedRolloutWorkflow(one, 2).finalize_timeout == 10.0


@pytest.mark.parametrize("bad", [0, -1.0, 0.0])
def test_finalize_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match=rf"^finalize_timeout must be > 0 seconds, got {bad!r}$"):
        GroupedRolloutWorkflow(one, 2, finalize_timeout=bad)


def test_a_short_finalize_timeout_is_accepted():
    assert GroupedRolloutWorkflow(one, 2, finalize_timeout=0.5).finalize_timeout == 0.5


@pytest.mark.parametrize("bad", [2.0, "2", True])
def test_sizes_must_be_integers(bad):
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        GroupedRolloutWorkflow(one, bad)
    with pytest.raises(ValueError, match="min_usable_group_size must be between 1 and group_size"):
        GroupedRolloutWorkflow(one, 3, min_usable_group_size=bad)


def test_the_normalization_rules_say_why():
    with pytest.raises(ValueError, match=r"^reward_normalization needs group_size > 1: normalizing a single rollout erases its reward$"):
        GroupedRolloutWorkflow(one, 1, reward_normalization=True)
    with pytest.raises(ValueError, match=r"^min_usable_group_size must be at least 2 when reward_normalization is on \(group statistics need two rollouts\), got 1$"):
        GroupedRolloutWorkflow(one, 3, reward_normalization=True, min_usable_group_size=1)
    assert GroupedRolloutWorkflow(one, 3, reward_normalization=True, min_usable_group_size=2).min_usable_group_size == 2


async def test_the_assembly_limiter_is_two_threads_per_run():
    first = assembly_limiter()
    assert isinstance(first, trio.CapacityLimiter) and first.total_tokens == 2
    assert assembly_limiter() is first


async def test_a_group_just_past_the_inline_bound_is_assembled_on_a_worker_thread(monkeypatch):
    import rollout_trio._group as group_module

    threads = []
    original = group_module.assemble_group

    def recording(results, policy):
        in_run = trio.lowlevel.in_trio_run()
        borrowed = None if in_run else trio.from_thread.run_sync(lambda: assembly_limiter().borrowed_tokens)
        threads.append((in_run, borrowed))
        return original(results, policy)

    monkeypatch.setattr(group_module, "assemble_group", recording)
    width = INLINE_ASSEMBLY_POSITIONS // 2

    async def wf(engine, data):
        return {"input_ids": torch.ones(1, width + data, dtype=torch.long), "attention_mask": torch.ones(1, width + data, dtype=torch.bool)}

    await run_group(wf, ScriptedEngine(), 0, 2, stats=StatsRecorder())  # exactly at the bound: inline
    await run_group(wf, ScriptedEngine(), 1, 2, stats=StatsRecorder())  # past it: a worker thread
    assert threads == [(True, None), (False, 1)]  # the thread holds one of the run's two tokens
