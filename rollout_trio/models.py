"""Small causal language models built in code, offline, and a loader for local checkpoints.

:func:`tiny_model` builds a deterministic Llama and a byte-level tokenizer with no
download: the model is a hand-built *bigram* (a designed Markov chain over tokens) with a
small seeded contribution from attention, so that

* greedy output is exact and stable (the bigram margins dominate float noise), and
* logprobs still depend on the whole context, so KV-cache or masking bugs in an engine
  change them measurably.

The default chain answers arithmetic questions with a few digits and then
``<|im_end|>``: short, ending outputs whose correctness varies under sampling.
:func:`bigram_model` builds a model from any chain, e.g. one that always emits one token,
so a test can tell from every output token which weights produced it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from ._util import lacks_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "arithmetic_transitions",
    "bigram_model",
    "byte_tokenizer",
    "load_model",
    "tiny_model",
]

#: The special tokens of :func:`byte_tokenizer`, in id order after the 256 byte ids.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

#: ChatML: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_HIDDEN = 128
_HEADS = 2  # head_dim 64, a size real vLLM / SGLang kernels accept


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization emits).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges, built in code.

    Token id ``b`` (0-255) is byte ``b``; ids 256-259 are :data:`SPECIAL_TOKENS`. eos is
    ``<|im_end|>``, pad is ``<|pad|>`` (distinct from eos), and the chat template is ChatML.
    Any UTF-8 text round-trips exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # ids 256.. in this order
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=list(SPECIAL_TOKENS),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != list(range(256, 256 + len(SPECIAL_TOKENS))):  # pragma: no cover - guards a tokenizers change
        raise RuntimeError(f"special token ids moved: {ids}")
    return tokenizer


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def arithmetic_transitions() -> dict[int, dict[int, float]]:
    """The default chain of :func:`tiny_model`: answers are 1-3 digits, then ``<|im_end|>``.

    After a newline (the end of the ChatML generation prompt) it emits a digit; after a
    digit it ends with probability about 0.7 or adds another digit. Every other token
    leads to ``<|im_end|>``. Logits not named are 0.
    """
    im_end = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    digits = _ids("0123456789")
    chain: dict[int, dict[int, float]] = {_ids("\n")[0]: {d: 9.0 for d in digits}}
    for d in digits:
        chain[d] = {im_end: 13.0, **{e: 9.5 for e in digits}}
    return chain


def bigram_model(
    transitions: Mapping[int, Mapping[int, float]],
    *,
    default: Mapping[int, float] | None = None,
    vocab_size: int = 256 + len(SPECIAL_TOKENS),
    context_mix: float = 0.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A Llama whose next-token logits follow a designed chain.

    Args:
        transitions: ``{previous_id: {next_id: logit}}``; next ids not named get logit 0.
        default: the logits after any token not in ``transitions`` (all 0 when None).
        vocab_size: the model's vocabulary size (the byte tokenizer's by default).
        context_mix: scale of seeded random attention and MLP contributions; 0 makes the
            model an exact bigram, small values (0.05-0.2) make logprobs depend on context.
        seed: seeds the random (attention and MLP) weights.
        device: where the model lives.
        dtype: parameter dtype.

    Returns:
        A ``LlamaForCausalLM`` in eval mode. Up to ``hidden_size - 1`` (127) distinct
        previous ids can have their own row; every other id shares the ``default`` row.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    sources = sorted(transitions)
    if len(sources) > _HIDDEN - 1:
        raise ValueError(f"transitions: at most {_HIDDEN - 1} previous ids are supported, got {len(sources)}")
    for src, row in transitions.items():
        for tid in (src, *row):
            if not 0 <= tid < vocab_size:
                raise ValueError(f"transitions: token id {tid} is outside the vocabulary [0, {vocab_size})")
    specials = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=_HIDDEN,
        intermediate_size=2 * _HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=specials["<|im_end|>"] if vocab_size > specials["<|im_end|>"] else None,
        pad_token_id=specials["<|pad|>"] if vocab_size > specials["<|pad|>"] else None,
        rms_norm_eps=1e-6,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    fallback = _HIDDEN - 1
    dim_of = {src: i for i, src in enumerate(sources)}
    scale = math.sqrt(_HIDDEN)  # RMSNorm maps a one-hot row to sqrt(hidden) * one-hot
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            # Random attention / MLP outputs, scaled down: they nudge the one-hot residual.
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
            layer.self_attn.o_proj.weight.mul_(context_mix * 0.25)
            layer.mlp.down_proj.weight.mul_(context_mix * 0.25)
        model.model.norm.weight.fill_(1.0)
        emb = torch.zeros(vocab_size, _HIDDEN)
        emb[:, fallback] = 1.0
        for src, i in dim_of.items():
            emb[src] = 0.0
            emb[src, i] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(vocab_size, _HIDDEN)
        for src, row in transitions.items():
            for nxt, logit in row.items():
                head[nxt, dim_of[src]] = logit / scale
        for nxt, logit in (default or {}).items():
            head[nxt, fallback] = logit / scale
        model.lm_head.weight.copy_(head)
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers' stubs


def tiny_model(
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    forced_token: int | None = None,
    context_mix: float = 0.1,
) -> tuple[Any, Any]:
    """The default offline model and tokenizer (deterministic for a given ``seed``).

    Args:
        seed: seeds the attention and MLP weights (the chain itself is fixed).
        device: where the model lives (``"cuda"`` where present).
        dtype: parameter dtype.
        forced_token: when set, the model emits this token after every token with a
            large margin (a "version-revealing" model: give each weight version its own
            token and every output token tells which weights produced it).
        context_mix: see :func:`bigram_model`.

    Returns:
        ``(model, tokenizer)``: a Llama (hidden 128, 2 heads of 64, 2 layers) answering
        ChatML arithmetic prompts with a few digits then ``<|im_end|>``, and
        :func:`byte_tokenizer`.
    """
    tokenizer = byte_tokenizer()
    if forced_token is not None:
        model = bigram_model(
            {}, default={forced_token: 30.0}, context_mix=context_mix, seed=seed, device=device, dtype=dtype
        )
    else:
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model = bigram_model(
            arithmetic_transitions(),
            default={im_end: 12.0},
            context_mix=context_mix,
            seed=seed,
            device=device,
            dtype=dtype,
        )
    return model, tokenizer


def load_model(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[Any, Any]:
    """Load a local Hugging Face checkpoint directory (model and tokenizer), offline.

    Save with the usual ``model.save_pretrained(path)`` and ``tokenizer.save_pretrained(path)``.

    Args:
        path: the checkpoint directory.
        device: where to put the model.
        dtype: parameter dtype; None keeps the checkpoint's.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or holds no tokenizer.
        OSError: transformers cannot load the model or tokenizer from it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_model: path {os.fspath(path)!r} is not a checkpoint directory")
    if (why := lacks_tokenizer(path)) is not None:
        raise FileNotFoundError(f"load_model: {os.fspath(path)!r}: {why}")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]  # transformers' stubs
