"""Per-row token sampling for LocalEngine's batched decode loop.

Reported logprobs are ``log_softmax(logits / T)`` over the full vocabulary at the chosen
token (SGLang's default and what the trainer recomputes): top-k / top-p decide which
tokens may be drawn but do not renormalise the reported value. Greedy rows (``greedy`` or
``T == 0``) take the argmax and report ``log_softmax(logits)`` (``T = 1``). Rows still under
their ``min_new_tokens`` have their stop tokens masked out first, so the reported value is
of the distribution actually drawn from.

Rows share one batched step, so no row's settings may make that step fail for the others:
a temperature under ``MIN_TEMPERATURE`` samples greedily (SGLang's rule; float32 logits
divided by less overflow), one over ``MAX_TEMPERATURE`` is clamped to it (the
distribution is uniform long before), and top-p always keeps the most likely token (a
``top_p`` such as 1e-300 rounds to 0 in float32 and would otherwise drop every token).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs
import torch

__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "RowSampling", "sample_rows"]

MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4


def _temperature(t: float) -> float:
    """The temperature a row samples with (0: greedy), safe for the shared float32 step."""
    return 0.0 if not t >= MIN_TEMPERATURE else min(t, MAX_TEMPERATURE)


@attrs.frozen
class RowSampling:
    """How one row picks its next token.

    ``generator`` is the row's own seeded generator, or None to draw from the engine's
    shared generator (never torch's global one).
    """

    temperature: float  # 0 means greedy
    top_k: int | None
    top_p: float
    generator: torch.Generator | None


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[RowSampling],
    masked: Sequence[Collection[int]],
    shared: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Choose one token per row.

    Args:
        logits: float32 ``[rows, vocab]``.
        rows: each row's settings.
        masked: token ids each row may not choose this step (stop ids under min_new_tokens).
        shared: the engine's generator for rows without their own.

    Returns:
        ``(tokens, logprobs)``, one entry per row.
    """
    if any(masked):
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, ids in enumerate(masked):
            # A mask covering the whole vocabulary would leave the row nothing to draw and
            # fail the shared step for every row (LocalEngine refuses such a request; this
            # keeps the step safe whatever reaches it).
            if ids and len(ids) < vocab:
                logits[i, list(ids)] = float("-inf")
    row_temps = [_temperature(r.temperature) for r in rows]
    temps = torch.tensor([t if t > 0 else 1.0 for t in row_temps], dtype=logits.dtype, device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logp.argmax(dim=-1)
    plain: list[int] = []  # sampled rows with no filter and no own generator: one batched draw
    for i, r in enumerate(rows):
        if row_temps[i] <= 0:
            continue
        if r.top_k is None and r.top_p >= 1.0 and r.generator is None:
            plain.append(i)
            continue
        probs = _filtered_probs(logp[i], r.top_k, r.top_p)
        tokens[i] = torch.multinomial(probs, 1, generator=r.generator if r.generator is not None else shared)[0]
    if plain:
        idx = torch.tensor(plain, dtype=torch.long, device=logits.device)
        tokens[idx] = torch.multinomial(logp[idx].exp(), 1, generator=shared)[:, 0]
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _filtered_probs(logp: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Probabilities after top-k then top-p filtering (renormalised for drawing only)."""
    scores = logp
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first one is always kept).
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        drop[..., 0] = False  # even when top_p rounds to 0 in the logits' dtype
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs
