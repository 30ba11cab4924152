"""A tiny Qwen2-VL-shaped vision-language model built in code, offline, and a loader.

:func:`tiny_vlm` builds a deterministic ``Qwen2VLForConditionalGeneration`` (a 2-layer
vision tower and a 2-layer text model, about 0.2M parameters) with the byte-level
tokenizer of :mod:`rollout_trio.models` extended by Qwen-VL's image placeholder tokens, a
Qwen-VL chat template, and an image-only processor (PIL, no torchvision): a 56x56 image
becomes 16 pixel rows with grid ``[1, 4, 4]`` and 4 ``<|image_pad|>`` tokens.

Like :func:`rollout_trio.models.tiny_model`, the text side is a designed bigram with a small
seeded contribution from attention (where the image tokens enter), so greedy output is
short and stable while logprobs still depend on the image. The default chain answers one
of the letters ``r``, ``g``, ``b`` (a colour) and then ``<|im_end|>``.

Two traps this module avoids: transformers 5's ``Qwen2VLProcessor`` insists on a video
processor, which needs torchvision (:class:`ImageOnlyProcessor` drops that one
sub-processor), and the text config's ``mrope_section`` must sum to half the head size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from ._util import lacks_tokenizer
from .models import SPECIAL_TOKENS, _bytes_to_unicode

__all__ = [
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "ImageOnlyProcessor",
    "colour_transitions",
    "load_vlm",
    "load_vlm_processor",
    "save_vlm",
    "tiny_image_processor",
    "tiny_vlm",
    "tiny_vlm_processor",
    "vlm_tokenizer",
]

#: Qwen-VL's vision tokens, ids 260-263 after :data:`rollout_trio.models.SPECIAL_TOKENS`.
VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")

#: ChatML where a message's content is a string or a list of parts: ``{"type": "text",
#: "text": ...}``, and ``{"type": "image"}`` / ``{"type": "image_url", ...}`` (one
#: ``<|vision_start|><|image_pad|><|vision_end|>`` each, which the processor expands).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TEXT_HIDDEN = 64
_TEXT_HEADS = 2  # head size 32: mrope_section sums to 16
_MROPE_SECTION = [4, 4, 8]
_PATCH = 14
_MERGE = 2


class ImageOnlyProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without the video sub-processor (which needs torchvision).

    Calls are Qwen2-VL's: ``processor(images=[...], text=[...], return_tensors="pt")``
    gives ``input_ids`` (each ``<|image_pad|>`` expanded to the image's token count),
    ``attention_mask``, ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``.
    Videos are not supported. Save the image processor and tokenizer on their own
    (:func:`save_vlm` does).

    Args:
        image_processor: a Qwen2-VL image processor (e.g. :func:`tiny_image_processor`).
        tokenizer: a tokenizer holding ``<|image_pad|>`` and ``<|video_pad|>``.
        chat_template: a chat template for :meth:`apply_chat_template` (the tokenizer's
            when None).
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any) -> None:
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        if chat_template is None:
            chat_template = getattr(tokenizer, "chat_template", None)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


def vlm_tokenizer() -> Any:
    """The byte-level tokenizer of :func:`rollout_trio.models.byte_tokenizer` plus :data:`VISION_TOKENS`.

    Ids 0-255 are bytes, 256-259 ``SPECIAL_TOKENS``, 260-263 ``VISION_TOKENS``; eos is
    ``<|im_end|>``, pad ``<|pad|>``; the chat template is :data:`VLM_CHAT_TEMPLATE`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [*SPECIAL_TOKENS, *VISION_TOKENS]
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials,
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(specials)
    if ids != list(range(256, 256 + len(specials))):  # pragma: no cover - guards a tokenizers change
        raise RuntimeError(f"special token ids moved: {ids}")
    return tokenizer


