"""``areal.api.cli_args`` (generation config): ``GenerationHyperparameters``."""

from __future__ import annotations

import logging
from typing import Any

import attrs

from ..._config import GenerationConfig
from ._errors import ArealCompatError

__all__ = ["GenerationHyperparameters"]

logger = logging.getLogger("rollout_trio.compat.areal")

#: AReaL's ``_OPENAI_UNSUPPORTED_ARGS`` plus the workflow-layer flags (never sent to engines).
_OPENAI_UNSUPPORTED = frozenset(
    {"min_new_tokens", "greedy", "top_k", "stop_token_ids", "ignore_eos", "skip_special_tokens",
     "lora_name", "use_beam_search", "max_tokens", "reward_normalization", "drop_incomplete_group"}
)  # fmt: skip
_MAX_NEW_TOKENS_NAME = {"completions": "max_completion_tokens", "responses": "max_output_tokens", "openai-agents": "max_tokens"}


@attrs.frozen(kw_only=True)
class GenerationHyperparameters(GenerationConfig):
    """Our :class:`~rollout_trio.GenerationConfig` with AReaL's method names.

    A subclass that adds methods only: engines and requests take it wherever they take a
    ``GenerationConfig``. Sequences are tuples (``stop_token_ids``), not lists.
    """

    def new_with_stop_and_pad_token_ids(self, tokenizer: Any) -> GenerationHyperparameters:
        """AReaL's name for :meth:`GenerationConfig.with_stop_and_pad_token_ids`."""
        return self.with_stop_and_pad_token_ids(tokenizer)  # type: ignore[return-value]

    def to_openai_args_dict(self, exclude_args: list[str] | None = None, api_format: str = "completions") -> dict[str, Any]:
        """The OpenAI client arguments for these settings, as AReaL builds them.

        Raises:
            ValueError: ``api_format`` is not ``completions``, ``responses`` or ``openai-agents``.
        """
        if api_format not in _MAX_NEW_TOKENS_NAME:
            raise ValueError(f"api_format: must be one of {sorted(_MAX_NEW_TOKENS_NAME)}, got {api_format!r}")
        excluded = set(exclude_args or ()) | _OPENAI_UNSUPPORTED
        mapping = {"n_samples": "n", "max_new_tokens": _MAX_NEW_TOKENS_NAME[api_format]}
        out: dict[str, Any] = {}
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if field.name in excluded:
                if value != field.default:
                    logger.warning("to_openai_args_dict: %s=%r is not sent to an OpenAI client", field.name, value)
                continue
            out[mapping.get(field.name, field.name)] = list(value) if isinstance(value, tuple) else value
        return out

    def to_openai_completions_args_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        """``to_openai_args_dict(api_format="completions")``."""
        return self.to_openai_args_dict(exclude_args, "completions")

    def to_openai_responses_args_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        """``to_openai_args_dict(api_format="responses")``."""
        return self.to_openai_args_dict(exclude_args, "responses")

    def to_openai_agents_model_settings_dict(self, exclude_args: list[str] | None = None) -> dict[str, Any]:
        """``to_openai_args_dict(api_format="openai-agents")``."""
        return self.to_openai_args_dict(exclude_args, "openai-agents")


def from_native(gconfig: GenerationConfig) -> GenerationHyperparameters:
    """``gconfig`` with AReaL's method names (the same values).

    Raises:
        ArealCompatError: ``gconfig`` is not a ``GenerationConfig``.
    """
    if isinstance(gconfig, GenerationHyperparameters):
        return gconfig
    if not isinstance(gconfig, GenerationConfig):
        raise ArealCompatError(f"gconfig: must be a GenerationConfig, got {type(gconfig).__name__}")
    return GenerationHyperparameters(**attrs.asdict(gconfig, recurse=False))
