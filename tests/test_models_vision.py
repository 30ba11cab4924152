"""The offline tiny VLM: its tokenizer, chat template, image-only processor, and a local checkpoint."""

from __future__ import annotations

import pytest
import torch

from rollout_trio.models_vision import VISION_TOKENS, ImageOnlyProcessor, load_vlm, save_vlm, tiny_vlm, vlm_tokenizer
from tests.vision_helpers import image, processed, prompt_text, vlm

torch.set_num_threads(1)


def test_tokenizer_extends_the_byte_tokenizer_with_vision_tokens() -> None:
    tok = vlm_tokenizer()
    assert tok.convert_tokens_to_ids(list(VISION_TOKENS)) == [260, 261, 262, 263]
    assert len(tok) == 264 and tok.eos_token_id == 258 and tok.pad_token_id == 259
    text = "héllo ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_places_one_placeholder_per_image_part() -> None:
    _, processor = vlm()
    text = prompt_text(processor, 2)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert text.endswith("<|im_start|>assistant\n")
    plain = processor.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_56px_image_is_16_pixel_rows_grid_1_4_4_and_4_placeholders() -> None:
    _, processor = vlm()
    assert isinstance(processor, ImageOnlyProcessor)
    out = processed(processor, [image("r")])
    assert out["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    ids = out["input_ids"][0].tolist()
    assert ids.count(processor.image_token_id) == 4
    assert out["mm_token_type_ids"][0].sum().item() == 4


def test_generates_on_cpu_a_colour_letter_then_im_end_and_logprobs_depend_on_the_image() -> None:
    model, processor = vlm()
    firsts = []
    for colour in "rgb":
        out = processed(processor, [image(colour)])
        gen = model.generate(**out, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
        new = gen.sequences[0, out["input_ids"].shape[1]:].tolist()
        assert chr(new[0]) in "rgb" and new[1] == processor.tokenizer.eos_token_id
        firsts.append(gen.scores[0].log_softmax(-1)[0, list(b"rgb")])
    assert not torch.allclose(firsts[0], firsts[2])


def test_same_seed_same_weights_and_mrope_fits_the_head() -> None:
    a, _ = tiny_vlm(seed=1)
    b, _ = tiny_vlm(seed=1)
    c, _ = tiny_vlm(seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    text = a.config.text_config
    assert sum(text.rope_parameters["mrope_section"]) * 2 == text.hidden_size // text.num_attention_heads


def test_transitions_out_of_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_vlm(transitions={10: {9999: 1.0}})


def test_a_saved_checkpoint_loads_with_its_processor_and_same_logits(tmp_path) -> None:
    model, processor = vlm()
    save_vlm(model, processor, tmp_path / "ckpt")
    model2, processor2 = load_vlm(tmp_path / "ckpt", device="cpu")
    out, out2 = processed(processor, [image("g")]), processed(processor2, [image("g")])
    assert torch.equal(out["input_ids"], out2["input_ids"]) and torch.equal(out["pixel_values"], out2["pixel_values"])
    with torch.no_grad():
        assert torch.allclose(model(**out).logits, model2(**out2).logits)
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_vlm(tmp_path / "missing")
