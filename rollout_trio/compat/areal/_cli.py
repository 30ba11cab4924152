"""``rollout-trio run --areal-compat DIR``: AReaL's own ``rlvr.py`` on the built-in arithmetic task."""

from __future__ import annotations

import importlib
import os
from typing import Any

from ...workflows import arithmetic_reward
from ._hook import install

__all__ = ["areal_rlvr_workflow", "arithmetic_reward_areal", "check_sources"]


def arithmetic_reward_areal(prompt: str, completions: str, prompt_ids: Any, completion_ids: Any, **data: Any) -> float:
    """The built-in arithmetic reward with AReaL's reward signature (module level: picklable)."""
    return arithmetic_reward(completions, data)


def check_sources(sources: str) -> str | None:
    """Why ``sources`` cannot serve AReaL's ``rlvr.py`` (None if it can)."""
    path = os.path.join(sources, "areal", "workflow", "rlvr.py")
    return None if os.path.isfile(path) else f"no {path} (give the directory of an unpacked AReaL wheel)"


def areal_rlvr_workflow(sources: str, tokenizer: Any, *, max_new_tokens: int, temperature: float) -> Any:
    """AReaL's ``RLVRWorkflow`` loaded unchanged from ``sources`` under the compat hook.

    Raises:
        ImportError: AReaL itself is installed (the hook stays out of its way; run without
            the flag) or its ``rlvr.py`` imports a name the hook does not serve.
    """
    if not install(sources):
        raise ImportError("--areal-compat: AReaL itself is installed; the compat hook serves only in its absence")
    rlvr = importlib.import_module("areal.workflow.rlvr")
    from .cli_args import GenerationHyperparameters

    gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens, temperature=temperature)
    return rlvr.RLVRWorkflow(arithmetic_reward_areal, gconfig, tokenizer)
