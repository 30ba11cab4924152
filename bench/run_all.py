"""rollout_trio side by side with AReaL 1.0.4, on identical work, in one run.

    python -m bench            # a few minutes
    python -m bench --quick    # seconds (after the first run, which builds AReaL's environment)

On first use it creates AReaL's own virtual environment (bench/areal_env.py) and
installs AReaL 1.0.4 there. AReaL's side then runs in a long-lived subprocess of that
environment (bench/areal_worker.py), ours in this process; the two alternate
measurement by measurement, so drift in the machine's load hits both alike. Printed per
case: each side's median and range, and the median ratio ours / theirs (> 1 is ours
faster) with its range over the rounds. Everything, with the machine's description and
load, is written to bench/results/<date>[-quick].json.

a. group: episodes/s of a grouped rollout with an instant engine, packing the six tensors
   of each slot, at G = 4, 16, 64, without and with group reward normalization
   (AReaL: ``GroupedRolloutWorkflow`` + ``concat_padded_tensors`` + ``Normalization``).
   "Trio alone" runs the same slots in a bare nursery with nothing assembled or checked:
   the ceiling of any grouped rollout on Trio against AReaL on uvloop.
b. norm: rewards/s of normalization alone (group, batch, leave-one-out; groups of 16).
c. client: requests/s of the engine client against one fixed-answer loopback server at
   1, 16, 128 concurrent (AReaL: ``RemoteInfEngine`` with its SGLang backend on aiohttp;
   ours: ``RemoteEngine``).
d. failure: one slot of 8 fails while the 7 others generate from ``rollout-trio serve``:
   how many siblings still run once the group has raised, and how many generations the
   server still runs 0.5 s later.
e. agent: chat completions/s of 64 agents through the agent endpoint in process (the
   client inline agents get: ``InProcessClient`` on ``InProcessTransport``) against calling
   the engine directly, rollout_trio alone (AReaL has no such endpoint). Printed beside it:
   the ceiling that client allows, 1 / (1 + direct/alone), where "alone" is the same client
   against an app answering at once, and the same two figures for a plain
   ``httpx.AsyncClient`` on ``httpx.ASGITransport`` (bench/agent_bench.py).

Targets (printed beside each ratio, issue 31): group >= 1.2x at every G with and without
normalization, and ours >= 0.95x of "Trio alone" in the same round; client >= 1.0x at every concurrency,
agent >= 0.6x.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trio  # noqa: E402

from bench import areal_env, work  # noqa: E402
from bench.areal_client import Areal  # noqa: E402
from rollout_trio import GenerationConfig, GroupedRolloutWorkflow, ModelRequest, ModelResponse  # noqa: E402
from rollout_trio import NormConfig, normalize_rewards  # noqa: E402
from rollout_trio.engines import RemoteEngine  # noqa: E402

# -- a. grouped orchestration + packing ---------------------------------------------------

GROUP_TARGET = 1.2  # ours / AReaL at every G, with and without normalization (issue 31)
ALONE_TARGET = 0.95  # ours / the bare Trio nursery of the same round (issue 31)
AGENT_TARGET = 0.6  # in-process completions / direct engine calls (issue 31)


class InstantEngine:
    """Answers at once (one checkpoint), like a server with a hot cache."""

    def __init__(self) -> None:
        self.calls = 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.calls += 1
        salt = self.calls  # read before yielding: the slots of a group get different lengths
        await trio.lowlevel.checkpoint()
        out, lp, ver = work.respond(salt)
        # As engines build their answers: from values already checked (ModelResponse.from_engine).
        return ModelResponse.from_engine(
            input_tokens=req.input_ids, output_tokens=tuple(out), output_logprobs=tuple(lp), output_versions=tuple(ver)
        )


async def episode(engine: InstantEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    resp = await engine.agenerate(ModelRequest(input_ids=data["ids"]))
    return work.six_tensors(resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions)


def trio_alone(g: int, episodes: int) -> float:
    """The same slots in a bare Trio nursery, nothing assembled or checked: the most a
    grouped rollout on Trio can reach here (the event loop's own cost per slot)."""
    groups = max(1, episodes // g)

    async def main() -> float:
        engine, data = InstantEngine(), {"ids": work.PROMPT}
        results: list[Any] = [None] * g

        async def slot(i: int) -> None:
            results[i] = await episode(engine, data)

        async def one_group() -> None:
            async with trio.open_nursery() as nursery:
                for i in range(g):
                    nursery.start_soon(slot, i)

        await one_group()  # warm-up, as on both other sides
        start = time.perf_counter()
        for _ in range(groups):
            await one_group()
        return groups * g / (time.perf_counter() - start)

    return trio.run(main)


def ours_group(g: int, norm: bool, episodes: int) -> float:
    groups = max(1, episodes // g)

    async def main() -> float:
        wf = GroupedRolloutWorkflow(episode, g, reward_normalization=norm)
        engine, data = InstantEngine(), {"ids": work.PROMPT}
        await wf.arun_episode(engine, data)  # warm-up, as on AReaL's side
        start = time.perf_counter()
        for _ in range(groups):
            out = await wf.arun_episode(engine, data)
            assert out.batch_size == g
        return groups * g / (time.perf_counter() - start)

    return trio.run(main)


# -- b. normalization alone -----------------------------------------------------------------


def ours_norm(mode: str, n: int, repeats: int) -> float:
    mean, std, loo = work.NORM_MODES[mode]
    config = NormConfig(mean_level=mean, std_level=std, leave_one_out=loo, group_size=work.NORM_GROUP)
    x = work.rewards(n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        normalize_rewards(x, config)
        times.append(time.perf_counter() - start)
    return n / min(times)


# -- c. the engine client ---------------------------------------------------------------------


def ours_client(addr: str, conc: int, seconds: float) -> float:
    gconfig = GenerationConfig(max_new_tokens=work.CLIENT_NEW_TOKENS)

    async def main() -> float:
        async with RemoteEngine(f"http://{addr}", "sglang", verify_versions=False) as engine:

            async def one() -> None:
                await engine.agenerate(ModelRequest(input_ids=list(work.CLIENT_PROMPT), gconfig=gconfig))

            await one()  # warm-up
            end = trio.current_time() + seconds
            count = 0

            async def worker() -> None:
                nonlocal count
                while trio.current_time() < end:
                    await one()
                    count += 1

            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(conc):
                    nursery.start_soon(worker)
            return count / (time.perf_counter() - start)

    return trio.run(main)


# -- e. the agent endpoint in process ------------------------------------------------------------


async def ours_agent(turns: int, rounds: int, repeats: int) -> dict[str, float]:
    """Completions/s of each path of bench/agent_bench.py, medians of interleaved rounds.

    ``in_process`` is the client inline agents get (``OpenAIEndpoint.in_process_client()``),
    ``alone`` the same client against an app answering a fixed body (its own cost);
    ``asgi`` and ``asgi_alone`` the same with a plain ``httpx.AsyncClient`` on
    ``httpx.ASGITransport`` (the path before ``InProcessTransport``), for comparison.
    """
    import httpx

    from bench import agent_bench as ab
    from rollout_trio.agents import OpenAIEndpoint

    engine = ab.InstantEngine()
    endpoint = OpenAIEndpoint(engine)  # type: ignore[arg-type]
    n = 64
    rates: dict[str, list[float]] = {"direct": [], "in_process": [], "alone": [], "asgi": [], "asgi_alone": []}
    async with (
        endpoint.in_process_client() as inproc,
        ab.fixed_answer_client() as alone,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=endpoint.app), base_url="http://agent/v1/", timeout=60) as asgi,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=ab.fixed_answer_app), base_url="http://agent/v1/", timeout=60) as asgi_alone,
    ):
        paths = {
            "direct": ab.direct(engine, turns),
            "in_process": ab.via_httpx(endpoint, turns, inproc),
            "alone": ab.via_httpx(endpoint, turns, alone),
            "asgi": ab.via_httpx(endpoint, turns, asgi),
            "asgi_alone": ab.via_httpx(endpoint, turns, asgi_alone),
        }
        for _ in range(rounds):
            for name, agent in paths.items():
                rates[name].append(await ab.measure(agent, n, turns, repeats))
    med = {name: statistics.median(v) for name, v in rates.items()}

    def ratio(path: str) -> float:
        return statistics.median(i / d for i, d in zip(rates[path], rates["direct"], strict=True))

    def ceiling(path: str) -> float:
        return statistics.median(1 / (1 + d / a) for d, a in zip(rates["direct"], rates[path], strict=True))

    return {**med, "ratio": ratio("in_process"), "ceiling": ceiling("alone"), "asgi_ratio": ratio("asgi"), "asgi_ceiling": ceiling("asgi_alone")}


