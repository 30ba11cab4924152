"""Per-row token sampling for LocalEngine's batched decode loop.

Reported logprobs are ``log_softmax(logits / T)`` over the full vocabulary at the chosen
token (SGLang's default and what the trainer recomputes): top-k / top-p decide which
tokens may be drawn but do not renormalise the reported value. Greedy rows (``greedy`` or
``T == 0``) take the argmax and report ``log_softmax(logits)`` (``T = 1``). Rows still under
their ``min_new_tokens`` have their stop tokens masked out first, so the reported value is
of the distribution actually drawn from.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import attrs
import torch

__all__ = ["RowSampling", "sample_rows"]


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
        for i, ids in enumerate(masked):
            if ids:
                logits[i, list(ids)] = float("-inf")
    temps = torch.tensor(
        [r.temperature if r.temperature > 0 else 1.0 for r in rows], dtype=logits.dtype, device=logits.device
    )
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logp.argmax(dim=-1)
    plain: list[int] = []  # sampled rows with no filter and no own generator: one batched draw
    for i, r in enumerate(rows):
        if r.temperature <= 0:
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
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs
