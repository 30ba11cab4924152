"""Grouped episodes per second: rollout_trio's nursery group vs asyncio.gather + concatenation.

Both sides run the same episode: an instant engine answers, the episode builds the
usual six tensors (input_ids, attention_mask, loss_mask, logprobs, versions, rewards),
and the group is packed (right-padded concatenation) with its rewards normalized.
The baseline is the reference's grouped wrapper (AReaL 1.0.4): ``asyncio.gather`` over
the slots with a per-slot context, the index check, its general padded concatenation,
and the same mean/std normalization, with no validation.

Run: python bench/group_bench.py [--groups N] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
import trio

from rollout_trio import GroupedRolloutWorkflow, ModelRequest, ModelResponse
from rollout_trio.workflow_context import StatsRecorder

PROMPT = list(range(1, 33))
OUT_LEN = 48


def respond(req_ids: list[int], salt: int) -> ModelResponse:
    n = OUT_LEN - (salt % 7)
    return ModelResponse(
        input_tokens=req_ids,
        output_tokens=[(salt + k) % 250 for k in range(n)],
        output_logprobs=[-0.5] * n,
        output_versions=[0] * n,
    )


def six_tensors(resp: ModelResponse) -> dict[str, torch.Tensor]:
    n_in, n_out = resp.input_len, resp.output_len
    ids = [*resp.input_tokens, *resp.output_tokens]
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int32),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
        "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * n_in + list(resp.output_logprobs)], dtype=torch.float32),
        "versions": torch.tensor([[-1] * n_in + list(resp.output_versions)], dtype=torch.int32),
        "rewards": torch.tensor([float(n_out % 3)], dtype=torch.float32),
    }


# -- rollout_trio -----------------------------------------------------------------------


class InstantEngine:
    """Answers at once (one checkpoint), like a server with a hot cache."""

    def __init__(self) -> None:
        self.calls = 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        return respond(list(req.input_ids), self.calls)


async def trio_episode(engine: InstantEngine, data: dict) -> dict[str, torch.Tensor]:
    resp = await engine.agenerate(ModelRequest(input_ids=data["ids"]))
    return six_tensors(resp)


async def run_trio(groups: int, g: int) -> float:
    engine = InstantEngine()
    group = GroupedRolloutWorkflow(trio_episode, g, reward_normalization=True, stats=StatsRecorder())
    data = {"ids": PROMPT}
    start = time.perf_counter()
    for _ in range(groups):
        out = await group.arun_episode(engine, data)
        assert out.batch_size == g
    return groups * g / (time.perf_counter() - start)


# -- baseline: asyncio.gather + concatenation, the reference's grouped wrapper ------------
#
# What AReaL 1.0.4's GroupedRolloutWorkflow does (spec/executor.md §5.4, spec/group.md §4):
# each slot sets a per-slot context and returns (index, result); asyncio.gather collects
# them; the results are sorted by index and checked; unusable ones are dropped; then the
# general N-d padded concatenation. No validation, no statistics, no cancellation.


@dataclasses.dataclass(frozen=True)
class SlotContext:
    is_eval: bool = False
    task_id: int | None = None
    sample_idx: int | None = None


_slot_context: contextvars.ContextVar[SlotContext] = contextvars.ContextVar("slot_context")


class AsyncioEngine:
    def __init__(self) -> None:
        self.calls = 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.calls += 1
        await asyncio.sleep(0)
        return respond(list(req.input_ids), self.calls)


def concat_padded(dicts: list[dict[str, torch.Tensor]], pad_value: float = 0.0) -> dict[str, torch.Tensor]:
    """The reference's padded concatenation (spec/group.md §4), for any tensor rank."""
    if not dicts:
        return {}
    if len(dicts) == 1:
        return dict(dicts[0])
    keys = set(dicts[0])
    for i, d in enumerate(dicts[1:], start=1):
        if set(d) != keys:
            raise ValueError(f"dict[{i}] has different keys than dict[0]")
    out: dict[str, torch.Tensor] = {}
    for key in dicts[0]:
        values = [d[key] for d in dicts]
        if values[0].ndim <= 1:
            out[key] = torch.cat(values, dim=0)
            continue
        if len({v.ndim for v in values}) != 1:
            raise ValueError("Dimension mismatch")
        target = [max(v.shape[d] for v in values) for d in range(1, values[0].ndim)]
        pad = 0 if key == "attention_mask" else pad_value
        padded = []
        for v in values:
            spec: list[int] = []
            for d in reversed(range(1, v.ndim)):
                spec += [0, target[d - 1] - v.shape[d]]
            padded.append(F.pad(v, spec, value=pad) if any(spec) else v)
        out[key] = torch.cat(padded, dim=0)
    return out


