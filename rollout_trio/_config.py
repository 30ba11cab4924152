"""Generation hyperparameters (the reference's ``GenerationHyperparameters``)."""

from __future__ import annotations

from typing import Any

import attrs

from ._validate import int_list, is_int, is_real, rule

__all__ = ["GenerationConfig"]

#: ``top_k`` at or above this value means "no top-k filtering" (the reference's default).
TOP_K_OFF = int(1e8)


def _int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(value) if value is not None else ()


def _opt_str_tuple(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class GenerationConfig:
    """Sampling settings for one generation request.

    Every field of the reference's generation hyperparameters, with its default.
    Invalid values raise :class:`WorkflowContractError` naming the field and rule.
    ``reward_normalization`` and ``drop_incomplete_group`` are workflow-layer flags and
    are never sent to an engine.

    Args:
        n_samples: samples per prompt (>= 1).
        max_new_tokens: tokens generated at most (> 0).
        min_new_tokens: tokens generated at least before a stop counts (>= 0).
        max_tokens: prompt plus generated tokens at most (> 0).
        greedy: pick the most likely token (temperature 0).
        top_p: nucleus sampling's mass, in (0, 1].
        top_k: sample among the k most likely tokens (>= 1; ``TOP_K_OFF`` and above: off).
        temperature: sampling temperature (>= 0).
        stop_token_ids: token ids that end the generation.
        ignore_eos: keep generating past the end-of-sequence token.
        skip_special_tokens: leave special tokens out of decoded text.
        stop: strings that end the generation (a str is one), or None.
        frequency_penalty: in [-2, 2].
        seed: the sampling seed, or None.
        lora_name: the adapter the server applies.
        use_beam_search: beam search instead of sampling (where the engine has it).
        reward_normalization: the workflow layer normalizes rewards within each group.
        drop_incomplete_group: the workflow layer drops a group with an unusable slot.

    Raises:
        WorkflowContractError: a value breaks its field's rule (named with the field).
    """

    n_samples: int = attrs.field(default=1, validator=rule("n_samples >= 1", lambda v: is_int(v) and v >= 1))
    max_new_tokens: int = attrs.field(
        default=16384, validator=rule("max_new_tokens > 0", lambda v: is_int(v) and v > 0)
    )
    min_new_tokens: int = attrs.field(
        default=0, validator=rule("min_new_tokens >= 0", lambda v: is_int(v) and v >= 0)
    )
    max_tokens: int = attrs.field(default=32768, validator=rule("max_tokens > 0", lambda v: is_int(v) and v > 0))
    greedy: bool = attrs.field(default=False, validator=rule("a bool", lambda v: isinstance(v, bool)))
    top_p: float = attrs.field(default=1.0, validator=rule("0 < top_p <= 1", lambda v: is_real(v) and 0 < v <= 1))
    top_k: int = attrs.field(default=TOP_K_OFF, validator=rule("top_k >= 1", lambda v: is_int(v) and v >= 1))
    temperature: float = attrs.field(
        default=1.0, validator=rule("temperature >= 0", lambda v: is_real(v) and v >= 0)
    )
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple, validator=int_list)
    ignore_eos: bool = attrs.field(default=False, validator=rule("a bool", lambda v: isinstance(v, bool)))
    skip_special_tokens: bool = attrs.field(default=True, validator=rule("a bool", lambda v: isinstance(v, bool)))
    stop: tuple[str, ...] | None = attrs.field(
        default=None,
        converter=_opt_str_tuple,
        validator=rule("None or strings", lambda v: v is None or all(isinstance(s, str) for s in v)),
    )
    frequency_penalty: float = attrs.field(
        default=0.0, validator=rule("-2 <= frequency_penalty <= 2", lambda v: is_real(v) and -2 <= v <= 2)
    )
    seed: int | None = attrs.field(default=None, validator=rule("None or an int", lambda v: v is None or is_int(v)))
    lora_name: str = attrs.field(default="default_lora", validator=rule("a str", lambda v: isinstance(v, str)))
    use_beam_search: bool = attrs.field(default=False, validator=rule("a bool", lambda v: isinstance(v, bool)))
    reward_normalization: bool = attrs.field(
        default=False, validator=rule("a bool", lambda v: isinstance(v, bool))
    )
    drop_incomplete_group: bool = attrs.field(
        default=False, validator=rule("a bool", lambda v: isinstance(v, bool))
    )

    def new(self, **changes: Any) -> GenerationConfig:
        """A copy with ``changes`` applied (validated again)."""
        return attrs.evolve(self, **changes)

    def with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationConfig:
        """A copy whose ``stop_token_ids`` also hold the tokenizer's pad and eos ids.

        Ids the tokenizer does not define are skipped (the reference appended ``None``).
        """
        ids = list(self.stop_token_ids)
        for tid in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
            if tid is not None and tid not in ids:
                ids.append(tid)
        return self.new(stop_token_ids=tuple(ids))

    @property
    def top_k_active(self) -> bool:
        """Whether top-k filtering is on (``top_k`` below the "off" sentinel)."""
        return self.top_k < TOP_K_OFF

    @property
    def effective_temperature(self) -> float:
        """0.0 when greedy, else ``temperature``."""
        return 0.0 if self.greedy else float(self.temperature)
