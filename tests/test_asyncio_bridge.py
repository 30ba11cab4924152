"""asyncio code in the trainer's process (issue 29): the bridge, its cancellation both ways,
agents written for asyncio, group semantics, and the host rule."""

import asyncio
import threading

import httpx
import openai
import pytest
import sniffio
import trio

import rollout_trio
from rollout_trio import GroupedRolloutWorkflow, ModelRequest, on_asyncio, on_trio, resolve_workflow, run_asyncio
from rollout_trio import workflow_context
from rollout_trio._asyncio import AsyncioTaskCancelled, asyncio_portal, current_portal, host_of
from rollout_trio._workflow import AsyncioHostedWorkflow
from rollout_trio.agents import AgentRolloutWorkflow, serve_app
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.testing import ScriptedEngine

from .agent_helpers import TOKENIZER, hanging_engine, texts_engine

QUESTION = {"messages": [{"role": "user", "content": "What is 2+3?"}]}


def sdk(kwargs):
    return openai.AsyncOpenAI(max_retries=0, **kwargs)


async def test_asyncio_sleep_and_gather_run_with_trio_calls_inside():
    async def trio_add(a, b):
        await trio.sleep(0)
        return a + b

    async def on_the_loop(x):
        assert sniffio.current_async_library() == "asyncio"
        await asyncio.sleep(0)
        portal = current_portal()
        return await asyncio.gather(*(portal.run_trio(trio_add, x, i) for i in range(3)))

    assert await run_asyncio(on_the_loop, 10) == [10, 11, 12]


async def test_errors_cross_as_themselves_both_ways():
    async def trio_fails():
        raise KeyError("trio side")

    async def on_the_loop():
        with pytest.raises(KeyError, match="trio side"):
            await current_portal().run_trio(trio_fails)
        raise LookupError("asyncio side")

    with pytest.raises(LookupError, match="asyncio side"):
        await run_asyncio(on_the_loop)


async def test_trio_cancellation_cancels_the_asyncio_task_and_waits_for_it():
    started = trio.Event()
    seen = []

    async def set_started():
        started.set()

    async def on_the_loop():
        try:
            await current_portal().run_trio(set_started)
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_asyncio, on_the_loop)
        await started.wait()
        nursery.cancel_scope.cancel()
    assert seen == ["cancelled", "finally"]  # the task ended before the Trio side returned