async def asyncio_group(engine: AsyncioEngine, g: int) -> dict[str, torch.Tensor]:
    parent = _slot_context.get(SlotContext())

    async def slot(i: int) -> tuple[int, dict[str, torch.Tensor]]:
        _slot_context.set(SlotContext(is_eval=parent.is_eval, task_id=parent.task_id, sample_idx=i))
        return i, six_tensors(await engine.agenerate(ModelRequest(input_ids=PROMPT)))

    pairs = sorted(await asyncio.gather(*(slot(i) for i in range(g))), key=lambda p: p[0])
    if [i for i, _ in pairs] != list(range(g)):
        raise RuntimeError("Grouped rollout returned invalid sample indices")
    batch = concat_padded([r for _, r in pairs if r is not None])
    r = batch["rewards"]
    std = r.std(unbiased=False)
    batch["original_rewards"] = r.clone()
    batch["rewards"] = (r - r.mean()) / (std + 1e-8 if std > 1e-8 else 1.0)
    return batch


def run_asyncio(groups: int, g: int) -> float:
    async def main() -> float:
        engine = AsyncioEngine()
        start = time.perf_counter()
        for _ in range(groups):
            out = await asyncio_group(engine, g)
            assert out["input_ids"].shape[0] == g
        return groups * g / (time.perf_counter() - start)

    return asyncio.run(main())


# -- the same slots with no assembly at all: what the event loops alone cost ------------


async def run_trio_bare(groups: int, g: int) -> float:
    engine = InstantEngine()
    data = {"ids": PROMPT}
    results: list[object] = [None] * g

    async def slot(i: int) -> None:
        results[i] = await trio_episode(engine, data)

    start = time.perf_counter()
    for _ in range(groups):
        async with trio.open_nursery() as nursery:
            for i in range(g):
                nursery.start_soon(slot, i)
    return groups * g / (time.perf_counter() - start)


def run_asyncio_bare(groups: int, g: int) -> float:
    async def main() -> float:
        engine = AsyncioEngine()

        async def slot() -> dict[str, torch.Tensor]:
            return six_tensors(await engine.agenerate(ModelRequest(input_ids=PROMPT)))

        start = time.perf_counter()
        for _ in range(groups):
            await asyncio.gather(*(slot() for _ in range(g)))
        return groups * g / (time.perf_counter() - start)

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=4096, help="episodes per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'G':>4} {'rollout_trio ep/s':>18} {'asyncio ep/s':>14} {'ratio':>7}   {'bare nursery/gather':>20}")
    for g in (8, 64):
        groups = max(1, args.episodes // g)
        ours, base, ratios, bare = [], [], [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            ours.append(trio.run(run_trio, groups, g))
            base.append(run_asyncio(groups, g))
            ratios.append(ours[-1] / base[-1])
            bare.append(trio.run(run_trio_bare, groups, g) / run_asyncio_bare(groups, g))
        print(
            f"{g:>4} {statistics.median(ours):>18,.0f} {statistics.median(base):>14,.0f} "
            f"{statistics.median(ratios):>6.2f}x   {statistics.median(bare):>19.2f}x"
        )
    print("bare: the same slots with no validation, packing or normalization, for the event loops' share")


if __name__ == "__main__":
    main()
