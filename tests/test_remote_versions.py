"""Versions cannot be poisoned (issue 34 item 3): the fleet's version is what this
engine's control plane set; a server that disagrees is taken out of service and brought
back, never the others refused, never followed because one server says so; labels are
canonical decimal integers in int64. Real HTTP servers on loopback (FakeServer)."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_trio import GenerationConfig, ModelRequest, Trajectory, VersionLabelError
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.engines._version_policy import INT64_MAX, parse_version_label

from .conftest_remote import FakeServer, Reply, default_reply, sglang_body

G = GenerationConfig(max_new_tokens=2)


def worker(generate_label: Any, info_label: Any = "0") -> Any:
    """An SGLang worker reporting ``info_label`` on its control plane and labelling its
    answers ``generate_label`` (set ``script.label`` / ``script.info`` to change them)."""

    async def script(method: str, path: str, body: Any) -> Reply:
        if path == "/get_model_info":
            return 200, {"weight_version": script.info}  # type: ignore[attr-defined]
        if path == "/generate":
            answer = sglang_body([7] * body["sampling_params"]["max_new_tokens"])
            answer["meta_info"]["weight_version"] = script.label  # type: ignore[attr-defined]
            return 200, answer
        if path == "/update_weights_from_disk":
            script.label = script.info = body["weight_version"]  # type: ignore[attr-defined]
        return await default_reply(method, path, body)

    script.label = generate_label  # type: ignore[attr-defined]
    script.info = info_label  # type: ignore[attr-defined]
    return script


def engine(*addresses: str, **kw: Any) -> RemoteEngine:
    kw.setdefault("retry", RetryPolicy(attempts=4, backoff_base=0.01, backoff_max=0.02))
    kw.setdefault("health_interval", 3600)
    return RemoteEngine(list(addresses), setup_timeout=10, seed=0, **kw)


async def started(nursery: trio.Nursery, *scripts: Any) -> list[FakeServer]:
    servers = [FakeServer(s) for s in scripts]
    for s in servers:
        await nursery.start(s.run)
    return servers


# --------------------------------------------------------------------- labels


@pytest.mark.parametrize(
    "label, rule",
    [
        (10**30, "range"), (2**63, "range"), (str(10**30), "canonical"), (str(2**63), "range"),
        ("1_000", "canonical"), (" 7 ", "canonical"), ("\u0663", "canonical"), ("-5", "canonical"), (-5, "range"),
        ("007", "canonical"), ("+5", "canonical"), ("7.0", "canonical"), ("", "canonical"), ("0x10", "canonical"),
        (True, "type"), (7.0, "type"), (None, "type"), (["7"], "type"),
    ],
)  # fmt: skip
def test_a_label_that_is_not_a_canonical_int64_is_a_typed_error(label: Any, rule: str) -> None:
    with pytest.raises(VersionLabelError, match="weight_version") as info:
        parse_version_label(label, "weight_version")
    assert info.value.rule == rule and info.value.field == "weight_version"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("label, value", [("0", 0), ("7", 7), ("default", 0), (str(INT64_MAX), INT64_MAX), (INT64_MAX, INT64_MAX), (3, 3)])
def test_canonical_labels_are_read(label: Any, value: int) -> None:
    assert parse_version_label(label, "v") == value


@pytest.mark.parametrize("bad", [-1, 2**63, True, "3", 1.0])
async def test_the_api_refuses_versions_outside_int64(bad: Any) -> None:
    eng = engine("127.0.0.1:9")
    with pytest.raises(VersionLabelError, match="set_version"):
        eng.set_version(bad)
    with pytest.raises(VersionLabelError, match="RemoteEngine.version"):
        engine("127.0.0.1:9", version=bad)


# --------------------------------------------------------------------- poisoned answers


async def test_one_server_labelling_its_answers_999_fails_no_request_on_the_honest_one() -> None:
    """On main: the engine adopted 999 and refused the honest server (4 of 10 failed)."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            honest, poisoned = await started(nursery, worker("0"), worker("999"))
            async with engine(honest.address, poisoned.address) as eng:
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(10)]
                assert all(o.output_versions == (0, 0) for o in outs)
                assert eng.get_version() == 0
                good, bad = eng.servers
                assert good.up and not bad.up and bad.barred
                assert "newer than the fleet's 0" in str(bad.error)
                for o in outs:
                    Trajectory.from_response(o, 1.0)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("label", [10**30, 2**63, str(2**63), "1_000", " 0 ", "\u0660", "-5", "abc", 1.5])