async def test_cancelling_on_the_asyncio_side_cancels_the_trio_call():
    trio_side = []
    cancelled = trio.Event()
    portal_box = []

    async def trio_forever(loop, started):
        try:
            loop.call_soon_threadsafe(started.set)
            await trio.sleep_forever()
        finally:
            trio_side.append("cancelled")
            cancelled.set()

    async def on_the_loop():
        started = asyncio.Event()
        portal = current_portal()
        task = asyncio.create_task(portal.run_trio(trio_forever, asyncio.get_running_loop(), started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await portal.run_trio(cancelled.wait)  # the portal is still open: the asyncio cancel did it
        portal_box.append(portal)

    await run_asyncio(on_the_loop)
    assert trio_side == ["cancelled"]


async def test_a_task_cancelled_from_asyncio_is_a_typed_error():
    async def cancels_itself():
        asyncio.current_task().cancel()
        await asyncio.sleep(0)

    with pytest.raises(AsyncioTaskCancelled):
        await run_asyncio(cancels_itself)


async def test_a_task_that_swallows_cancellation_is_left_behind_after_its_grace(autojump_clock, caplog):
    release = []
    started = trio.Event()

    async def set_started():
        started.set()

    async def stubborn():
        event = asyncio.Event()
        release.append((asyncio.get_running_loop(), event))
        signalled = False
        while True:
            try:  # the cancel may land while it signals, too
                if not signalled:
                    signalled = True
                    await current_portal().run_trio(set_started)
                await event.wait()
                return
            except asyncio.CancelledError:
                continue

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_asyncio, stubborn)
        await started.wait()
        nursery.cancel_scope.cancel()  # returns after the grace (virtual time), not never
    assert "did not finish within" in caplog.text
    loop, event = release[0]
    loop.call_soon_threadsafe(event.set)  # let it end


async def test_the_asyncio_task_sees_the_workflow_context():
    async def on_the_loop():
        return workflow_context.get().task_id

    with workflow_context.use(workflow_context.WorkflowContext(task_id=7)):
        assert await run_asyncio(on_the_loop) == 7


# ------------------------------------------------------------------ agents written for asyncio


class GatheringAgent:
    """AReaL style: asyncio inside (gather, sleep), the real openai SDK, no marker."""

    def __init__(self):
        self.loops = []

    async def run(self, data, **kwargs):
        self.loops.append((sniffio.current_async_library(), threading.current_thread().name))
        client = sdk(kwargs)
        await asyncio.sleep(0)
        replies = await asyncio.gather(
            *(client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{k}"}]) for k in range(2))
        )
        return 1.0 if all(r.choices[0].message.content == "ok" for r in replies) else 0.0


async def test_an_asyncio_agent_runs_unchanged_and_its_completions_are_recorded():
    engine = texts_engine(["ok", "ok"])
    agent = GatheringAgent()
    wf = AgentRolloutWorkflow(agent)
    assert wf.host == "asyncio"
    result = await wf.arun_episode(engine, QUESTION)
    assert agent.loops == [("asyncio", "rollout-trio-asyncio")]
    assert len(result) == 2 and sorted(i.reward for i in result.values()) == [1.0, 1.0]
    assert {i.model_response.output_versions[0] for i in result.values()} == {3}
    assert wf.endpoint(engine)._sessions == {}


async def test_resolve_workflow_hosts_an_agent_on_asyncio_without_a_marker():
    wf = resolve_workflow(GatheringAgent())
    assert isinstance(wf, AgentRolloutWorkflow) and wf.host == "asyncio"
    assert len(await wf.arun_episode(texts_engine(["ok", "ok"]), QUESTION)) == 2


async def test_an_agent_marked_on_trio_runs_in_the_trio_task():
    @on_trio
    class TrioAgent:
        async def run(self, data, **kwargs):
            await trio.sleep(0)
            reply = await sdk(kwargs).chat.completions.create(model="m", messages=data["messages"])
            return 1.0 if sniffio.current_async_library() == "trio" and reply.choices[0].message.content == "5" else 0.0

    wf = AgentRolloutWorkflow(TrioAgent())
    assert wf.host == "trio"
    [inter] = (await wf.arun_episode(texts_engine(["5"]), QUESTION)).values()
    assert inter.reward == 1.0
    assert AgentRolloutWorkflow(GatheringAgent(), host="trio").host == "trio"
    with pytest.raises(ValueError, match="host: must be"):
        AgentRolloutWorkflow(GatheringAgent(), host="uvloop")


class HangingAgent:
    """Signals when its completion is in flight, then waits on it; records its cancellation."""

    def __init__(self):
        self.cancelled = []

    async def run(self, data, **kwargs):
        try:
            await sdk(kwargs).chat.completions.create(model="m", messages=data["messages"])
        except asyncio.CancelledError:
            self.cancelled.append(workflow_context.get().sample_idx)
            raise
        return 1.0


async def test_cancelling_the_episode_cancels_the_asyncio_agent_and_aborts_its_generation():
    engine = ScriptedEngine(delay=float("inf"))
    engine.tokenizer = TOKENIZER
    agent = HangingAgent()
    wf = AgentRolloutWorkflow(agent)
    async with trio.open_nursery() as n:
        n.start_soon(wf.arun_episode, engine, QUESTION)
        while not engine.in_flight:
            await trio.lowlevel.checkpoint()
        [rid] = engine.in_flight
        n.cancel_scope.cancel()
    assert engine.aborted == [rid] and engine.completed == []
    assert agent.cancelled == [None]
    assert wf.endpoint(engine)._sessions == {}


async def test_one_failing_asyncio_slot_cancels_its_asyncio_siblings_and_their_generations():
    engine, in_flight = hanging_engine(2)

    class Agent(HangingAgent):
        async def run(self, data, **kwargs):
            if workflow_context.get().sample_idx == 2:
                await current_portal().run_trio(in_flight.wait)  # both siblings generate
                raise ValueError("slot 2 failed")
            return await super().run(data, **kwargs)

    agent = Agent()
    with pytest.raises(ExceptionGroup) as info:
        await GroupedRolloutWorkflow(agent, 3).arun_episode(engine, QUESTION)
    assert info.group_contains(ValueError, match="slot 2 failed")
    assert sorted(agent.cancelled) == [0, 1]
    assert len(engine.aborted) == 2 and engine.completed == [] and not engine.in_flight


async def test_cancelling_an_asyncio_agent_on_the_real_engine_drops_its_request():
    model, tok = tiny_model(forced_token=65)  # never stops by itself
    wf = AgentRolloutWorkflow(HangingAgent(), default_max_tokens=4096, max_tokens_limit=4096)
    async with LocalEngine(model, tok, seed=0) as engine:
        async with trio.open_nursery() as n:
            n.start_soon(wf.arun_episode, engine, QUESTION)
            while not engine.statistics().live_rids:
                await trio.sleep(0.01)
            [rid] = engine.statistics().live_rids
            while engine.statistics().steps_per_rid.get(rid, 0) < 1:  # generating, not only admitted
                await trio.sleep(0.01)
            n.cancel_scope.cancel()
        stats = engine.statistics()
        assert rid not in stats.live_rids and 0 < stats.steps_per_rid.get(rid, 0) < 4096


async def test_httpx_on_asyncio_against_the_endpoint_on_loopback():
    """An agent that opens its own httpx.AsyncClient to the endpoint served on 127.0.0.1:
    its answers arrive, and cancelling it disconnects, which aborts the generation."""
    hold = trio.Event()

    async def script(req):
        if req.input_ids[-3:] and "hang" in TOKENIZER.decode(req.input_ids):
            await hold.wait()
        return None

    engine = ScriptedEngine(script)
    engine.tokenizer = TOKENIZER
    wf = AgentRolloutWorkflow(HangingAgent())
    endpoint = wf.endpoint(engine)

    async def agent_on_loopback(base, key, content):
        async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {key}"}) as client:
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
            return r.status_code, r.json()["object"]

    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_app, endpoint.app, "127.0.0.1", 0)
        with endpoint.session() as session:
            assert await run_asyncio(agent_on_loopback, base, session.key, "hi") == (200, "chat.completion")
            async with trio.open_nursery() as inner:
                inner.start_soon(run_asyncio, agent_on_loopback, base, session.key, "hang")
                while not engine.in_flight:
                    await trio.sleep(0.005)  # the request is on another loop: poll its arrival
                [rid] = engine.in_flight
                inner.cancel_scope.cancel()
            with trio.fail_after(30):
                while rid not in engine.aborted:  # the server sees the disconnect
                    await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    assert rid not in engine.completed


# ------------------------------------------------------------------ workflows and the host rule


async def test_a_workflow_marked_on_asyncio_gets_an_engine_served_by_trio():
    @on_asyncio
    async def workflow(engine, data):
        assert sniffio.current_async_library() == "asyncio"
        reqs = [ModelRequest(input_ids=[1, 2, 3], rid=f"r{k}") for k in range(2)]
        resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        return {"n": len(resps), "version": engine.get_version()}

    engine = ScriptedEngine()
    wf = resolve_workflow(workflow)
    assert isinstance(wf, AsyncioHostedWorkflow)
    assert await wf.arun_episode(engine, {}) == {"n": 2, "version": 0}
    assert sorted(engine.completed) == ["r0", "r1"]


async def test_plain_workflows_stay_on_trio():
    async def workflow(engine, data):
        return None

    assert not isinstance(resolve_workflow(workflow), AsyncioHostedWorkflow)
    assert host_of(workflow, default="trio") == "trio"
    assert host_of(GatheringAgent(), default="asyncio") == "asyncio"
    obj = GatheringAgent()
    obj.rollout_trio_host = "gevent"
    with pytest.raises(ValueError, match="rollout_trio_host: must be"):
        host_of(obj, default="asyncio")


def test_the_bridge_names_are_public():
    for name in ("on_asyncio", "on_trio", "run_asyncio", "AsyncioHostedWorkflow", "AsyncioTaskCancelled"):
        assert getattr(rollout_trio, name) is not None


async def test_a_portal_refuses_calls_once_closed():
    async with asyncio_portal() as portal:
        pass

    async def late():
        return await portal.run_trio(trio.sleep, 0)

    with pytest.raises(RuntimeError, match="closed"):
        await portal.run(late)
