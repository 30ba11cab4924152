"""RemoteEngine through a real sglang-router in front of `rollout-trio serve` workers (issue 16).

One fleet (`rollout-trio fleet`, two workers, round robin) serves the whole module: a
generation goes through the router and reaches every worker; a cancelled one stops on its
worker; a weight update with requests in flight loses none of them and brings every
worker to the new version, and so do two in a row; a worker added mid-run is brought to the fleet's version and one
killed mid-run loses nothing; two trainer processes share the fleet, one publishing
weights while the other keeps generating and adopts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine
from tests.conftest_remote import ROOT, ServeProcess
from tests.fleet_helpers import FleetProcess, Lines, fleet
from tests.warm_cli import WarmPopen

pytestmark = pytest.mark.slow

SHORT = GenerationConfig(max_new_tokens=8, ignore_eos=True)
LONG = GenerationConfig(max_new_tokens=2000, ignore_eos=True)
DEADLINE = 60  # seconds any one test's waits may take on a loaded 2-core machine


@pytest.fixture(scope="module")
def running():
    # a short step delay keeps generations in flight long enough to update, cancel or kill under them
    with fleet("--debug", "--policy", "round_robin", "--step-delay", "0.01", "--segment-tokens", "4", workers=2) as process:
        yield process


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model on disk: what the workers reload on ``update_weights``."""
    from rollout_trio.models import tiny_model

    path = tmp_path_factory.mktemp("checkpoint")
    model, tokenizer = tiny_model()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


async def stats(url: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(url + "/stats")).json()


async def worker_version(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(url + "/get_model_info")).json()["weight_version"]


async def in_flight(urls: list[str], prefix: str) -> int:
    count = 0
    for url in urls:
        count += len([r for r in (await stats(url))["in_flight_rids"] if r.startswith(prefix)])
    return count


async def wait_in_flight(urls: list[str], prefix: str, count: int) -> None:
    while await in_flight(urls, prefix) < count:  # state, polled: the requests are on the workers
        await trio.sleep(0.01)


async def wait_reached(urls: list[str], prefix: str, count: int) -> None:
    """Until ``count`` requests are on the workers or finished there (on a loaded machine a
    short one can finish between two polls: waiting for it in flight would wait forever)."""
    while True:
        reached = 0
        for url in urls:
            st = await stats(url)
            reached += len([r for r in [*st["in_flight_rids"], *st["finished_rids"]] if r.startswith(prefix)])
        if reached >= count:
            return
        await trio.sleep(0.01)


def urls(process: FleetProcess) -> list[str]:
    return [url for url, _ in process.workers]


async def test_generation_goes_through_the_router_to_every_worker(running):
    rids = [f"gen-{i}" for i in range(8)]
    responses = {}
    with trio.fail_after(DEADLINE):
        async with RemoteEngine(router=running.router) as engine:
            version = engine.get_version()

            async def generate(rid: str) -> None:
                responses[rid] = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=SHORT, rid=rid))

            async with trio.open_nursery() as nursery:
                for rid in rids:
                    nursery.start_soon(generate, rid)
        served = [
            {rid for rid in rids if any(f.startswith(rid) for f in (await stats(u))["finished_rids"])}
            for u in urls(running)
        ]
    assert all(r.output_len == 8 and set(r.output_versions) == {version} for r in responses.values())
    assert served[0] | served[1] == set(rids) and served[0] and served[1]  # both workers, through the router


async def test_a_cancelled_generation_stops_on_its_worker(running):
    rids = [f"cancel-{i}" for i in range(4)]
    with trio.fail_after(DEADLINE):
        async with RemoteEngine(router=running.router) as engine:
            async with trio.open_nursery() as nursery:
                for rid in rids:
                    nursery.start_soon(engine.agenerate, ModelRequest(input_ids=[4, 5], gconfig=LONG, rid=rid))
                await wait_in_flight(urls(running), "cancel-", 4)
                nursery.cancel_scope.cancel()
        while await in_flight(urls(running), "cancel-"):  # the workers stop them (a 2000-token answer takes minutes)
            await trio.sleep(0.01)
        finished = [f for u in urls(running) for f in (await stats(u))["finished_rids"] if f.startswith("cancel-")]
    assert finished == []