# -- d. one failing slot of 8 ---------------------------------------------------------------------


async def _in_flight(client: Any, addr: str) -> int:
    return int((await client.get(f"http://{addr}/stats")).json()["in_flight"])


def ours_failure(addr: str) -> dict[str, Any]:
    import httpx

    gconfig = GenerationConfig(max_new_tokens=work.FAIL_TOKENS, ignore_eos=True)
    running: set[int] = set()
    counter = iter(range(work.FAIL_SLOTS))

    async def slot(engine: RemoteEngine, data: dict[str, Any]) -> None:
        i = next(counter)
        running.add(i)
        try:
            if i == 0:  # fail once every sibling is generating on the server
                async with httpx.AsyncClient() as client:
                    with trio.fail_after(30):
                        while await _in_flight(client, addr) < work.FAIL_SLOTS - 1:
                            await trio.sleep(0.01)
                raise RuntimeError("slot 0 fails")
            await engine.agenerate(ModelRequest(input_ids=list(work.PROMPT), gconfig=gconfig))
        finally:
            running.discard(i)

    async def main() -> dict[str, Any]:
        raised = None
        async with RemoteEngine(f"http://{addr}", "sglang") as engine:
            try:
                await GroupedRolloutWorkflow(slot, work.FAIL_SLOTS).arun_episode(engine, {})
            except* RuntimeError as eg:
                raised = type(eg.exceptions[0]).__name__
            siblings = len(running)
            async with httpx.AsyncClient() as client:
                await trio.sleep(0.5)
                server = await _in_flight(client, addr)
        return {"raised": raised, "siblings_running": siblings, "server_in_flight": server}

    return trio.run(main)


