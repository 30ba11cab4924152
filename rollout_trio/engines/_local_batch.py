"""The batched KV cache of LocalEngine's decode loop (pure torch; one thread uses it).

Rows are sequences; the cache is a ``DynamicCache`` shared by all rows, with one 2-D
attention mask marking which cache columns each row may attend to. Rows join through a
right-padded prefill whose cache is appended along the batch dimension (the shorter cache
padded with masked columns), leave through ``index_select``, and every decode step feeds
one token per row at that row's own position. Columns no row uses are dropped when rows
leave, so padding does not pile up.

Keys, values and the mask live in preallocated slabs with spare columns: a decode step
writes its one new column in place, where ``torch.cat`` would copy the whole cache every
step. A slab is reallocated (with headroom proportional to its length, so copies are
amortised) only when it is full or rows join or leave, which copy the cache anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["KVBatch", "check_supported"]

_MIN_HEADROOM = 32  # spare columns a slab gets at least; more for long caches (len // 2)


def _headroom(used: int) -> int:
    return max(_MIN_HEADROOM, used // 2)


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


def _slab_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """A ``DynamicLayer`` whose ``keys`` / ``values`` are views of larger slabs.

        ``update`` writes the new columns into the slab's spare room and re-views it.
        Anything that replaces ``keys`` (rows joining or leaving) is noticed by the slab
        no longer backing it, and the next update moves the cache into a fresh slab.
        """

        def __init__(self) -> None:
            super().__init__()
            self.key_slab: torch.Tensor | None = None
            self.value_slab: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            keys, values = self.keys, self.values
            if not self.is_initialized or keys is None or values is None or keys.numel() == 0:
                return super().update(key_states, value_states, *args, **kwargs)
            used, new = keys.shape[-2], key_states.shape[-2]
            key_slab, value_slab = self.key_slab, self.value_slab
            if key_slab is None or value_slab is None or not _backs(key_slab, keys) or used + new > key_slab.shape[-2]:
                key_slab = self.key_slab = _into_slab(keys, used + new + _headroom(used + new))
                value_slab = self.value_slab = _into_slab(values, used + new + _headroom(used + new))
            rows = keys.shape[0]
            key_slab[:rows, :, used : used + new] = key_states
            value_slab[:rows, :, used : used + new] = value_states
            self.keys = key_slab[:rows, :, : used + new]
            self.values = value_slab[:rows, :, : used + new]
            return self.keys, self.values

        def select(self, rows: torch.Tensor, cols: torch.Tensor | None) -> None:
            """Keep ``rows`` (and ``cols`` of the sequence dimension), compacted into the
            same slabs: no new slab, so the next update writes in place again."""
            keys, values = self.keys, self.values
            if keys is None or values is None or keys.numel() == 0:
                return
            self.keys = _select_into(self.key_slab, keys, rows, cols)
            self.values = _select_into(self.value_slab, values, rows, cols)

        def held_bytes(self) -> int:
            """Bytes held by this layer (slabs, spare columns included)."""
            keys, values = self.keys, self.values
            if keys is None or values is None:
                return 0
            if self.key_slab is not None and self.value_slab is not None and _backs(self.key_slab, keys):
                return self.key_slab.nbytes + self.value_slab.nbytes
            return keys.nbytes + values.nbytes

    return SlabLayer


def _backs(slab: torch.Tensor | None, view: torch.Tensor) -> bool:
    """True if ``view`` is the leading block of ``slab`` (the slab is still in use)."""
    return (
        slab is not None
        and slab.data_ptr() == view.data_ptr()
        and slab.stride() == view.stride()
        and all(v <= c for v, c in zip(view.shape, slab.shape))
    )


def _select_into(slab: torch.Tensor | None, view: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """``view[rows][:, :, cols]`` written to the front of ``slab`` when it backs ``view``."""
    kept = view.index_select(0, rows)
    if cols is not None:
        kept = kept.index_select(2, cols)
    if slab is None or not _backs(slab, view):
        return kept
    out = slab[: kept.shape[0], :, : kept.shape[2]]
    out.copy_(kept)
    return out


def _into_slab(kv: torch.Tensor, capacity: int) -> torch.Tensor:
    # [batch, heads, seq, dim] -> the same values in the first columns of a wider slab.
    slab = kv.new_empty((kv.shape[0], kv.shape[1], capacity, kv.shape[3]))
    slab[:, :, : kv.shape[2]] = kv
    return slab


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
        self._layer_class = _slab_layer_class()
        self.peak_bytes = 0  # most bytes the cache and mask have held at once
        self.clear()

    def clear(self) -> None:
        """Drop every row and the cache (an interrupt: rows re-prefill later)."""
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)
        self._mask_slab = self._mask
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

    def prefill(self, inputs: Sequence[Sequence[int]], vision: Sequence[Any] | None = None) -> torch.Tensor:
        """Run one forward pass over new rows and append them to the batch.

        Args:
            inputs: each new row's tokens so far (prompt, plus output tokens on a resume).
            vision: per row, None or its images' processor tensors (``pixel_values``,
                ``image_grid_thw``) for a Qwen-VL-style model: the pass embeds the images
                and gives every row its 3-D (mrope) positions; later decode steps continue
                each row's text positions from there.

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
        extra: dict[str, Any] = {}
        next_pos = lengths
        if vision is not None and any(v is not None for v in vision):
            extra, positions, next_pos = self._vision_inputs(ids, mask, lengths, vision)
        cache = DynamicCache(config=self._model.config)
        cache.layers = [self._layer_class() for _ in cache.layers]
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kw: cache},
            logits_to_keep=keep,
            **extra,
        )
        col = torch.searchsorted(keep, last)
        logits = out.logits[torch.arange(len(inputs), device=self._device), col].float()
        self._append(cache, mask, next_pos)  # the cache object is filled in place
        self._note_bytes()
        return logits

    def _vision_inputs(
        self, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, vision: Sequence[Any]
    ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        """The image inputs of a prefill, its 3-D positions, and each row's next text position."""
        rows = [v for v in vision if v is not None]
        pixels = torch.cat([v["pixel_values"] for v in rows]).to(self._device, self._model.dtype)
        grid = torch.cat([v["image_grid_thw"] for v in rows]).to(self._device)
        types = (ids == int(self._model.config.image_token_id)).to(torch.int32)
        positions, deltas = self._model.model.get_rope_index(ids, types, image_grid_thw=grid, attention_mask=mask)
        extra = {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": types}
        return extra, positions, lengths + deltas.reshape(-1).to(lengths.device, lengths.dtype)

    def decode(self) -> torch.Tensor:
        """One forward pass feeding each row's last token; returns logits ``[rows, vocab]``."""
        self._grow_mask()
        out = self._model(
            input_ids=self._last[:, None],
            attention_mask=self._mask,
            position_ids=self._next_pos[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        self._next_pos += 1
        self._note_bytes()
        return out.logits[:, -1].float()

    def _grow_mask(self) -> None:
        # One more attended column for every row, written into the mask slab's spare room.
        used = self.columns
        slab = self._mask_slab
        if not _backs(slab, self._mask) or used + 1 > slab.shape[1]:
            slab = self._mask.new_empty((self.rows, used + 1 + _headroom(used + 1)))
            slab[:, :used] = self._mask
            self._mask_slab = slab
        slab[: self.rows, used] = 1
        self._mask = slab[: self.rows, : used + 1]

    def _note_bytes(self) -> None:
        held = self._mask_slab.nbytes if _backs(self._mask_slab, self._mask) else self._mask.nbytes
        if self._cache is not None:
            held += sum(layer.held_bytes() for layer in self._cache.layers)
        self.peak_bytes = max(self.peak_bytes, held)

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
        self._next_pos = self._next_pos[idx]
        self._last = self._last[idx]
        used = self._mask.index_select(0, idx).any(dim=0)
        cols = None if bool(used.all()) else used.nonzero()[:, 0]
        mask = self._mask.index_select(0, idx)
        if cols is not None:
            mask = mask.index_select(1, cols)
        if _backs(self._mask_slab, self._mask):
            self._mask = self._mask_slab[: mask.shape[0], : mask.shape[1]]
            self._mask.copy_(mask)
        else:
            self._mask = mask
        for layer in self._cache.layers:
            layer.select(idx, cols)

    def _append(self, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        n = mask.shape[0]
        last = torch.zeros((n,), dtype=torch.long, device=self._device)
        if self._cache is None or self.rows == 0:
            self._cache, self._mask, self._next_pos, self._last = cache, mask, next_pos.clone(), last
            return
        width = max(self.columns, int(mask.shape[1]))
        self._mask = torch.cat([_pad_cols(self._mask, width), _pad_cols(mask, width)], dim=0)
        for mine, new in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_seq(mine.keys, width), _pad_seq(new.keys, width)], dim=0)
            mine.values = torch.cat([_pad_seq(mine.values, width), _pad_seq(new.values, width)], dim=0)
        self._next_pos = torch.cat([self._next_pos, next_pos])
        self._last = torch.cat([self._last, last])


def _pad_cols(mask: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - mask.shape[1]
    return mask if extra == 0 else torch.nn.functional.pad(mask, (0, extra))


def _pad_seq(kv: torch.Tensor, width: int) -> torch.Tensor:
    # [batch, heads, seq, dim]: pad the seq dimension on the right with (masked) zeros.
    extra = width - kv.shape[2]
    return kv if extra == 0 else torch.nn.functional.pad(kv, (0, 0, 0, extra))
