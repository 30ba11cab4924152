"""Single-turn RLVR with images: a VLM answers about the task's images, a verifiable reward.

:class:`VisionRLVRWorkflow` is :class:`~rollout_trio.workflows.RLVRWorkflow` with an
``AutoProcessor``: the task's images and chat prompt go through the processor once per
group (the slots share the group's processor cache), every slot's request carries the
same decoded images and processor tensors, and the row carries them under
``multi_modal_input`` (AReaL's layout) with ``mm_token_type_ids`` marking the image
placeholders (which get ``loss_mask`` 0, as every prompt position does).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import trio

from .. import workflow_context
from .._config import GenerationConfig
from .._images import DEFAULT_MAX_IMAGE_PIXELS, ImageInputError, decode_images, image_token_id
from .._io import ModelRequest
from .._trajectory import Trajectory
from .._workflow import RolloutWorkflow
from ._common import as_reward_function, load_tokenizer

if TYPE_CHECKING:
    from ..engines import InferenceEngine

__all__ = ["VisionInput", "VisionRLVRWorkflow", "default_data_extract_images", "preprocess_vision"]


@attrs.frozen(eq=False)
class VisionInput:
    """One prompt with images, preprocessed: what the slots of a group share.

    Attributes:
        input_ids: the prompt's token ids (image placeholders expanded).
        mm_token_type_ids: 1 on image placeholder positions, else 0.
        images: the decoded RGB images, in placeholder order.
        multi_modal_input: the processor's image tensors (``pixel_values``,
            ``image_grid_thw``, ...).
        text: the prompt text given to the processor.
    """

    input_ids: tuple[int, ...]
    mm_token_type_ids: tuple[int, ...]
    images: tuple[Any, ...]
    multi_modal_input: dict[str, Any]
    text: str


def default_data_extract_images(data: Mapping[str, Any]) -> Sequence[Any]:
    """``data["images"]`` (one image or a list), else ``data["image"]``, else no images."""
    images = data.get("images", data.get("image"))
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _prompt_text(processor: Any, messages: Any, enable_thinking: bool) -> str:
    if isinstance(messages, str):
        return messages  # already rendered (AReaL's datasets do this)
    kwargs = {"enable_thinking": enable_thinking} if enable_thinking else {}
    render = getattr(processor, "apply_chat_template", None) if getattr(processor, "chat_template", None) else None
    if render is None:
        render = processor.tokenizer.apply_chat_template
    return str(render(messages, add_generation_prompt=True, tokenize=False, **kwargs))


def preprocess_vision(
    processor: Any, messages: Any, images: Sequence[Any], *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, enable_thinking: bool = False
) -> VisionInput:
    """Decode ``images`` (see :class:`~rollout_trio.ModelRequest`) and run ``processor`` on
    them with the rendered ``messages`` (blocking: call it in a thread).

    Args:
        processor: an image-text processor (e.g. ``AutoProcessor``'s or an
            :class:`~rollout_trio.models_vision.ImageOnlyProcessor`).
        messages: chat messages (rendered with the processor's chat template) or a prompt str.
        images: the images, in placeholder order.
        max_image_pixels: the pixel budget of one image.
        enable_thinking: passed to the chat template.

    Returns:
        The shared :class:`VisionInput`.

    Raises:
        ImageInputError: an image breaks a rule (it names the rule).
    """
    decoded = decode_images(images, where="data.images", max_pixels=max_image_pixels)
    text = _prompt_text(processor, messages, enable_thinking)
    token = getattr(processor, "image_token", None)
    if isinstance(token, str) and text.count(token) != len(decoded):
        raise ImageInputError(
            f"data.images: placeholders: {len(decoded)} images but the prompt holds {text.count(token)} image placeholders ({token})",
            rule="placeholders",
        )
    out = processor(images=list(decoded) or None, text=[text], padding=False, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    types = out["mm_token_type_ids"][0].tolist() if "mm_token_type_ids" in out else [0] * len(ids)
    mm = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    return VisionInput(tuple(ids), tuple(int(t) for t in types), decoded, mm, text)


def _image_key(item: Any) -> Any:
    """A cache key naming an image by content where cheap (encoded bytes, str, path), else identity."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return ("bytes", hashlib.blake2b(bytes(item), digest_size=16).digest())
    if isinstance(item, str):
        return ("str", hashlib.blake2b(item.encode("utf-8", "surrogatepass"), digest_size=16).digest())
    if isinstance(item, os.PathLike):
        return ("path", os.fspath(item))
    return ("object", id(item))  # held by the group's data for the group's lifetime


class VisionRLVRWorkflow(RolloutWorkflow):
    """Single-turn RLVR over images (AReaL's ``VisionRLVRWorkflow``): one completion, one row.

    Args:
        reward_fn: ``reward_fn(prompt, completions, prompt_ids, completion_ids, **data)``:
            a callable, an import string, or a configured
            :class:`~rollout_trio.rewards.RewardFunction`; it gets the decoded completion and
            the task data (images included).
        gconfig: sampling settings; the tokenizer's eos and pad ids are added as stop ids.
        tokenizer: a tokenizer or a local path (default: the processor's tokenizer).
        processor: an image-text processor, or a local path loaded with ``AutoProcessor``.
        enable_thinking: passed to the chat template.
        max_image_pixels: the pixel budget of one image (see :class:`~rollout_trio.ModelRequest`).
        data_extract_images_fn: ``(data) -> images``; default ``data["images"]``.
        data_extract_prompt_fn: ``(data) -> messages or prompt str``; default ``data["messages"]``.

    The row is prompt then completion as in :class:`~rollout_trio.workflows.RLVRWorkflow`
    (``turn_ids`` included), plus ``multi_modal_input`` (one dict of the processor's image
    tensors) and ``mm_token_type_ids``. A completion holding the image placeholder token is
    rejected (the episode returns None, counted as ``vision/placeholder_generated``): the
    placeholder would take image features the row does not have.

    Raises:
        ValueError: no processor.
    """

    def __init__(
        self,
        reward_fn: Any,
        gconfig: GenerationConfig | None = None,
        tokenizer: Any = None,
        processor: Any = None,
        enable_thinking: bool = False,
        *,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        data_extract_images_fn: Callable[[Any], Sequence[Any]] = default_data_extract_images,
        data_extract_prompt_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(processor, (str, os.PathLike)):
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(processor)
        if processor is None:
            raise ValueError("processor: required (an image-text processor or the path of one)")
        self.processor = processor
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None))
        self.gconfig = (gconfig or GenerationConfig()).new(n_samples=1).with_stop_and_pad_token_ids(self.tokenizer)
        self.reward = as_reward_function(reward_fn)
        self.enable_thinking = enable_thinking
        self.max_image_pixels = max_image_pixels
        self.data_extract_images_fn = data_extract_images_fn
        self.data_extract_prompt_fn = data_extract_prompt_fn or (lambda data: data["messages"])

    def __repr__(self) -> str:
        return f"VisionRLVRWorkflow({self.reward!r})"

    async def prepare(self, data: Any) -> VisionInput:
        """The task's preprocessed prompt, computed once per group (in a thread)."""
        messages = self.data_extract_prompt_fn(data)
        images = list(self.data_extract_images_fn(data))

        async def compute() -> VisionInput:
            return await trio.to_thread.run_sync(
                lambda: preprocess_vision(
                    self.processor, messages, images, max_image_pixels=self.max_image_pixels, enable_thinking=self.enable_thinking
                )
            )

        cache = workflow_context.get().processor_cache
        if cache is None:
            return await compute()
        try:
            text_key = json.dumps(messages, sort_keys=True, default=repr)
        except (TypeError, ValueError):
            return await compute()
        key = ("vision_rlvr", id(self.processor), text_key, tuple(_image_key(i) for i in images))
        return await cache.get_or_compute(key, compute)

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> Trajectory | None:
        prep = await self.prepare(data)
        req = ModelRequest(
            input_ids=prep.input_ids,
            gconfig=self.gconfig,
            tokenizer=self.tokenizer,
            image_data=prep.images,
            processor=self.processor,
            multi_modal_input=prep.multi_modal_input,
            max_image_pixels=self.max_image_pixels,
        )
        resp = await engine.agenerate(req)
        image_token = image_token_id(self.processor)
        if image_token in resp.output_tokens:
            # A generated placeholder would take image features the row does not have: the
            # trainer's forward pass fails on it. The rollout is rejected (counted), not trained on.
            workflow_context.stats_recorder().record(workflow_context.stat_scope(), {"vision/placeholder_generated": 1.0})
            return None
        prompt_str = self.tokenizer.decode(list(resp.input_tokens))
        completion_str = self.tokenizer.decode(list(resp.output_tokens))
        reward = await self.reward(prompt_str, completion_str, list(resp.input_tokens), list(resp.output_tokens), **data)
        workflow_context.stats_recorder().record(workflow_context.stat_scope(), {"reward": float(reward)})
        n_in, n_out = resp.input_len, resp.output_len
        types = [int(t == image_token) for t in resp.input_tokens]
        return Trajectory.from_response(
            resp,
            reward,
            turn_ids=torch.tensor([[-1] * n_in + [0] * n_out], dtype=torch.int32),
            multi_modal_input=[prep.multi_modal_input],
            mm_token_type_ids=torch.tensor([types + [0] * n_out], dtype=torch.int32),
        )
