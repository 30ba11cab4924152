"""A server that comes back is labelled with a version only once it holds those weights
(issue 34 item 3): reloaded by the engine from its checkpoint, or pushed by the trainer
(``restore=``); until then it stays out of service. Real HTTP servers on loopback."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy

from .conftest_remote import FakeServer, Raw, Reply, sglang_body

G = GenerationConfig(max_new_tokens=2)


class Restartable:
    """A server's state: its label, the weights it really holds, and whether it is up.

    ``kind`` is ``"vllm"`` (stock routes: ``/weight_info``, ``/update_weight_version``
    relabels only) or ``"sglang"`` (``/update_weights_from_disk`` loads and labels)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.alive = True
        self.label = "default"
        self.weights = "base"
        self.relabels: list[str] = []
        self.server = FakeServer(self.script)

    def restart(self) -> None:
        self.alive, self.label, self.weights = True, "default", "base"

    async def script(self, method: str, path: str, body: Any) -> Reply:
        if not self.alive:
            return Raw(b"")  # the connection closes: the server is away
        if path == "/health":
            return 200, b""
        if path in ("/weight_info", "/get_model_info"):
            return 200, {"weight_version": self.label}
        if path == "/update_weight_version":
            self.label = body["new_version"]
            self.relabels.append(self.label)
            return 200, {"success": True}
        if path == "/update_weights_from_disk":
            self.label = body["weight_version"]
            self.weights = body["model_path"]
            return 200, {"success": True}
        if path in ("/pause", "/resume", "/pause_generation", "/continue_generation"):
            return 200, {"status": "ok"}
        if path == "/generate":
            answer = sglang_body([7] * body["sampling_params"]["max_new_tokens"])
            answer["meta_info"]["weight_version"] = self.label
            return 200, answer
        if path == "/inference/v1/generate":
            n = body["sampling_params"]["max_tokens"]
            choice = {
                "index": 0, "finish_reason": "length", "token_ids": [7] * n,
                "weight_versions": [{"version": self.label, "start": 0, "end": n}],
                "logprobs": {"content": [{"token_id": 7, "logprob": -1.0}] * n},
            }  # fmt: skip
            return 200, {"request_id": "generate-tokens-x", "choices": [choice]}
        return 404, {"error": f"no {path}"}


def engine(servers: list[Restartable], **kw: Any) -> RemoteEngine:
    kind = servers[0].kind
    if kind == "vllm":
        kw.setdefault("vllm_reload_path", None)
        kw.setdefault("vllm_api", "tito")
    return RemoteEngine(
        [s.server.address for s in servers], kind,  # type: ignore[arg-type]
        setup_timeout=10, seed=0, health_interval=3600, control_timeout=5,
        retry=RetryPolicy(attempts=2, backoff_base=0.01, backoff_max=0.02), **kw,
    )  # fmt: skip


async def started(nursery: trio.Nursery, kind: str, n: int = 2) -> list[Restartable]:
    out = [Restartable(kind) for _ in range(n)]
    for s in out:
        await nursery.start(s.server.run)
    return out


async def test_a_restarted_vllm_server_is_not_relabelled_without_its_weights() -> None:
    """On main (checked on a real vLLM 0.32): the engine sent the restarted server only
    /update_weight_version 1 and it served its base weights labelled 1."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b = await started(nursery, "vllm")
            async with engine([a, b]) as eng:
                b.alive = False
                a.weights = "/ckpt/1"  # the trainer pushed version 1 (NCCL, say): update_weights labels it
                await eng.update_weights("/ckpt/1", 1)
                assert a.label == "1" and not eng.servers[1].up
                b.restart()
                for _ in range(2):
                    await eng.check_fleet()
                    assert not eng.servers[1].up and b.relabels == []  # out until it holds version 1
                assert "restore=" in str(eng.servers[1].error) or b.label == "default"
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(4)]
                assert all(o.output_versions == (1, 1) for o in outs)
                assert len(b.server.paths("/inference/v1/generate")) == 0
            nursery.cancel_scope.cancel()


async def test_restore_pushes_the_weights_then_the_server_is_labelled_and_serves() -> None:
    calls: list[tuple[str, int]] = []
    failures = [RuntimeError("the trainer's broadcast group is not ready")]

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b = await started(nursery, "vllm")

            async def restore(url: str, version: int) -> None:
                calls.append((url, version))
                if failures:
                    raise failures.pop()
                b.weights = f"/ckpt/{version}"  # pushed

            async with engine([a, b], restore=restore) as eng:
                b.alive = False
                await eng.update_weights("/ckpt/1", 1)
                b.restart()
                await eng.check_fleet()  # the restore fails: it stays out, tried again next round
                assert not eng.servers[1].up and b.relabels == []
                await eng.check_fleet()
                assert eng.servers[1].up and b.weights == "/ckpt/1" and b.label == "1"
                assert calls == [(f"http://{b.server.address}", 1)] * 2
                outs = [await eng.agenerate(ModelRequest(input_ids=[1], gconfig=G, rid=f"r{i}")) for i in range(4)]
                assert all(o.output_versions == (1, 1) for o in outs)
                assert len(b.server.paths("/inference/v1/generate")) >= 1
            nursery.cancel_scope.cancel()


async def test_a_restarted_server_someone_relabelled_is_reloaded_all_the_same() -> None:
    """A label proves nothing: on main a restarted SGLang server relabelled to the fleet's
    version (base weights) was put back without a reload."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            a, b = await started(nursery, "sglang")
            async with engine([a, b]) as eng:
                b.alive = False
                await eng.update_weights("/ckpt/1", 1)
                b.restart()
                b.label = "1"  # relabelled, base weights
                await eng.check_fleet()
                assert eng.servers[1].up and b.weights == "/ckpt/1"
            nursery.cancel_scope.cancel()


def test_a_router_in_front_of_vllm_is_refused_saying_why() -> None:
    """On main it opened, and its first generate failed with a bare 404."""
    with pytest.raises(ValueError, match="sglang-router cannot front vLLM's token routes"):
        RemoteEngine(router="127.0.0.1:30000", backend="vllm")
