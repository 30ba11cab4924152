"""The per-task workflow context and the shared HTTP client."""

import httpx
import pytest
import trio

from rollout_trio import workflow_context
from rollout_trio.workflow_context import ProcessorCache, WorkflowContext


async def test_default_context_and_scope():
    assert workflow_context.get() == WorkflowContext()
    assert workflow_context.stat_scope() == "rollout"
    with workflow_context.use(WorkflowContext(is_eval=True, task_id=3)):
        assert workflow_context.stat_scope() == "eval-rollout"
        assert workflow_context.get().task_id == 3
    assert workflow_context.get().task_id is None


async def test_contexts_are_isolated_per_task():
    seen = {}

    async def child(i, started):
        workflow_context.set(WorkflowContext(sample_idx=i, group_size=2))
        await started.wait()
        seen[i] = workflow_context.get().sample_idx

    with workflow_context.use(WorkflowContext(task_id=7)):
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(child, i, started)
            await trio.testing.wait_all_tasks_blocked()
            started.set()
        assert workflow_context.get() == WorkflowContext(task_id=7)  # nothing leaked upward
    assert seen == {0: 0, 1: 1}


async def test_http_client_lives_only_inside_its_owner():
    with pytest.raises(RuntimeError, match="open_http_client"):
        workflow_context.http_client()
    got = []

    async def child():
        got.append(workflow_context.http_client())

    async with workflow_context.open_http_client() as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(child)
            nursery.start_soon(child)
    assert got == [client, client]
    assert client.is_closed
    with pytest.raises(RuntimeError):
        workflow_context.http_client()


async def test_http_client_talks_http():
    def handler(request):
        return httpx.Response(200, json={"path": request.url.path})

    async with workflow_context.open_http_client(transport=httpx.MockTransport(handler)):
        resp = await workflow_context.http_client().get("http://test/ping")
    assert resp.json() == {"path": "/ping"}


async def test_processor_cache_computes_each_key_once():
    cache = ProcessorCache()
    calls = []

    async def compute():
        calls.append(1)
        await trio.sleep(0.01)
        return "tokens"

    results = []

    async def slot():
        results.append(await cache.get_or_compute("prompt", compute))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(slot)
    assert results == ["tokens"] * 4 and len(calls) == 1 and len(cache) == 1
    await cache.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await cache.get_or_compute("prompt", compute)


async def test_processor_cache_does_not_cache_failures():
    cache = ProcessorCache()

    async def boom():
        raise ValueError("bad input")

    async def fine():
        return 1

    with pytest.raises(ValueError):
        await cache.get_or_compute("k", boom)
    assert await cache.get_or_compute("k", fine) == 1
