"""AReaL 1.0.4's side of ``python -m bench``; runs in AReaL's own environment.

A long-lived subprocess: it reads one JSON command per line on stdin, runs it, and writes
one JSON line back, so the parent can alternate between the two sides without paying
AReaL's import time per measurement. Rollouts run on uvloop, as AReaL's
``AsyncTaskRunner`` runs them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import uvloop  # noqa: E402

from bench import work  # noqa: E402
from bench.areal_client import decode, encode  # noqa: E402
from bench.areal_import import load  # noqa: E402

A = load()
log = logging.getLogger("bench.areal")


# -- a. grouped orchestration + packing (+ normalization) ------------------------------


class InstantEngine:
    """Answers at once (one loop pass), like a server with a hot cache."""

    def __init__(self) -> None:
        self.calls = 0

    async def agenerate(self, req: Any) -> Any:
        self.calls += 1
        salt = self.calls  # read before yielding: the slots of a group get different lengths
        await asyncio.sleep(0)
        out, lp, ver = work.respond(salt)
        return A.ModelResponse(input_tokens=req.input_ids, output_tokens=out, output_logprobs=lp, output_versions=ver)


class Episode(A.RolloutWorkflow):
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        resp = await engine.agenerate(A.ModelRequest(input_ids=list(data["ids"])))
        return work.six_tensors(resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions)


def group(g: int, norm: bool, episodes: int, profile: bool = False) -> dict[str, Any]:
    groups = max(1, episodes // g)
    wf = A.GroupedRolloutWorkflow(Episode(), g, log)
    normalize = A.Normalization(A.NormConfig(mean_level="group", std_level="group", group_size=g)) if norm else None

    async def main() -> float:
        engine, data = InstantEngine(), {"ids": work.PROMPT}
        await wf.arun_episode(engine, data)  # warm-up (first call imports areal.experimental.openai)
        start = time.perf_counter()
        for _ in range(groups):
            batch = await wf.arun_episode(engine, data)
            if normalize is not None:
                batch["rewards"] = normalize(batch["rewards"])
            assert batch["input_ids"].shape[0] == g
        return groups * g / (time.perf_counter() - start)

    if profile:
        return work.profiled(lambda: uvloop.run(main()))
    return {"rate": uvloop.run(main())}


# -- b. normalization alone ------------------------------------------------------------


def norm(mode: str, n: int, repeats: int) -> dict[str, Any]:
    mean, std, loo = work.NORM_MODES[mode]
    normalize = A.Normalization(A.NormConfig(mean_level=mean, std_level=std, mean_leave1out=loo, group_size=work.NORM_GROUP))
    x = work.rewards(n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        normalize(x)
        times.append(time.perf_counter() - start)
    return {"rate": n / min(times)}


# -- c. the engine client --------------------------------------------------------------


def _engine(addr: str) -> Any:
    cfg = A.InferenceEngineConfig(setup_timeout=30, request_timeout=120)
    engine = A.RemoteInfEngine(cfg, A.SGLangBackend())
    engine.initialize(addr=addr)
    return engine


def client(addr: str, conc: int, seconds: float) -> dict[str, Any]:
    engine = _engine(addr)
    gconfig = A.GenerationHyperparameters(max_new_tokens=work.CLIENT_NEW_TOKENS)

    async def main() -> float:
        async def one() -> None:
            await engine.agenerate(A.ModelRequest(input_ids=list(work.CLIENT_PROMPT), gconfig=gconfig.new()))

        await one()  # warm-up
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        count = 0

        async def worker() -> None:
            nonlocal count
            while loop.time() < end:
                await one()
                count += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return count / (time.perf_counter() - start)

    try:
        return {"rate": uvloop.run(main())}
    finally:
        engine.destroy()


# -- d. one failing slot of 8 ------------------------------------------------------------


def failure(addr: str) -> dict[str, Any]:
    import aiohttp

    engine = _engine(addr)
    running: set[int] = set()
    started = 0
    gconfig = A.GenerationHyperparameters(max_new_tokens=work.FAIL_TOKENS, ignore_eos=True)

    async def in_flight(session: aiohttp.ClientSession) -> int:
        async with session.get(f"http://{addr}/stats") as r:
            return int((await r.json())["in_flight"])

    class Slot(A.RolloutWorkflow):
        def __init__(self) -> None:
            self.next = 0

        async def arun_episode(self, eng: Any, data: dict[str, Any]) -> Any:
            nonlocal started
            i, self.next = self.next, self.next + 1
            running.add(i)
            try:
                if i == 0:  # fail once every sibling is generating on the server
                    async with aiohttp.ClientSession() as s:
                        deadline = time.monotonic() + 30
                        while await in_flight(s) < work.FAIL_SLOTS - 1:
                            if time.monotonic() > deadline:
                                raise TimeoutError("siblings never reached the server")
                            await asyncio.sleep(0.01)
                    raise RuntimeError("slot 0 fails")
                started += 1
                await eng.agenerate(A.ModelRequest(input_ids=list(work.PROMPT), gconfig=gconfig.new()))
                return None
            finally:
                running.discard(i)

    async def main() -> dict[str, Any]:
        wf = A.GroupedRolloutWorkflow(Slot(), work.FAIL_SLOTS, log)
        raised = None
        try:
            await wf.arun_episode(engine, {})
        except RuntimeError as exc:
            raised = type(exc).__name__
        siblings = len(running)
        async with aiohttp.ClientSession() as s:
            await asyncio.sleep(0.5)
            server = await in_flight(s)
            # Clean up for the next run: cancel what AReaL left running, then stop the server's work.
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0.1)
            async with s.post(f"http://{addr}/abort_request", json={"abort_all": True}) as r:
                await r.read()
        return {"raised": raised, "siblings_running": siblings, "server_in_flight": server}

    try:
        return uvloop.run(main())
    finally:
        engine.destroy()


# -- differential tests (tests/test_areal_differential.py): many cases per call ------------


def concat(cases: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """``concat_padded_tensors`` of each case (a list of tensor dicts)."""
    out = []
    for dicts in cases:
        joined = A.concat_padded_tensors([{k: decode(v) for k, v in d.items()} for d in dicts])
        out.append({k: encode(v) for k, v in joined.items()})
    return {"results": out}


def normalize(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """``Normalization(NormConfig(**config))(x, loss_mask)`` of each case."""
    out = []
    for case in cases:
        mask = case.get("mask")
        result = A.Normalization(A.NormConfig(**case["config"]))(
            decode(case["x"]), loss_mask=None if mask is None else decode(mask)
        )
        out.append(encode(result))
    return {"results": out}


OPS = {"group": group, "norm": norm, "client": client, "failure": failure, "concat": concat, "normalize": normalize}


def main() -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    print(json.dumps({"ready": True, "areal": A.version, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            out = OPS[op](**cmd)
        except Exception as exc:  # reported to the parent, which prints it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
