"""KVBatch, LocalEngine's batched KV cache: exact logits while rows join and leave, and
decode steps that write into preallocated slabs instead of copying the cache."""

from __future__ import annotations

import random

import pytest
import torch

from rollout_trio.engines._local_batch import KVBatch
from rollout_trio.models import tiny_model


@pytest.fixture(scope="module")
def model():
    m, _ = tiny_model()
    return m.eval()


def _direct_logits(model, tokens: list[int]) -> torch.Tensor:
    """The next-token logits of one sequence from a full forward pass, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_logits_match_full_forward_while_rows_join_and_leave(model) -> None:
    """Every step's logits equal a cache-free forward pass of each row's sequence, across
    prefills joining rows of different lengths, rows leaving, and slab regrowth."""
    rng = random.Random(7)
    batch = KVBatch(model, torch.device("cpu"), pad_id=259)
    seqs: list[list[int]] = []
    with torch.inference_mode():
        for step in range(90):
            if step in (0, 5, 40):  # rows of different lengths join
                new = [[rng.randrange(256) for _ in range(rng.randint(1, 12))] for _ in range(3)]
                logits = batch.prefill(new)
                start = len(seqs)
                seqs += new
                rows = range(start, len(seqs))
            else:
                logits = batch.decode()
                rows = range(len(seqs))
            for i, r in enumerate(rows):
                torch.testing.assert_close(logits[i], _direct_logits(model, seqs[r]), rtol=1e-4, atol=1e-4)
            nxt = [int(t) for t in logits.argmax(-1)]
            first = rows[0]
            batch.set_last(first, nxt)
            for r, t in zip(rows, nxt):
                seqs[r].append(t)
            if step in (12, 30, 60) and len(seqs) > 1:  # a row in the middle leaves
                gone = len(seqs) // 2
                keep = [r for r in range(len(seqs)) if r != gone]
                batch.keep(keep)
                seqs = [seqs[r] for r in keep]
    assert batch.rows == len(seqs) >= 3


def test_decode_writes_the_new_column_in_place(model) -> None:
    """Between regrowths, decode steps reuse the same key storage (no copy of the cache),
    and removing a row compacts within it; the slab's spare room bounds the memory."""
    batch = KVBatch(model, torch.device("cpu"), pad_id=259)
    with torch.inference_mode():
        logits = batch.prefill([[1, 2, 3], [4, 5, 6, 7]])
        batch.set_last(0, [int(t) for t in logits.argmax(-1)])
        batch.decode()  # moves the prefill cache into a slab with spare columns
        layer = batch._cache.layers[0]
        ptr = layer.keys.data_ptr()
        for _ in range(10):
            batch.set_last(0, [int(t) for t in batch.decode().argmax(-1)])
            assert layer.keys.data_ptr() == ptr
        assert layer.keys.shape[2] == 4 + 11
        batch.keep([1])
        assert layer.keys.data_ptr() == ptr and layer.keys.shape[0] == 1
        batch.decode()
        assert layer.keys.data_ptr() == ptr
    assert 0 < batch.peak_bytes < 4 * (layer.key_slab.nbytes + layer.value_slab.nbytes)
