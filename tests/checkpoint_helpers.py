"""A Hugging Face checkpoint directory saved from a config, shaped like a real one.

Weights cannot be downloaded here, so tests that follow docs/real_model.md save a
Qwen2-architecture checkpoint the way a Hub download lays it out: ``config.json`` with
``dtype: bfloat16`` (as Qwen2.5's), ``model.safetensors``, ``generation_config.json`` with
a list of eos ids, and a tokenizer with its chat template. Only the sizes are small (and
the vocabulary is :func:`rollout_trio.models.byte_tokenizer`'s), so loading, dtype
conversion, eos handling and chat formatting take the paths a real checkpoint takes.
"""

from __future__ import annotations

from pathlib import Path


def save_qwen2_checkpoint(path: Path, *, chat_template: bool = True, seed: int = 0) -> Path:
    """Save a small random Qwen2ForCausalLM and its tokenizer under ``path``; returns ``path``.

    Args:
        path: the directory to write (created).
        chat_template: False saves the tokenizer without one, as some base checkpoints are.
        seed: seeds the random weights.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rollout_trio.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=end_of_text,
        eos_token_id=im_end,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, end_of_text], pad_token_id=end_of_text)
    model.save_pretrained(path)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    return path