async def test_a_weight_update_with_requests_in_flight_loses_none(running, checkpoint):
    """A wave of 8 requests; the update comes once all 8 reached a worker and some still run.
    On a loaded machine a whole wave can finish before the last one is seen: then another
    wave (up to 3), since an update under no request says nothing."""
    rids: list[str] = []
    responses = {}
    with trio.fail_after(DEADLINE * 3):
        async with RemoteEngine(router=running.router) as engine:
            before = engine.get_version()

            async def generate(rid: str) -> None:
                gconfig = GenerationConfig(max_new_tokens=48, ignore_eos=True)
                responses[rid] = await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=gconfig, rid=rid))

            async with trio.open_nursery() as nursery:
                for wave in range(3):
                    prefix = f"update-{wave}-"
                    rids += [f"{prefix}{i}" for i in range(8)]
                    for rid in rids[-8:]:
                        nursery.start_soon(generate, rid)
                    while True:  # state, polled: on a worker or answered
                        running_now = await in_flight(urls(running), prefix)
                        answered = len([r for r in responses if r.startswith(prefix)])
                        if answered == 8 or (running_now and running_now + answered >= 8):
                            break
                        await trio.sleep(0.01)
                    if answered < 8:
                        break
                await engine.update_weights(checkpoint, version=before + 1)
            assert engine.get_version() == before + 1
        versions = [await worker_version(u) for u in urls(running)]
    assert sorted(responses) == sorted(rids)  # none lost, none failed
    for r in responses.values():
        assert r.output_len == 48
        assert list(r.output_versions) == sorted(r.output_versions)  # old tokens, then new ones
        assert set(r.output_versions) <= {before, before + 1}
    assert any(before + 1 in r.output_versions for r in responses.values())  # updated under them
    assert versions == [str(before + 1)] * 2


async def test_two_updates_in_a_row_with_requests_in_flight_lose_nothing(running, checkpoint):
    """A wave of 4 before each of two updates (from tests/test_remote_router.py, which ran the
    same stack with a router started by hand): the second wave starts past the first update,
    and every answer's versions only go up. An update waits until its wave is on a worker or
    already answered (on a loaded machine it may finish between two looks)."""
    g = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    results: dict[int, list[Any]] = {1: [], 2: []}
    with trio.fail_after(DEADLINE * 2):
        async with RemoteEngine(router=running.router) as engine:
            start = engine.get_version()

            async def one(wave: int, i: int) -> None:
                rid = f"twice-{wave}-{i}"
                results[wave].append(await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g, rid=rid)))

            async with trio.open_nursery() as nursery:
                for k in (1, 2):
                    for i in range(4):
                        nursery.start_soon(one, k, i)
                    while len(results[k]) < 4 and not await in_flight(urls(running), f"twice-{k}-"):
                        await trio.sleep(0.02)
                    await engine.update_weights(checkpoint, version=start + k)
            assert engine.get_version() == start + 2
        paused = [(await stats(u))["paused"] for u in urls(running)]
    assert [len(results[1]), len(results[2])] == [4, 4]  # 0 lost
    assert all(r.output_versions[0] >= start + 1 for r in results[2])  # sent after the first update
    for r in results[1] + results[2]:
        versions = list(r.output_versions)
        assert r.output_len == 24 and versions == sorted(versions) and start <= versions[0] <= versions[-1] <= start + 2
    assert paused == [None, None]


