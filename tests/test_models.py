"""The offline tiny model, its byte-level tokenizer and checkpoint loading."""

from __future__ import annotations

import pytest
import torch

from rollout_trio.models import (
    SPECIAL_TOKENS,
    arithmetic_transitions,
    bigram_model,
    byte_tokenizer,
    load_model,
    tiny_model,
)

torch.set_num_threads(1)

IM_END = 258


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_tokenizer_is_byte_level_with_distinct_specials() -> None:
    tok = byte_tokenizer()
    text = "What is 3+4? ünïcode ✓ \n\ttabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [256, 257, 258, 259]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 259
    assert tok.bos_token is None
    assert len(tok) == 260


def test_chat_template_is_chatml() -> None:
    tok = byte_tokenizer()
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = chat(tok, "hi")
    assert ids[0] == 257 and ids[-1] == ord("\n") and IM_END in ids


def test_tiny_model_is_deterministic_per_seed() -> None:
    a, _ = tiny_model(seed=3)
    b, _ = tiny_model(seed=3)
    c, _ = tiny_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    cfg = a.config
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.vocab_size == 260 and cfg.eos_token_id == IM_END and cfg.pad_token_id == 259


def test_exact_bigram_follows_its_chain() -> None:
    chain = {65: {66: 5.0, 67: 3.0}}
    model = bigram_model(chain, default={68: 4.0}, context_mix=0.0)
    with torch.no_grad():
        logits = model(torch.tensor([[10, 65, 20]])).logits[0].float()
    expected_after_a = torch.zeros(260)
    expected_after_a[66], expected_after_a[67] = 5.0, 3.0
    torch.testing.assert_close(logits[1], expected_after_a, atol=1e-4, rtol=1e-3)
    expected_other = torch.zeros(260)
    expected_other[68] = 4.0
    torch.testing.assert_close(logits[0], expected_other, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(logits[2], expected_other, atol=1e-4, rtol=1e-3)


def test_context_mix_makes_logprobs_depend_on_context() -> None:
    model, tok = tiny_model()
    with torch.no_grad():
        a = model(torch.tensor([chat(tok, "What is 3+4?") + [ord("7")]])).logits[0, -1].log_softmax(-1)
        b = model(torch.tensor([chat(tok, "Hi") + [ord("7")]])).logits[0, -1].log_softmax(-1)
    assert (a - b).abs().max() > 1e-3  # an engine that loses context would be caught
    assert int(a.argmax()) == int(b.argmax()) == IM_END  # ...while greedy stays put


def test_bigram_rejects_out_of_vocab_ids() -> None:
    with pytest.raises(ValueError, match="transitions"):
        bigram_model({1: {999: 1.0}})


def test_forced_token_model_always_emits_its_token() -> None:
    model, tok = tiny_model(forced_token=ord("A"))
    ids = torch.tensor([chat(tok, "What is 2+2?")])
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=259)
    assert out[0, ids.shape[1] :].tolist() == [ord("A")] * 12


def test_default_model_answers_arithmetic_with_varying_correctness() -> None:
    model, tok = tiny_model()
    ids = torch.tensor([chat(tok, "What is 3+4?")])
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=259)[0, ids.shape[1] :].tolist()
    assert greedy[-1] == IM_END and all(chr(t).isdigit() for t in greedy[:-1]) and len(greedy) >= 2
    torch.manual_seed(0)
    out = model.generate(
        ids.expand(64, -1), max_new_tokens=8, do_sample=True, pad_token_id=259, eos_token_id=IM_END
    )[:, ids.shape[1] :]
    answers = [tok.decode([t for t in row.tolist() if t not in (IM_END, 259)]) for row in out]
    ended = sum(IM_END in row.tolist() for row in out)
    assert ended >= 60  # short outputs that end
    rewards = [float(a == "7") for a in answers]
    assert 0 < sum(rewards) < len(rewards)  # non-trivial, non-constant
    assert all(a.isdigit() for a in answers if a)


def test_default_chain_shape() -> None:
    chain = arithmetic_transitions()
    assert set(chain[ord("\n")]) == set(range(ord("0"), ord("9") + 1))
    assert all(IM_END in chain[d] for d in range(ord("0"), ord("9") + 1))


def test_save_and_load_model_round_trip(tmp_path) -> None:
    model, tok = tiny_model(seed=1)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_model(tmp_path, dtype=torch.float32)
    ids = torch.tensor([chat(tok, "What is 1+1?")])
    assert chat(ltok, "What is 1+1?") == ids[0].tolist()
    assert ltok.eos_token_id == IM_END and ltok.pad_token_id == 259
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_load_model_missing_directory(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        load_model(tmp_path / "nope")


def test_a_checkpoint_saved_without_its_tokenizer_is_refused_not_loaded_with_an_empty_one(tmp_path) -> None:
    """transformers 5 builds a one-token tokenizer from config.json alone; load_model names the gap."""
    from rollout_trio.engines import LocalEngine

    model, _ = tiny_model()
    model.save_pretrained(tmp_path)
    for load in (load_model, LocalEngine.from_pretrained):
        with pytest.raises(FileNotFoundError, match=r"no tokenizer in it \(none of tokenizer\.json, tokenizer_config\.json"):
            load(tmp_path, device="cpu")


def test_a_bfloat16_checkpoint_keeps_its_dtype_unless_one_is_asked_for(tmp_path) -> None:
    from .checkpoint_helpers import save_qwen2_checkpoint

    path = save_qwen2_checkpoint(tmp_path / "qwen2")
    assert next(load_model(path)[0].parameters()).dtype == torch.bfloat16
    assert next(load_model(path, dtype=torch.float32)[0].parameters()).dtype == torch.float32
