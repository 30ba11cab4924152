"""Generated tokens/s of LocalEngine against plain ``model.generate``, in one run.

Two workloads, on the same K prompts and the same tiny offline model (greedy):

* ``equal``: every request generates exactly ``--new-tokens`` tokens;
* ``mixed``: request i stops after L_i tokens, L_i drawn uniform in 8..128 (seeded), as
  if it met EOS at a random point. A static batch must run until its longest row; the
  engine drops each row as it ends. Only the L_i tokens each request asked for count.

For each concurrency K (default 1, 8, 64) it times:

* ``engine``: K concurrent ``agenerate`` calls through one warm LocalEngine;
* ``sequential``: one ``model.generate`` call per prompt, one after another;
* ``static``: one batched ``model.generate`` over all K prompts (left padding);
* ``manager`` (with ``--manager``): transformers' continuous batching manager, started
  once with its cache sized explicitly (page size, blocks, batch tokens, synchronous
  batching), for comparison.

Medians over ``--repeats`` runs, and the ratios engine / sequential and engine / static.
``KiB/req`` is the peak memory of the KV cache (keys, values and mask, spare room
included) per concurrent request: the engine's own high-water mark against the cache
static ``generate`` ends with.

Usage::

    python bench/local_engine_bench.py            # 1, 8, 64 concurrent; 64 tokens; 3 repeats
    python bench/local_engine_bench.py --quick    # 1, 8 concurrent; 16 tokens; 1 repeat
    python bench/local_engine_bench.py --workload mixed --concurrency 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script from a checkout without relying on the editable install's path hooks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import trio  # noqa: E402

from rollout_trio import GenerationConfig, ModelRequest  # noqa: E402
from rollout_trio.engines import LocalEngine  # noqa: E402
from rollout_trio.models import tiny_model  # noqa: E402


def prompts(tok, k: int) -> list[list[int]]:
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {i % 10}+{(i * 7) % 10}?" + " please" * (i % 3)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(k)
    ]


def timed(fn: Callable[[], int]) -> float:
    start = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - start)


def lengths_for(workload: str, k: int, new: int, seed: int = 0) -> list[int]:
    """Tokens each of the k requests generates: all ``new``, or uniform in 8..128 (mixed)."""
    if workload == "equal":
        return [new] * k
    rng = random.Random(seed)
    return [rng.randint(8, 128) for _ in range(k)]


def sequential(model, batch: list[list[int]], lengths: list[int]) -> int:
    total = 0
    for ids, n in zip(batch, lengths):
        out = model.generate(
            torch.tensor([ids], device=model.device),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=259,
        )
        total += out.shape[1] - len(ids)
    return total


def static(model, batch: list[list[int]], lengths: list[int], peak: list[int]) -> int:
    """One left-padded batch run to the longest request; counts the tokens requested."""
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), 259, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    longest = max(lengths)
    out = model.generate(
        ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=False,
        max_new_tokens=longest,
        min_new_tokens=longest,
        pad_token_id=259,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] - width == longest
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.cache.layers) + mask.nbytes
    peak.append(held)
    return sum(lengths)


class Manager:
    """transformers' continuous batching manager, started once and sized explicitly."""

    def __init__(self, model, max_requests: int, longest: int, new: int) -> None:
        from transformers import ContinuousBatchingConfig
        from transformers import GenerationConfig as HFGenerationConfig

        page = 32
        cb = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=max_requests * (-(-longest // page)) + 8,
            max_batch_tokens=max(max_requests * longest, 256),
            use_async_batching=False,
            return_logprobs=True,
        )
        gen = HFGenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=-1, pad_token_id=259)
        self._manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self._manager.start()

    def run(self, batch: list[list[int]], lengths: list[int]) -> int:
        for ids, n in zip(batch, lengths):
            self._manager.add_request(ids, max_new_tokens=n)
        done = total = 0
        while done < len(batch):
            res = self._manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError("continuous batching manager returned no result within 60 s")
            if res.is_finished():
                done += 1
                total += len(res.generated_tokens)
        return total

    def close(self) -> None:
        self._manager.stop(block=True)