def tiny_image_processor(*, min_pixels: int = 56 * 56, max_pixels: int = 112 * 112) -> Any:
    """Qwen2-VL's PIL image processor (no torchvision) sized for the tiny model.

    Args:
        min_pixels: images are resized up to at least this many pixels.
        max_pixels: and down to at most this many (a 112x112 image: 64 pixel rows).

    Returns:
        A ``Qwen2VLImageProcessorPil`` with patch 14, merge 2, temporal patch 2.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=_PATCH, merge_size=_MERGE, temporal_patch_size=2
    )


def tiny_vlm_processor() -> ImageOnlyProcessor:
    """The processor of :func:`tiny_vlm` without the model (what a replay or a data
    pipeline needs).

    Returns:
        An :class:`ImageOnlyProcessor`: :func:`tiny_image_processor` over :func:`vlm_tokenizer`.
    """
    return ImageOnlyProcessor(image_processor=tiny_image_processor(), tokenizer=vlm_tokenizer())


def colour_transitions() -> dict[int, dict[int, float]]:
    """The default chain of :func:`tiny_vlm`: after the generation prompt's newline one of
    ``r``, ``g``, ``b`` (equally likely), then ``<|im_end|>``."""
    im_end = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    letters = list(b"rgb")
    chain: dict[int, dict[int, float]] = {ord("\n"): {c: 9.0 for c in letters}}
    for c in letters:
        chain[c] = {im_end: 13.0}
    return chain


def _vlm_config(vocab_size: int, tokenizer: Any) -> Any:
    from transformers import Qwen2VLConfig

    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    return Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 2 * _TEXT_HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": _TEXT_HEADS,
            "num_key_value_heads": _TEXT_HEADS,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "mrope_section": list(_MROPE_SECTION), "rope_theta": 10000.0},
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": _TEXT_HIDDEN,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": _PATCH,
            "spatial_merge_size": _MERGE,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def tiny_vlm(
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    transitions: Mapping[int, Mapping[int, float]] | None = None,
    context_mix: float = 0.3,
) -> tuple[Any, Any]:
    """The offline tiny VLM and its processor (deterministic for a given ``seed``).

    Args:
        seed: seeds every weight but the designed chain.
        device: where the model lives (``"cuda"`` where present).
        dtype: parameter dtype.
        transitions: ``{previous_id: {next_id: logit}}`` for the text side (default
            :func:`colour_transitions`); every other previous token leads to ``<|im_end|>``.
        context_mix: scale of the attention and MLP contributions (how much the image and
            the rest of the prompt move the logits); 0 makes the text side an exact bigram.

    Returns:
        ``(model, processor)``: a ``Qwen2VLForConditionalGeneration`` in eval mode and an
        :class:`ImageOnlyProcessor` (its ``tokenizer`` is :func:`vlm_tokenizer`).
    """
    from transformers import Qwen2VLForConditionalGeneration

    processor = tiny_vlm_processor()
    tokenizer = processor.tokenizer
    vocab_size = len(tokenizer)
    chain = colour_transitions() if transitions is None else transitions
    sources = sorted(chain)
    if len(sources) > _TEXT_HIDDEN - 1:
        raise ValueError(f"transitions: at most {_TEXT_HIDDEN - 1} previous ids are supported, got {len(sources)}")
    for src, row in chain.items():
        for tid in (src, *row):
            if not 0 <= tid < vocab_size:
                raise ValueError(f"transitions: token id {tid} is outside the vocabulary [0, {vocab_size})")
    config = _vlm_config(vocab_size, tokenizer)
    gen = torch.Generator().manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    text = model.model.language_model
    fallback = _TEXT_HIDDEN - 1
    dim_of = {src: i for i, src in enumerate(sources)}
    scale = math.sqrt(_TEXT_HIDDEN)  # RMSNorm maps a one-hot row to sqrt(hidden) * one-hot
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        for name, p in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
        for layer in text.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
            layer.self_attn.o_proj.weight.mul_(context_mix)
            layer.mlp.down_proj.weight.mul_(context_mix * 0.25)
        text.norm.weight.fill_(1.0)
        emb = torch.zeros(vocab_size, _TEXT_HIDDEN)
        emb[:, fallback] = 1.0
        for src, i in dim_of.items():
            emb[src] = 0.0
            emb[src, i] = 1.0
        text.embed_tokens.weight.copy_(emb)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        # Seeded weights on the columns no token owns: the context (the image) moves the logits.
        head = torch.randn(vocab_size, _TEXT_HIDDEN, generator=gen) * 0.1
        head[:, [*dim_of.values(), fallback]] = 0.0
        for src, row in chain.items():
            for nxt, logit in row.items():
                head[nxt, dim_of[src]] = logit / scale
        head[im_end, fallback] = 12.0 / scale
        model.lm_head.weight.copy_(head)
    return model.to(device=device, dtype=dtype).eval(), processor  # type: ignore[call-arg]  # transformers' stubs


def save_vlm(model: Any, processor: Any, path: str | os.PathLike[str]) -> None:
    """Save a VLM checkpoint directory :func:`load_vlm` reads: the model, the tokenizer
    (with its chat template) and the image processor, each on its own.

    Args:
        model: an image-text-to-text model.
        processor: its processor (an :class:`ImageOnlyProcessor` or any with
            ``tokenizer`` and ``image_processor``).
        path: the directory (created if missing).
    """
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)


def load_vlm(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[Any, Any]:
    """Load a local image-text-to-text checkpoint directory (model and processor), offline.

    The processor is ``AutoProcessor``'s where that loads; where it cannot (transformers 5's
    Qwen-VL processors want torchvision for videos) it is an :class:`ImageOnlyProcessor`
    over the directory's tokenizer and PIL image processor.

    Args:
        path: the checkpoint directory (e.g. written by :func:`save_vlm`).
        device: where to put the model.
        dtype: parameter dtype; None keeps the checkpoint's.

    Returns:
        ``(model, processor)`` with the model in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    from transformers import AutoModelForImageTextToText

    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_vlm: path {os.fspath(path)!r} is not a checkpoint directory")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    return model.to(device).eval(), load_vlm_processor(path)  # type: ignore[arg-type]  # transformers' stubs


def load_vlm_processor(path: str | os.PathLike[str]) -> Any:
    """The processor of a local checkpoint directory, without its model (see :func:`load_vlm`).

    Args:
        path: the checkpoint (or processor) directory.

    Returns:
        ``AutoProcessor``'s where that loads a multimodal processor, else an
        :class:`ImageOnlyProcessor` over the directory's tokenizer and PIL image processor.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or holds no tokenizer files.
        OSError: the directory holds no tokenizer or image processor.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_vlm_processor: path {os.fspath(path)!r} is not a directory")
    if (why := lacks_tokenizer(path)) is not None:
        raise FileNotFoundError(f"load_vlm_processor: {os.fspath(path)!r}: {why}")
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        if not hasattr(processor, "image_processor"):
            raise TypeError("not a multimodal processor")
    except Exception:  # noqa: BLE001 - any failure falls back to the image-only processor
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
        processor = ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return processor