async def test_an_answer_with_a_bad_label_is_dropped_and_its_server_taken_out(label: Any) -> None:
    """On main: 10**30 / 2**63 were adopted (every Trajectory.from_response then raised
    OverflowError) and "1_000", " 0 " were read with int()."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            honest, poisoned = await started(nursery, worker("0"), worker(label))
            async with engine(honest.address, poisoned.address) as eng:
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(6)]
                assert all(o.output_versions == (0, 0) for o in outs) and eng.get_version() == 0
                assert not eng.servers[1].up and eng.servers[0].up
                for o in outs:
                    Trajectory.from_response(o, 1.0)
            nursery.cancel_scope.cancel()


async def test_a_poisoned_server_comes_back_once_it_holds_the_fleets_version_again() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            honest, poisoned = await started(nursery, worker("0"), worker("0"))
            script = poisoned.script
            async with engine(honest.address, poisoned.address) as eng:
                script.label = script.info = "1000"  # type: ignore[attr-defined]  # a local user relabels it
                for i in range(4):
                    await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}"))
                await eng.check_fleet()
                assert not eng.servers[1].up  # still relabelled: stays out
                script.label = script.info = "0"  # type: ignore[attr-defined]
                await eng.check_fleet()
                assert eng.servers[1].up and eng.get_version() == 0
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"s{i}")) for i in range(4)]
                assert all(o.output_versions == (0, 0) for o in outs)
                assert len(poisoned.paths("/generate")) >= 2  # it serves again
            nursery.cancel_scope.cancel()


async def test_a_majority_of_servers_at_a_newer_version_is_followed_one_is_not() -> None:
    """An engine that only observes (another rank published) follows a quorum of the
    servers in service, read over the control plane; a lone server never moves it."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b, c = await started(nursery, worker("0"), worker("0"), worker("0"))
            async with engine(a.address, b.address, c.address) as eng:
                c.script.label = c.script.info = "5"  # type: ignore[attr-defined]
                for i in range(6):
                    out = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}"))
                    assert out.output_versions == (0, 0)
                assert eng.get_version() == 0 and [s.up for s in eng.servers] == [True, True, False]
                for s in (a, b):
                    s.script.label = s.script.info = "5"  # type: ignore[attr-defined]
                await eng.check_fleet()  # c holds 5 now like the others: back
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"s{i}")) for i in range(6)]
                assert all(o.output_versions == (5, 5) for o in outs) and eng.get_version() == 5
            nursery.cancel_scope.cancel()


async def test_set_version_moves_the_fleet_and_servers_still_behind_go_out() -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b = await started(nursery, worker("0"), worker("0"))
            async with engine(a.address, b.address) as eng:
                a.script.label = a.script.info = "3"  # type: ignore[attr-defined]
                eng.set_version(3)  # the trainer pushed version 3 (to a)
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(4)]
                assert all(o.output_versions == (3, 3) for o in outs)
                assert [s.up for s in eng.servers] == [True, False]
                assert "sent when the fleet was at version 3" in str(eng.servers[1].error)
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------- through a router


class FakeRouter:
    """An sglang-router look-alike on loopback: lists its workers, forwards /generate in
    turn to those it still lists, and takes DELETE /workers/{id} and POST /workers."""

    def __init__(self, workers: list[FakeServer]) -> None:
        self.listed = {f"http://{w.address}": w for w in workers}
        self.all = dict(self.listed)
        self.turn = itertools.count()
        self.server = FakeServer(self.script)

    async def script(self, method: str, path: str, body: Any) -> Reply:
        if path == "/health":
            return 200, b""
        if path == "/workers" and method == "GET":
            return 200, {"workers": [{"id": url.rsplit(":", 1)[1], "url": url} for url in self.listed]}
        if path.startswith("/workers/") and method == "DELETE":
            port = path.rsplit("/", 1)[1]
            self.listed = {u: w for u, w in self.listed.items() if not u.endswith(":" + port)}
            return 202, {"status": "accepted"}
        if path == "/workers" and method == "POST":
            self.listed[body["url"]] = self.all[body["url"]]
            return 202, {"status": "accepted"}
        if path == "/generate":
            targets = list(self.listed.values())
            target = targets[next(self.turn) % len(targets)]
            async with httpx.AsyncClient() as client:
                answer = await client.post(f"http://{target.address}/generate", json=body)
            return answer.status_code, answer.json()
        return 404, {"error": "no route"}


async def test_through_a_router_a_poisoned_worker_is_found_and_taken_out_of_the_router() -> None:
    """On main: 9 of 20 requests failed through sglang-router."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            honest, poisoned = await started(nursery, worker("0"), worker("0"))
            router = FakeRouter([honest, poisoned])
            await nursery.start(router.server.run)
            async with RemoteEngine(
                router=router.server.address, setup_timeout=10, seed=0, health_interval=3600,
                retry=RetryPolicy(attempts=4, backoff_base=0.01, backoff_max=0.02),
            ) as eng:  # fmt: skip
                poisoned.script.label = poisoned.script.info = "999"  # type: ignore[attr-defined]
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(20)]
                assert all(o.output_versions == (0, 0) for o in outs) and eng.get_version() == 0
                assert [s.up for s in eng.servers] == [True, False]
                assert list(router.listed) == [f"http://{honest.address}"]  # out of the router too
                poisoned.script.label = poisoned.script.info = "0"  # type: ignore[attr-defined]
                await eng.check_fleet()
                assert [s.up for s in eng.servers] == [True, True] and len(router.listed) == 2
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------- hostile answers, at large

#: What a hostile server may put where a weight version goes.
hostile_versions = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.integers(min_value=1, max_value=INT64_MAX).map(str),
    st.sampled_from(["1_000", " 7 ", "\u0663", "-5", "007", "+1", "1e3", "0x1", "default ", "DEFAULT", "inf", "nan"]),
    st.text(max_size=12),
    st.floats(allow_nan=True),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=hostile_versions, info=st.one_of(st.just("0"), hostile_versions))
def test_hostile_version_answers_never_move_the_fleet_or_fail_the_honest_server(answer: Any, info: Any) -> None:
    """Whatever one server reports (in its answers, on its control plane), every request
    succeeds on the fleet's version and the engine's version never moves."""

    async def main() -> None:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                honest, hostile = await started(nursery, worker("0"), worker("0"))
                async with engine(honest.address, hostile.address) as eng:
                    hostile.script.label, hostile.script.info = answer, info  # type: ignore[attr-defined]
                    for i in range(4):
                        out = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}"))
                        assert out.output_versions == (0, 0)
                        Trajectory.from_response(out, 1.0)
                    await eng.check_fleet()
                    out = await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid="last"))
                    assert out.output_versions == (0, 0) and eng.get_version() == 0
                    assert eng.servers[0].up
                nursery.cancel_scope.cancel()

    trio.run(main)