def wait_idle(addr: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while httpx.get(f"http://{addr}/stats").json()["in_flight"]:
        if time.monotonic() > deadline:
            raise RuntimeError("rollout-trio serve still generating after the failure scenario")
        time.sleep(0.05)


# -- servers --------------------------------------------------------------------------------------


@contextmanager
def server(args: list[str]) -> Iterator[str]:
    """Start a server subprocess that writes its port to the file named after it; yield host:port."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        proc = subprocess.Popen([sys.executable, *args, port_file], env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(port_file):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"server {args} did not start")
                time.sleep(0.05)
            with open(port_file) as f:
                yield "127.0.0.1:" + f.read().strip()
        finally:
            proc.terminate()
            proc.wait(10)


# -- reporting --------------------------------------------------------------------------------------


def summary(ours: list[float], theirs: list[float], floor: list[float] | None = None) -> dict[str, Any]:
    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    extra: dict[str, Any] = {}
    if floor:
        extra = {
            "alone": floor,
            "alone_ratio_median": statistics.median(f / t for f, t in zip(floor, theirs, strict=True)),
            # ours against the bare nursery of the same round: how much of Trio's ceiling we keep
            "ours_of_alone_median": statistics.median(o / f for o, f in zip(ours, floor, strict=True)),
        }
    return {
        **extra,
        "ours": ours,
        "theirs": theirs,
        "ours_median": statistics.median(ours),
        "theirs_median": statistics.median(theirs),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def line(label: str, s: dict[str, Any], unit: str, target: float | None) -> str:
    def rng(v: list[float]) -> str:
        return f"{statistics.median(v):>11,.0f} [{min(v):,.0f}-{max(v):,.0f}]"

    mark = "" if target is None else ("  ok" if s["ratio_median"] >= target else f"  < {target:g}x target")
    text = (
        f"  {label:<22} ours {rng(s['ours']):<32} AReaL {rng(s['theirs']):<32} {unit}"
        f"  ratio {s['ratio_median']:.2f}x [{s['ratio_min']:.2f}-{s['ratio_max']:.2f}]{mark}"
    )
    if "alone" in s:
        kept = s["ours_of_alone_median"]
        mark = "  ok" if kept >= ALONE_TARGET else f"  < {ALONE_TARGET:g}x target"
        text += (
            f"\n  {'':<22} Trio alone {rng(s['alone']):<26} (no assembly, no checks)   ratio {s['alone_ratio_median']:.2f}x;"
            f"  ours / alone {kept:.2f}x{mark}"
        )
    return text


def interleave(
    rounds: int, ours: Callable[[], float], theirs: Callable[[], float], alone: Callable[[], float] | None = None
) -> dict[str, Any]:
    """``rounds`` measurements of each side, alternating which goes first (so neither always
    runs warm); ``alone``, if given, is measured next to ours in every round."""
    o: list[float] = []
    t: list[float] = []
    a: list[float] = []
    for r in range(rounds):
        if r % 2 == 0:
            o.append(ours())
            t.append(theirs())
        else:
            t.append(theirs())
            o.append(ours())
        if alone is not None:
            a.append(alone())
    return summary(o, t, a)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "trio": trio.__version__,
    }


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds per section, fewer rounds")
    p.add_argument("--only", nargs="+", choices=["group", "norm", "client", "failure", "agent", "sdk"], help="run only these sections")
    p.add_argument("--rounds", type=int, help="interleaved rounds per case (default 5, quick 2)")
    p.add_argument("--out", type=Path, help="result file (default bench/results/<date>[-quick].json)")
    p.add_argument("--profile", type=int, metavar="G", help="profile one group measurement at G on both sides, then stop")
    args = p.parse_args()
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    sections = args.only or ["group", "norm", "client", "failure", "agent", "sdk"]
    torch.set_num_threads(1)

    areal = Areal(areal_env.ensure())
    if args.profile:
        episodes = 512 if quick else 4096
        g = args.profile
        ours = work.profiled(lambda: ours_group(g, False, episodes))
        theirs = areal("group", g=g, norm=False, episodes=episodes, profile=True)
        areal.close()
        for name, r in (("rollout_trio", ours), (f"AReaL {areal.info['areal']}", theirs)):
            print(f"== {name}: {r['rate']:,.0f} episodes/s under cProfile, G={g}\n{r['profile']}")
        return 0
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "default",
        "rounds": rounds,
        "machine": machine(),
        "areal": areal.info,
        "load_before": loadavg(),
    }
    print(f"rollout_trio vs AReaL {areal.info['areal']} ({results['mode']}, {rounds} interleaved rounds per case)")
    print(f"machine: {results['machine']['cpu']}, {results['machine']['cores']} cores; load {results['load_before']}")
    try:
        if "group" in sections:
            episodes = 512 if quick else 4096
            print(f"\na. grouped rollout + packing, instant engine, {episodes} episodes per measurement (episodes/s)")
            res = results["group"] = {}
            for norm in (False, True):
                for g in (4, 16, 64):
                    s = interleave(
                        rounds, lambda: ours_group(g, norm, episodes), lambda: areal("group", g=g, norm=norm, episodes=episodes)["rate"],
                        None if norm else lambda: trio_alone(g, episodes),
                    )  # fmt: skip
                    res[f"G={g}{' norm' if norm else ''}"] = s
                    print(line(f"G={g:<3}{' + normalization' if norm else ''}", s, "ep/s", GROUP_TARGET), flush=True)
        if "norm" in sections:
            sizes = [100_000] if quick else [100_000, 1_000_000]
            reps = 1 if quick else 3
            print(f"\nb. normalization alone, groups of {work.NORM_GROUP}, best of {reps} per measurement (rewards/s)")
            res = results["norm"] = {}
            for n in sizes:
                for mode in work.NORM_MODES:
                    s = interleave(max(1, rounds // 2), lambda: ours_norm(mode, n, reps), lambda: areal("norm", mode=mode, n=n, repeats=reps)["rate"])
                    res[f"{mode} n={n:.0e}"] = s
                    print(line(f"{mode:<6} n={n:.0e}", s, "r/s", 1.0), flush=True)
        if "client" in sections:
            seconds = 0.3 if quick else 1.5
            print(f"\nc. engine client, fixed-answer loopback server, {seconds:g} s per measurement (requests/s)")
            res = results["client"] = {}
            with server([str(ROOT / "bench" / "work.py")]) as addr:
                for conc in (1, 16, 128):
                    s = interleave(max(1, rounds - 2), lambda: ours_client(addr, conc, seconds), lambda: areal("client", addr=addr, conc=conc, seconds=seconds)["rate"])
                    res[f"concurrency={conc}"] = s
                    print(line(f"{conc:>3} concurrent", s, "req/s", 1.0), flush=True)
        if "failure" in sections:
            print(f"\nd. one slot of {work.FAIL_SLOTS} fails while the others generate from rollout-trio serve")
            serve = ["-m", "rollout_trio", "serve", "--port", "0", "--threads", "1", "--step-delay", "0.02", "--port-file"]
            with server(serve) as addr:
                ours = ours_failure(addr)
                wait_idle(addr)
                theirs = areal("failure", addr=addr)
                wait_idle(addr)
            results["failure"] = {"ours": ours, "theirs": theirs}
            for name, r in (("rollout_trio", ours), ("AReaL 1.0.4", theirs)):
                print(
                    f"  {name:<13} group raised {r['raised']}; siblings still running after it raised: "
                    f"{r['siblings_running']} of {work.FAIL_SLOTS - 1}; generations on the server 0.5 s later: "
                    f"{r['server_in_flight']}"
                )
        if "agent" in sections:
            turns, reps = (2, 3) if quick else (8, 5)
            print(f"\ne. agent endpoint in process, 64 agents x {turns} completions, instant engine (completions/s)")
            results["agent"] = r = trio.run(ours_agent, turns, max(3, rounds), reps)
            mark = "  ok" if r["ratio"] >= AGENT_TARGET else f"  < {AGENT_TARGET}x target"
            print(
                f"  direct {r['direct']:,.0f}  in-process client {r['in_process']:,.0f}  client alone {r['alone']:,.0f}"
                f"  ratio {r['ratio']:.2f}x (its ceiling 1 / (1 + direct/alone) = {r['ceiling']:.2f}x){mark}"
                f"\n  {'':<6} httpx + ASGITransport {r['asgi']:,.0f}  alone {r['asgi_alone']:,.0f}"
                f"  ratio {r['asgi_ratio']:.2f}x (ceiling {r['asgi_ceiling']:.2f}x)"
            )
        if "sdk" in sections:
            from bench import agent_sdk_bench

            episodes, subproc = (128, 8) if quick else (512, 32)
            print("\nf. an openai-agents agent in process vs in subprocess mode vs a native Trio agent, instant engine (completions/s)")
            results["sdk"] = r = trio.run(agent_sdk_bench.measure, episodes, subproc, 64, rounds, 0.0, 4)
            print(agent_sdk_bench.report(r), flush=True)
    finally:
        areal.close()
    results["load_after"] = loadavg()
    print(f"\nload after: {results['load_after']}")
    out = args.out or ROOT / "bench" / "results" / f"{datetime.date.today().isoformat()}{'-quick' if quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
