"""Multi-turn RLVR: answer, get feedback when the reward is 0, answer again (spec §10.2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import workflow_context
from .._config import GenerationConfig
from .._io import ModelRequest
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow
from ._common import as_reward_function, default_get_input_ids, load_tokenizer, prompt_ids

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["FEEDBACK", "MultiTurnWorkflow"]

#: The user turn inserted after an attempt whose reward is 0.
FEEDBACK = (
    "Your answer is either wrong or not parsable to the reward function. You may misunderstand the "
    "original question. Please carefully read the original question, check the previous errors, and "
    "try to answer it again."
)
_FILLER = [{"role": "assistant", "content": "some random message."}]


class MultiTurnWorkflow(RolloutWorkflow):
    """Retry with feedback until an attempt earns a non-zero reward or ``max_turns`` run out.

    Every attempt's tokens train (``loss_mask`` 1) and share the final reward,
    ``reward_k * turn_discount ** (k - 1)`` for success at attempt ``k`` (0.0 when all
    fail). Inserted tokens (an eos after an attempt that lacks one, then the feedback
    turn and the assistant header) have ``loss_mask`` 0, ``versions`` -1, ``turn_ids`` -1.
    The loop stops on any non-zero reward, negative ones included, as the reference does.

    Args:
        reward_fn: as for :class:`RLVRWorkflow`.
        gconfig: sampling settings (eos and pad ids added as stop ids).
        tokenizer: a tokenizer with a chat template, or a local path.
        max_turns: attempts at most (> 0).
        turn_discount: factor per extra attempt, in (0, 1].

    Raises:
        ValueError: ``max_turns`` or ``turn_discount`` out of range, or a tokenizer whose
            chat template does not render a conversation as a prefix of its continuation.
        TypeError: ``reward_fn`` is not a callable or an import string.
    """

    def __init__(
        self,
        reward_fn: Any,
        gconfig: GenerationConfig | None = None,
        tokenizer: Any = None,
        max_turns: int = 2,
        turn_discount: float = 1.0,
    ) -> None:
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns <= 0:
            raise ValueError("max_turns must be positive")
        if not 0 < turn_discount <= 1:
            raise ValueError("turn_discount must be in (0, 1].")
        self.tokenizer = load_tokenizer(tokenizer)
        self.gconfig = (gconfig or GenerationConfig()).new(n_samples=1).with_stop_and_pad_token_ids(self.tokenizer)
        self.reward = as_reward_function(reward_fn)
        self.max_turns = max_turns
        self.turn_discount = float(turn_discount)
        render = self.tokenizer.apply_chat_template
        head = list(render(_FILLER, add_generation_prompt=False, tokenize=True, return_dict=False))
        full = list(
            render([*_FILLER, {"role": "user", "content": FEEDBACK}], add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        if full[: len(head)] != head:
            raise ValueError("tokenizer: its chat template must render a conversation as a prefix of its continuation")
        #: The feedback user turn plus the assistant header, appended after a failed attempt.
        self.multi_turn_prompt_ids: list[int] = full[len(head) :]

    def __repr__(self) -> str:
        return f"MultiTurnWorkflow({self.reward!r}, max_turns={self.max_turns}, turn_discount={self.turn_discount})"

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> Trajectory:
        messages = data["messages"]
        input_ids = await prompt_ids(lambda: default_get_input_ids(messages, self.tokenizer, False), messages)
        eos = self.tokenizer.eos_token_id
        seq: list[int] = []
        logprobs: list[float] = []
        loss_mask: list[int] = []
        versions: list[int] = []
        turn_ids: list[int] = []
        t, reward, discount = 0, 0.0, 1.0
        truncated = False
        while reward == 0.0 and t < self.max_turns:
            resp = await engine.agenerate(ModelRequest(input_ids=input_ids, gconfig=self.gconfig, tokenizer=self.tokenizer))
            inp, out = list(resp.input_tokens), list(resp.output_tokens)
            reward = await self.reward(self.tokenizer.decode(inp), self.tokenizer.decode(out), inp, out, **data)
            new = len(inp) - len(seq)
            if inp[: len(seq)] != seq:
                raise RuntimeError("MultiTurnWorkflow: the engine's input tokens do not extend the conversation so far")
            seq += inp[len(seq) :] + out
            logprobs += [0.0] * new + list(resp.output_logprobs)
            loss_mask += [0] * new + [1] * len(out)
            versions += [-1] * new + list(resp.output_versions)
            turn_ids += [-1] * new + [t] * len(out)
            truncated = resp.stop_reason == "length"
            t += 1
            if reward == 0.0 and t < self.max_turns:
                input_ids = [*input_ids, *out]
                if out and eos is not None and out[-1] != eos:
                    input_ids.append(eos)
                input_ids += self.multi_turn_prompt_ids
                discount *= self.turn_discount
        reward = float(reward * discount)
        workflow_context.stats_recorder().record(workflow_context.stat_scope(), {"reward": reward, "num_turns": t})

        def row(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([values], dtype=dtype)

        return Trajectory(
            input_ids=row(seq, torch.int32),
            attention_mask=torch.ones(1, len(seq), dtype=torch.bool),
            loss_mask=row(loss_mask, torch.int32),
            logprobs=row(logprobs, torch.float32),
            versions=row(versions, torch.int32),
            rewards=torch.tensor([reward], dtype=torch.float32),
            is_truncated=torch.tensor([truncated]),
            extras={"turn_ids": row(turn_ids, torch.int32)},
        )
