"""The pieces of ``rollout_trio.compat.areal`` and ``rollout_trio.phases`` on their own (issue 28)."""

from __future__ import annotations

import asyncio
import importlib
import pickle
import sys

import pytest
import trio
from prometheus_client import CollectorRegistry

import rollout_trio
from rollout_trio import GenerationConfig, ModelResponse, phases, workflow_context
from rollout_trio.compat import areal as compat
from rollout_trio.workflow_context import StatsRecorder
from tests import reward_fns


@pytest.fixture
def hook():
    assert compat.install()
    yield
    compat.uninstall()


def test_an_uncovered_areal_name_raises_import_error_naming_what_is_covered(hook):
    with pytest.raises(ImportError, match=r"areal.engine is not served.*areal.api.workflow_api"):
        importlib.import_module("areal.engine.sglang_remote")
    with pytest.raises(ImportError, match="Scheduler"):
        exec("from areal.api import Scheduler", {})
    import areal.api

    with pytest.raises(AttributeError, match="areal.api.Scheduler is not served"):
        areal.api.Scheduler


def test_the_hook_stays_out_of_the_way_when_areal_is_importable(monkeypatch, tmp_path):
    (tmp_path / "areal").mkdir()
    (tmp_path / "areal" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compat.install() is False
    assert not compat.installed()


def test_served_names_are_ours(hook):
    from areal.api import ModelRequest, RolloutWorkflow
    from areal.infra import workflow_context as areal_ctx

    assert ModelRequest is rollout_trio.ModelRequest
    assert issubclass(RolloutWorkflow, rollout_trio.RolloutWorkflow)
    assert areal_ctx.stat_scope is workflow_context.stat_scope


def test_generation_hyperparameters_have_arealss_methods_and_our_rules():
    from rollout_trio.compat.areal.cli_args import GenerationHyperparameters, from_native

    class Tok:
        pad_token_id, eos_token_id = 0, 2

    g = GenerationHyperparameters(max_new_tokens=7, top_k=5, stop=["x"]).new_with_stop_and_pad_token_ids(Tok())
    assert isinstance(g, GenerationHyperparameters) and isinstance(g, GenerationConfig)
    assert g.stop_token_ids == (0, 2)
    args = g.to_openai_args_dict()
    assert args["max_completion_tokens"] == 7 and args["n"] == 1 and args["stop"] == ["x"]
    assert "top_k" not in args and "stop_token_ids" not in args
    assert g.to_openai_agents_model_settings_dict()["max_tokens"] == 7
    with pytest.raises(ValueError, match="api_format"):
        g.to_openai_args_dict(api_format="chat")
    with pytest.raises(rollout_trio.WorkflowContractError, match="top_p"):
        GenerationHyperparameters(top_p=2.0)
    assert from_native(GenerationConfig(max_new_tokens=3)).max_new_tokens == 3


def test_areal_response_holds_lists_for_arealss_idioms():
    from rollout_trio.compat.areal.io_struct import ModelResponse as ArealResponse

    native = ModelResponse(input_tokens=[1, 2], output_tokens=[3], output_logprobs=[-0.5], output_versions=[0])
    resp = ArealResponse.from_native(native)
    assert [0.0] * resp.input_len + resp.output_logprobs == [0.0, 0.0, -0.5]
    assert resp.input_tokens[:-1] == [1]
    assert resp.to_native() == native


async def test_areal_engine_refuses_n_samples_above_one_with_a_typed_error():
    from rollout_trio.compat.areal.engine_api import ArealEngine

    req = rollout_trio.ModelRequest(input_ids=[1], gconfig=GenerationConfig(n_samples=2))
    with pytest.raises(compat.ArealCompatError, match="n_samples=2"):
        await ArealEngine(object()).agenerate(req)


def test_stats_tracker_scalar_goes_to_the_runs_recorder_and_stat_is_refused():
    from rollout_trio.compat.areal import stats_tracker

    rec = StatsRecorder()
    with workflow_context.use_stats_recorder(rec):
        tracker = stats_tracker.get("rollout")
        tracker.scalar(reward=1.0)
        with tracker.scope("sub"):
            tracker.scalar(x=2)
        with pytest.raises(compat.ArealCompatError, match="stat"):
            tracker.stat(x=None)
    assert rec.summaries()["rollout/reward"].total == 1.0
    assert rec.summaries()["rollout/sub/x"].total == 2.0


# -- AsyncRewardWrapper ------------------------------------------------------------------


def test_async_reward_wrapper_is_constructible_outside_a_run_and_picklable():
    from rollout_trio.compat.areal.reward_api import AsyncRewardWrapper

    wrapper = AsyncRewardWrapper(reward_fns.add)
    copy = pickle.loads(pickle.dumps(wrapper))
    assert copy.reward_fn is reward_fns.add
    with pytest.raises(TypeError, match="picklable"):
        AsyncRewardWrapper(lambda: 0)


def test_async_reward_wrapper_starts_its_pool_in_each_run_that_awaits_it_and_runs_signal_alarm():
    from rollout_trio.compat.areal.reward_api import AsyncRewardWrapper

    wrapper = AsyncRewardWrapper(reward_fns.alarm_reward, timeout_seconds=60)

    async def twice():
        async with trio.open_nursery() as nursery:  # concurrent first callers share one pool
            results = []

            async def one():
                results.append(await wrapper())

            for _ in range(2):
                nursery.start_soon(one)
        return results

    assert trio.run(twice) == [1.0, 1.0]  # signal.alarm: a worker process's main thread
    assert trio.run(twice) == [1.0, 1.0]  # a second run starts its own pool (the first's closed with it)


def test_async_reward_wrapper_works_under_asyncio():
    from rollout_trio.compat.areal.reward_api import AsyncRewardWrapper

    wrapper = AsyncRewardWrapper(reward_fns.add, timeout_seconds=60)

    async def main():
        return await wrapper(2, 3)

    assert asyncio.run(main()) == 5
    wrapper._executor.shutdown()


# -- phases ------------------------------------------------------------------------------


async def test_phases_record_duration_and_status_into_stats_and_listeners():
    rec, seen = StatsRecorder(), []
    phases.add_phase_listener(seen.append)

    @rollout_trio.traced_phase("sync")
    def sync_step():
        return 1

    @rollout_trio.new_session()
    @rollout_trio.traced_phase("boom")
    async def failing():
        raise ValueError("x")

    try:
        with workflow_context.use_stats_recorder(rec):
            assert sync_step() == 1
            with pytest.raises(ValueError):
                await failing()
            with trio.CancelScope() as scope:
                async with rollout_trio.phase("wait"):
                    scope.cancel()
                    await trio.sleep_forever()
    finally:
        phases.remove_phase_listener(seen.append)
    s = rec.summaries()
    assert s["rollout/phase/sync_seconds"].count == 1 and "rollout/phase/sync_error" not in s
    assert s["rollout/phase/boom_error"].count == 1
    assert s["rollout/phase/wait_cancelled"].count == 1
    assert [(r.phase, r.status) for r in seen] == [("sync", "ok"), ("boom", "error"), ("wait", "cancelled")]
    assert seen[1].session is not None and seen[0].session is None


def test_phase_metrics_export_a_histogram_by_phase_and_status():
    registry = CollectorRegistry()
    listener = phases.phase_metrics(registry)
    try:
        with workflow_context.use_stats_recorder(StatsRecorder()), rollout_trio.phase("reward"):
            pass
    finally:
        phases.remove_phase_listener(listener)
    assert registry.get_sample_value("rollout_trio_phase_seconds_count", {"phase": "reward", "status": "ok"}) == 1


def test_phase_name_must_be_a_non_empty_str():
    with pytest.raises(ValueError, match="phase name"):
        rollout_trio.phase("")


def test_concat_padded_tensors_right_pads_rows_and_refuses_another_pad_value():
    import torch

    from rollout_trio.compat.areal.data import concat_padded_tensors

    def row(n):
        return {
            "input_ids": torch.ones(1, n, dtype=torch.int32), "loss_mask": torch.ones(1, n, dtype=torch.int32),
            "logprobs": torch.zeros(1, n), "versions": torch.zeros(1, n, dtype=torch.int32),
            "attention_mask": torch.ones(1, n, dtype=torch.bool), "rewards": torch.ones(1),
        }  # fmt: skip

    out = concat_padded_tensors([row(2), row(3)])
    assert out["input_ids"].shape == (2, 3) and out["attention_mask"][0].tolist() == [True, True, False]
    with pytest.raises(compat.ArealCompatError, match="pad_value"):
        concat_padded_tensors([row(2)], pad_value=1.0)
