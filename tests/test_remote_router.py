"""RemoteEngine(router=...) against a real sglang-router in front of real `serve` workers,
all on loopback: generation through the router, aborts that reach the worker, and weight
updates with requests in flight that lose nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine

from .conftest_remote import ROOT, ServeProcess

pytest.importorskip("sglang_router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_router(urls: list[str], log: Any) -> tuple[subprocess.Popen[bytes], str]:
    """sglang-router on a free port, listing ``urls`` as healthy; a port another process
    took first (the router then exits) is retried with another."""
    for _ in range(3):
        port = _free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--policy", "round_robin", "--log-level", "warn", "--worker-urls", *urls],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ),
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while router.poll() is None and time.monotonic() < deadline:
            try:
                listed = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()["workers"]
                if sorted(w["url"] for w in listed if w["is_healthy"]) == urls:
                    return router, f"127.0.0.1:{port}"
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.2)
        router.kill()
        router.wait(15)
    raise RuntimeError(f"sglang-router did not come up with the workers (log: {log.name})")


class Fleet:
    def __init__(self, workers: list[ServeProcess], router: subprocess.Popen[bytes], address: str) -> None:
        self.workers, self.router, self.address = workers, router, address

    def worker_with(self, rid_prefix: str) -> ServeProcess | None:
        for w in self.workers:
            if any(r.startswith(rid_prefix) for r in w.stats()["in_flight_rids"]):
                return w
        return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ThreadPoolExecutor(2) as pool:  # they boot in parallel
        workers = list(pool.map(lambda _: ServeProcess("--step-delay", "0.02", "--segment-tokens", "4"), range(2)))
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")  # noqa: SIM115 - closed below
    router = None
    try:
        router, address = _start_router(sorted(w.url for w in workers), log)
        yield Fleet(workers, router, address)
    finally:
        if router is not None:
            router.terminate()
            router.wait(15)
        log.close()
        for w in workers:
            w.stop()


def engine(fleet: Fleet, **kw: Any) -> RemoteEngine:
    assert fleet.router.poll() is None, "the router exited"
    return RemoteEngine(
        router=fleet.address, setup_timeout=60, connect_deadline=30, seed=0, health_interval=3600, **kw
    )


async def test_generation_goes_through_the_router_to_both_workers(fleet: Fleet) -> None:
    before = [w.stats().get("generate_finished", 0) for w in fleet.workers]
    g = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with trio.fail_after(60):
        async with engine(fleet) as eng:
            assert sorted(s.base_url for s in eng.servers) == sorted(w.url for w in fleet.workers)
            for i in range(4):
                resp = await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g, rid=f"through-{i}"))
                assert resp.output_len == 4
    after = [w.stats().get("generate_finished", 0) for w in fleet.workers]
    assert all(a > b for a, b in zip(after, before, strict=True))  # the router spread them


async def test_a_cancelled_generation_stops_on_the_worker(fleet: Fleet) -> None:
    """Through sglang-router POST /abort_request is a 404: the engine sends it to the workers."""
    g = GenerationConfig(max_new_tokens=2000, ignore_eos=True)
    with trio.fail_after(60):
        async with engine(fleet) as eng:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(eng.agenerate, ModelRequest(input_ids=[1, 2], gconfig=g, rid="doomed"))
                    worker = None
                    while worker is None:  # state, not time: it runs on one worker
                        await trio.sleep(0.05)
                        worker = await trio.to_thread.run_sync(fleet.worker_with, "doomed-")
                    scope.cancel()
            stats = await worker.astats()
            while any(r.startswith("doomed-") for r in stats["in_flight_rids"]):
                await trio.sleep(0.05)
                stats = await worker.astats()
    (rid,) = [r for r in stats["aborted_rids"] if r.startswith("doomed-")]
    assert rid not in stats["finished_rids"]
    assert stats["output_tokens"] < 2000 * 2  # stopped long before its budget


async def test_updates_with_requests_in_flight_lose_nothing(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> None:
    from rollout_trio.models import tiny_model

    ckpt = tmp_path_factory.mktemp("fleet-ckpt")
    model, tok = tiny_model(seed=1)
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    g = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    results: dict[int, list[Any]] = {1: [], 2: []}
    with trio.fail_after(100):
        async with engine(fleet) as eng:
            start = eng.get_version()

            async def one(wave: int, i: int) -> None:
                rid = f"inflight-{wave}-{i}"
                results[wave].append(await eng.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g, rid=rid)))

            async def wave_on_a_worker(wave: int) -> bool:
                stats = [await w.astats() for w in fleet.workers]
                return any(r.startswith(f"inflight-{wave}-") for s in stats for r in s["in_flight_rids"])

            async with trio.open_nursery() as nursery:
                # A wave of 4 before each update: the update waits until its wave is on a
                # worker, or has already finished (on a loaded machine it may finish between
                # two looks; waiting for requests that no longer exist would wait forever).
                for k in (1, 2):
                    for i in range(4):
                        nursery.start_soon(one, k, i)
                    while len(results[k]) < 4 and not await wave_on_a_worker(k):
                        await trio.sleep(0.02)
                    await eng.update_weights(str(ckpt), start + k)
            assert eng.get_version() == start + 2
    assert [len(results[1]), len(results[2])] == [4, 4]  # 0 lost
    results_all = results[1] + results[2]
    assert all(r.output_versions[0] >= start + 1 for r in results[2])  # sent after the first update
    for r in results_all:
        versions = list(r.output_versions)
        assert r.output_len == 24 and versions == sorted(versions) and start <= versions[0] <= versions[-1] <= start + 2
    for w in fleet.workers:
        assert (await w.astats())["paused"] is None
