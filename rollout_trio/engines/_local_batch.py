"""The batched KV cache of LocalEngine's decode loop (pure torch; one thread uses it).

Rows are sequences; the cache is a ``DynamicCache`` shared by all rows, with one 2-D
attention mask marking which cache columns each row may attend to. Rows join through a
right-padded prefill whose cache is appended along the batch dimension (the shorter cache
padded with masked columns), leave through ``index_select``, and every decode step feeds
one token per row at that row's own position. Columns no row uses are dropped when rows
leave, so padding does not pile up.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KVBatch", "check_supported"]


def check_supported(model: Any) -> None:
    """Raise ``ValueError`` if the model's cache is not plain full attention.

    Sliding-window, quantized or recurrent caches cannot be spliced row by row the way
    :class:`KVBatch` does.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        raise ValueError(
            f"model: LocalEngine supports full-attention decoder models only; this one uses {sorted(kinds)} cache layers"
        )


class KVBatch:
    """Rows of in-flight sequences sharing one KV cache and one forward pass per step.

    Args:
        model: a causal LM taking ``attention_mask``, ``position_ids`` and
            ``past_key_values``.
        device: where inputs are built (the model's device).
        pad_id: the token fed in padded prefill positions (masked; any valid id).
    """

    def __init__(self, model: Any, device: torch.device, pad_id: int) -> None:
        self._model = model
        self._device = device
        self._pad_id = pad_id
        # transformers 5.24 renamed `past_key_values` to `cache`; accept either.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.clear()

    def clear(self) -> None:
        """Drop every row and the cache (an interrupt: rows re-prefill later)."""
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)
        self._next_pos = torch.zeros((0,), dtype=torch.long, device=self._device)
        self._last = torch.zeros((0,), dtype=torch.long, device=self._device)

    @property
    def rows(self) -> int:
        """Number of rows in the batch."""
        return int(self._mask.shape[0])

    @property
    def columns(self) -> int:
        """Cache length (columns, padding included)."""
        return int(self._mask.shape[1])

    def prefill(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run one forward pass over new rows and append them to the batch.

        Args:
            inputs: each new row's tokens so far (prompt, plus output tokens on a resume).

        Returns:
            Float32 logits ``[len(inputs), vocab]`` predicting each row's next token. The
            caller must :meth:`set_last` the sampled tokens before the next :meth:`decode`.
        """
        from transformers import DynamicCache

        lengths = torch.tensor([len(x) for x in inputs], dtype=torch.long)
        width = int(lengths.max())
        ids = torch.full((len(inputs), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for i, x in enumerate(inputs):
            ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        ids, mask, lengths = (t.to(self._device) for t in (ids, mask, lengths))
        # Right padding: padded queries still see real keys (no fully masked rows, no NaN).
        positions = torch.arange(width, device=self._device).expand(len(inputs), width)
        last = lengths - 1
        keep = torch.unique(last)  # logits only at each row's last real position
        cache = DynamicCache(config=self._model.config)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kw: cache},
            logits_to_keep=keep,
        )
        col = torch.searchsorted(keep, last)
        logits = out.logits[torch.arange(len(inputs), device=self._device), col].float()
        self._append(cache, mask, lengths)  # the cache object is filled in place
        return logits

    def decode(self) -> torch.Tensor:
        """One forward pass feeding each row's last token; returns logits ``[rows, vocab]``."""
        ones = torch.ones((self.rows, 1), dtype=torch.long, device=self._device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        out = self._model(
            input_ids=self._last[:, None],
            attention_mask=self._mask,
            position_ids=self._next_pos[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._next_pos = self._next_pos + 1
        return out.logits[:, -1].float()

    def set_last(self, start: int, tokens: Sequence[int]) -> None:
        """Record the tokens rows ``start..`` feed at the next :meth:`decode`."""
        self._last[start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=self._device)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order) and drop cache columns no row uses."""
        if len(rows) == self.rows:
            return
        if not rows:
            self.clear()
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self._device)
        self._mask = self._mask[idx]
        self._next_pos = self._next_pos[idx]
        self._last = self._last[idx]
        used = self._mask.any(dim=0)
        cols = None if bool(used.all()) else used.nonzero()[:, 0]
        if cols is not None:
            self._mask = self._mask[:, cols]
        for layer in self._cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.keys = layer.keys[idx]
            layer.values = layer.values[idx]
            if cols is not None:
                layer.keys = layer.keys[:, :, cols]
                layer.values = layer.values[:, :, cols]

    def _append(self, cache: Any, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        n = mask.shape[0]
        last = torch.zeros((n,), dtype=torch.long, device=self._device)
        if self._cache is None or self.rows == 0:
            self._cache, self._mask, self._next_pos, self._last = cache, mask, lengths.clone(), last
            return
        width = max(self.columns, int(mask.shape[1]))
        self._mask = torch.cat([_pad_cols(self._mask, width), _pad_cols(mask, width)], dim=0)
        for mine, new in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_seq(mine.keys, width), _pad_seq(new.keys, width)], dim=0)
            mine.values = torch.cat([_pad_seq(mine.values, width), _pad_seq(new.values, width)], dim=0)
        self._next_pos = torch.cat([self._next_pos, lengths])
        self._last = torch.cat([self._last, last])


def _pad_cols(mask: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - mask.shape[1]
    return mask if extra == 0 else torch.nn.functional.pad(mask, (0, extra))


def _pad_seq(kv: torch.Tensor, width: int) -> torch.Tensor:
    # [batch, heads, seq, dim]: pad the seq dimension on the right with (masked) zeros.
    extra = width - kv.shape[2]
    return kv if extra == 0 else torch.nn.functional.pad(kv, (0, 0, 0, extra))