async def engine_run(engine: LocalEngine, batch: list[list[int]], lengths: list[int]) -> int:
    counts: list[int] = []

    async def one(ids: list[int], n: int) -> None:
        gconfig = GenerationConfig(greedy=True, ignore_eos=True, max_new_tokens=n)
        res = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig))
        counts.append(len(res.output_tokens))

    async with trio.open_nursery() as nursery:
        for ids, n in zip(batch, lengths):
            nursery.start_soon(one, ids, n)
    return sum(counts)


async def engine_rates(model, tok, batch: list[list[int]], lengths: list[int], repeats: int, peak: list[int]) -> list[float]:
    rates = []
    async with LocalEngine(model, tok) as engine:
        await engine_run(engine, batch[:2], [2, 2])  # warm-up
        for _ in range(repeats):
            engine._batch.peak_bytes = 0  # the KV cache's high-water mark for this run
            start = time.perf_counter()
            tokens = await engine_run(engine, batch, lengths)
            rates.append(tokens / (time.perf_counter() - start))
            peak.append(engine._batch.peak_bytes)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated K values")
    parser.add_argument("--workload", choices=["equal", "mixed", "both"], default="both")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request (equal workload)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sequential-prompts", type=int, default=8, help="prompts timed on the sequential path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--manager", action="store_true", help="also time transformers' continuous batching")
    parser.add_argument("--quick", action="store_true", help="K=1,8, 16 tokens, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.new_tokens, args.repeats = "1,8", 16, 1
    torch.set_num_threads(args.threads)
    model, tok = tiny_model(device=args.device)
    ks = [int(k) for k in args.concurrency.split(",")]
    workloads = ["equal", "mixed"] if args.workload == "both" else [args.workload]
    print(f"tiny Llama (hidden 128, 2 layers), greedy, {args.threads} torch thread(s), device {args.device}, "
          f"median of {args.repeats}; load {[round(x, 2) for x in os.getloadavg()]}")
    with torch.inference_mode():
        sequential(model, prompts(tok, 1), [2])  # warm-up
    for workload in workloads:
        what = f"{args.new_tokens} tokens each" if workload == "equal" else "8..128 tokens each (uniform)"
        print(f"\n{workload}: {what}")
        head = f"{'K':>4} {'engine tok/s':>13} {'sequential':>11} {'static':>9}"
        head += f" {'manager':>9}" if args.manager else ""
        print(head + f" {'eng/seq':>8} {'eng/static':>10} {'KiB/req engine':>15} {'static':>7}")
        for k in ks:
            batch = prompts(tok, k)
            lengths = lengths_for(workload, k, args.new_tokens)
            seq_n = max(1, min(k, args.sequential_prompts))
            stat_peak: list[int] = []
            eng_peak: list[int] = []
            with torch.inference_mode():
                seq = [timed(lambda: sequential(model, batch[:seq_n], lengths[:seq_n])) for _ in range(args.repeats)]
                stat = [timed(lambda: static(model, batch, lengths, stat_peak)) for _ in range(args.repeats)]
            eng = trio.run(engine_rates, model, tok, batch, lengths, args.repeats, eng_peak)
            row = [statistics.median(eng), statistics.median(seq), statistics.median(stat)]
            line = f"{k:>4} {row[0]:>13.0f} {row[1]:>11.0f} {row[2]:>9.0f}"
            if args.manager:
                man_model, _ = tiny_model(device=args.device)  # the manager switches attention kernels
                runner = Manager(man_model, k, max(len(x) for x in batch) + max(lengths), max(lengths))
                try:
                    runner.run(batch[:2], [2, 2])  # warm-up
                    man = [timed(lambda: runner.run(batch, lengths)) for _ in range(args.repeats)]
                finally:
                    runner.close()
                line += f" {statistics.median(man):>9.0f}"
            line += f" {row[0] / row[1]:>8.2f} {row[0] / row[2]:>10.2f}"
            line += f" {max(eng_peak) / k / 1024:>15.1f} {max(stat_peak) / k / 1024:>7.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
