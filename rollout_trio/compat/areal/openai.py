"""``areal.experimental.openai``: ``ArealOpenAI``, an OpenAI client served by the engine.

AReaL's client is an ``openai.AsyncOpenAI`` whose ``chat.completions.create`` generates with
the engine and caches each completion as an interaction with its tokens. Ours is the same
class over our agent endpoint: the client talks to an :class:`~rollout_trio.OpenAIEndpoint`
through its in-process transport (no socket), and the endpoint's session records each
completion as an :class:`~rollout_trio.Interaction`. ``export_interactions`` returns those,
which the executor turns into rows like any agent's.

Differences, each a typed error rather than a silent other behaviour: ``lora_name`` is
refused; the ``responses`` API is served only where the endpoint serves it;
``tool_call_parser``/``reasoning_parser`` other than AReaL's defaults are refused (the
endpoint parses Qwen-style tool calls).
"""

from __future__ import annotations

from typing import Any, Literal


from ._errors import ArealCompatError
from .io_struct import ModelResponse

__all__ = ["ArealOpenAI"]

_BASE_URL = "http://areal-compat.invalid/v1/"

try:
    from openai import AsyncOpenAI as _AsyncOpenAI
except ImportError:  # pragma: no cover - openai is what AReaL's client is built on
    _AsyncOpenAI = None  # type: ignore[assignment,misc]


class InteractionView:
    """What ``ArealOpenAI.get_interaction`` returns: the recorded interaction, with AReaL's
    list-typed ``model_response`` (every other attribute is the interaction's)."""

    def __init__(self, interaction: Any) -> None:
        self._interaction = interaction

    @property
    def model_response(self) -> ModelResponse | None:
        native = self._interaction.model_response
        return None if native is None else ModelResponse.from_native(native)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._interaction, name)


class _Completions:
    """``chat.completions`` with AReaL's signature: ``model`` is optional (the engine's model)."""

    def __init__(self, inner: Any, model: str) -> None:
        self._inner = inner
        self._model = model

    async def create(self, **kwargs: Any) -> Any:
        kwargs.setdefault("model", self._model)
        return await self._inner.create(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _native_engine(engine: Any) -> Any:
    from .engine_api import ArealEngine

    return engine.engine if isinstance(engine, ArealEngine) else engine


class ArealOpenAI(_AsyncOpenAI if _AsyncOpenAI is not None else object):  # type: ignore[misc]
    """AReaL's engine-backed ``AsyncOpenAI``, over our agent endpoint.

    Args:
        engine: the engine an AReaL workflow's ``arun_episode`` received.
        tokenizer: the tokenizer (its chat template renders the messages).
        tool_call_parser: ``"qwen"`` only.
        reasoning_parser: ``"qwen3"`` only.
        engine_max_tokens: the largest ``max_tokens`` a request may ask for.
        chat_template_type: ``"hf"`` (each completion its own row) or ``"concat"``.
        lora_name: must be empty (LoRA adapters are not served).
        **kwargs: passed to ``openai.AsyncOpenAI`` (``base_url``, ``api_key`` and
            ``http_client`` are set here).

    Raises:
        ArealCompatError: the openai package is missing, or an argument asks for something
            not supported (named).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        tool_call_parser: str = "qwen",
        reasoning_parser: str = "qwen3",
        engine_max_tokens: int | None = None,
        chat_template_type: Literal["hf", "concat"] = "hf",
        lora_name: str = "",
        **kwargs: Any,
    ) -> None:
        if _AsyncOpenAI is None:
            raise ArealCompatError("areal.experimental.openai.ArealOpenAI: needs the openai package (pip install openai)")
        if lora_name:
            raise ArealCompatError(f"ArealOpenAI(lora_name={lora_name!r}): LoRA adapters are not served by rollout_trio's engines")
        if tool_call_parser != "qwen" or reasoning_parser != "qwen3":
            raise ArealCompatError(
                f"ArealOpenAI(tool_call_parser={tool_call_parser!r}, reasoning_parser={reasoning_parser!r}): "
                "only AReaL's defaults ('qwen', 'qwen3') are served"
            )
        from ...agents import OpenAIEndpoint

        if engine_max_tokens:
            self._endpoint = OpenAIEndpoint(
                _native_engine(engine), tokenizer, max_tokens_limit=engine_max_tokens,
                default_max_tokens=min(1024, engine_max_tokens),
            )  # fmt: skip
        else:
            self._endpoint = OpenAIEndpoint(_native_engine(engine), tokenizer)
        self._session_block = self._endpoint.session(chat_template_type=chat_template_type)
        self._session = self._session_block.__enter__()
        client = self._endpoint.in_process_client(base_url=_BASE_URL)
        super().__init__(base_url=_BASE_URL, api_key=self._session.key, http_client=client, **kwargs)
        self.chat.completions = _Completions(self.chat.completions, self._endpoint.model_name)

    def get_interaction(self, id: str) -> InteractionView | None:
        """The completion ``id`` with its tokens (``model_response``) and reward, or None."""
        interaction = self._session.interactions.get(id)
        return None if interaction is None else InteractionView(interaction)

    def set_reward(self, id: str, reward: float) -> None:
        """Set the reward of completion ``id``.

        Raises:
            KeyError: no completion of this client has that id (as AReaL's does).
        """
        if id not in self._session.interactions:
            raise KeyError(f"Interaction with ID {id} not found in cache")
        self._session.set_reward(id, reward)

    def set_last_reward(self, reward: float) -> None:
        """Set the reward of the most recent completion.

        Raises:
            RuntimeError: no completion was made yet (as AReaL's does).
        """
        if not self._session.interactions:
            raise RuntimeError("No interaction in cache to set reward for")
        self._session.set_last_reward(reward)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> None:
        """Newest to oldest, each reward becomes ``G = G * turn_discount + r`` (once)."""
        self._session.apply_discount(turn_discount)

    def export_interactions(self, style: str) -> dict[str, Any]:
        """The completions that become rows: all (``"individual"``) or the leaves of each
        conversation (``"concat"``), as :class:`~rollout_trio.Interaction` objects.

        Raises:
            ValueError: an unknown ``style``.
        """
        return self._session.export(style)  # type: ignore[arg-type]
