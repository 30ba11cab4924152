"""The executor on real engines: LocalEngine with the tiny model, and `rollout-trio serve`
behind RemoteEngine. Leaving the executor leaves no live request on either."""

from __future__ import annotations

from typing import Any

import trio

from rollout_trio import GenerationConfig, ModelRequest, Trajectory
from rollout_trio.workflows import arithmetic_prompts, arithmetic_reward
from rollout_trio.engines import LocalEngine
from rollout_trio.executor import open_executor
from rollout_trio.models import byte_tokenizer, tiny_model
from rollout_trio.workflows import rlvr_workflow

from .conftest_remote import serve

LONG = GenerationConfig(max_new_tokens=400, ignore_eos=True)


def prompt() -> list[int]:
    tok = byte_tokenizer()
    return tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


async def long_generation(engine: Any, data: Any) -> Trajectory:
    resp = await engine.agenerate(ModelRequest(input_ids=prompt(), gconfig=LONG))
    return Trajectory.from_response(resp, 0.0)


async def test_local_engine_groups_pause_and_exit() -> None:
    model, tok = tiny_model(seed=0)
    wf = rlvr_workflow(tok, arithmetic_reward, GenerationConfig(max_new_tokens=6))
    with trio.fail_after(60):
        async with LocalEngine(model, tok, seed=0) as engine:
            async with open_executor(engine, max_concurrent_rollouts=4, max_head_offpolicyness=10) as ex:
                batch = await ex.rollout_batch(arithmetic_prompts(3), wf, group_size=2, progress=False)
                assert len(batch) == 3 and all(t.batch_size == 2 for t in batch)
                assert ex.group_statistics()["rollout/target_slot_count"] == 2.0
                # In-flight generations survive a pause and finish after resume.
                before = set(engine.statistics().steps_per_rid)
                tids = [ex.submit({}, long_generation) for _ in range(2)]
                while sum(n > 0 for r, n in engine.statistics().steps_per_rid.items() if r not in before) < 2:
                    await trio.sleep(0.01)  # both are decoding
                interrupts = engine.statistics().interrupts
                await ex.pause()
                assert engine.statistics().paused
                assert engine.statistics().interrupts > interrupts  # in-flight rows were interrupted
                await ex.resume()
                for tid in tids:
                    traj = await ex.wait_for_task(tid)
                    assert isinstance(traj, Trajectory) and int(traj.loss_mask.sum()) == 400
                # Leaving with generations in flight aborts them.
                for _ in range(3):
                    ex.submit({}, long_generation)
                while len(engine.statistics().live_rids) < 3:
                    await trio.sleep(0.01)
            assert not engine.statistics().live_rids
            s = ex.statistics()
            assert s.cancelled == 3 and s.balanced()


async def test_remote_engine_exit_leaves_no_live_request_on_the_server() -> None:
    from rollout_trio.engines import RemoteEngine

    with serve("--segment-tokens", "4", "--step-delay", "0.01", "--seed", "0") as server:
        with trio.fail_after(60):
            async with RemoteEngine([server.address], "sglang", setup_timeout=20, seed=0) as engine:
                async with open_executor(engine, max_concurrent_rollouts=3, max_head_offpolicyness=10) as ex:
                    for _ in range(3):
                        ex.submit({}, long_generation)
                    while len(rids := (await server.astats())["in_flight_rids"]) < 3:
                        await trio.sleep(0.02)
                assert ex.statistics().cancelled == 3
                # Every generation was aborted on the server (none ran to its 400 tokens).
                while not set(rids) <= set((stats := await server.astats())["aborted_rids"]):
                    await trio.sleep(0.02)
                assert stats["in_flight"] == 0 and not set(rids) & set(stats["finished_rids"])