async def test_a_worker_added_and_one_killed_mid_run_lose_nothing(running, checkpoint, caplog):
    """A worker registered with the router mid-run is brought to the fleet's version (out of
    the router while it reloads) before it serves; killing it with requests on it loses
    none, and the next update skips it with a logged error naming it."""
    extra = ServeProcess("--step-delay", "0.01", "--segment-tokens", "4")
    responses, failures = {}, []
    try:
        with trio.fail_after(DEADLINE * 2):
            async with RemoteEngine(router=running.router) as engine, httpx.AsyncClient(timeout=10) as client:
                await engine.update_weights(checkpoint, version=engine.get_version() + 1)
                version = engine.get_version()

                async def generate(rid: str, tokens: int) -> None:
                    gconfig = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
                    try:
                        responses[rid] = await engine.agenerate(ModelRequest(input_ids=[7, 8], gconfig=gconfig, rid=rid))
                    except Exception as exc:  # counted: the assertion below says what went wrong
                        failures.append((rid, repr(exc)))

                async with trio.open_nursery() as nursery:
                    for i in range(4):  # long answers, in flight on the fleet's workers while one joins
                        nursery.start_soon(generate, f"before-join-{i}", 96)
                    await wait_reached(urls(running), "before-join-", 4)
                    added = await client.post(running.router + "/workers", json={"url": extra.url})
                    assert added.status_code < 300, added.text
                    while extra.url not in await healthy_workers(client, running.router):
                        await trio.sleep(0.05)
                    await engine.check_fleet()  # what the engine does every health_interval
                    assert await worker_version(extra.url) == str(version)
                    while extra.url not in await healthy_workers(client, running.router):  # given back
                        await trio.sleep(0.05)  # until the router's own health check passes it
                    for i in range(9):
                        nursery.start_soon(generate, f"after-join-{i}", 32)
                    await wait_reached([extra.url], "after-join-", 1)  # the new worker serves
                    extra.kill()
                caplog.clear()
                await engine.update_weights(checkpoint, version=version + 1)  # the dead worker is skipped
                assert engine.get_version() == version + 1
                skipped = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
                assert any(extra.url in m and "taken out of service" in m for m in skipped), skipped
    finally:
        extra.stop()
        for url, worker_id in [(w["url"], w["id"]) for w in httpx.get(running.router + "/workers", timeout=10).json()["workers"]]:
            if url == extra.url:
                httpx.delete(f"{running.router}/workers/{worker_id}", timeout=10)
    assert failures == []
    assert len(responses) == 13 and all(r.output_len == (96 if "before" in rid else 32) for rid, r in responses.items())
    assert all(set(r.output_versions) == {version} for r in responses.values())


async def healthy_workers(client: httpx.AsyncClient, router: str) -> list[str]:
    return [w["url"] for w in (await client.get(router + "/workers")).json()["workers"] if w["is_healthy"]]


def trainer(router: str, rank: int, *args: str) -> subprocess.Popen[str]:
    """A trainer process (tests/fleet_trainer.py), forked from the warm CLI (tests/warm_cli.py)."""
    return WarmPopen(
        [sys.executable, "-m", "tests.fleet_trainer", router, str(rank), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_two_trainer_processes_share_the_fleet_one_updates_the_other_adopts(running, checkpoint):
    ranks = [trainer(running.router, rank, "--updates", "2", "--checkpoint", checkpoint) for rank in (0, 1)]
    out, err = [Lines(p.stdout) for p in ranks], [Lines(p.stderr) for p in ranks]
    try:
        starts = [int(lines.expect(r"^ready (\d+)$")[1]) for lines in out]
        assert starts[0] == starts[1]  # both adopted the servers' version at start
        for p in ranks:
            p.stdin.write("start\n")
            p.stdin.flush()
        for _ in range(2):  # rank 0's publications, broadcast to rank 1 as a trainer's own channel would
            published = out[0].expect(r"^updated (\d+)$", timeout=DEADLINE)[1]
            ranks[1].stdin.write(f"version {published}\n")
            ranks[1].stdin.flush()
            out[1].expect(rf"^adopted {published}$", timeout=DEADLINE)
        results = [json.loads(lines.expect(r"^\{.*\}$", timeout=DEADLINE)[0]) for lines in out]
        statuses = [p.wait(DEADLINE) for p in ranks]
    except AssertionError as e:  # say why a rank stopped: its stderr
        raise AssertionError(f"{e}; ranks' stderr: {[lines.tail() for lines in err]}") from None
    finally:
        for p, lines in zip(ranks, out):
            if p.poll() is None:
                p.kill()
                p.wait(10)
            p.stdin.close()
            lines.close()
        for lines in err:
            lines.close()
    assert statuses == [0, 0], (results, [e.seen[-5:] for e in err])
    for result in results:
        assert result["failed"] == 0 and result["rejected"] == 0 and result["accepted"] >= 8, result
        assert result["engine_version"] == starts[0] + 2, result
    assert starts[0] + 2 in results[1]["versions_seen"], results  # rank 1 generated on rank 0's weights
