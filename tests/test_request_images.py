"""Images in ModelRequest: every accepted form, and each bad input a typed error naming its rule."""

from __future__ import annotations

import base64

import pytest
import torch
from PIL import Image

from rollout_trio import ModelRequest, WorkflowContractError
from rollout_trio import ImageInputError
from rollout_trio._images import decode_image, encode_image_base64, placeholder_runs
from tests.vision_helpers import image, png, processed, vlm

torch.set_num_threads(1)


def request(images, n_placeholders=None, **kw):
    _, processor = vlm()
    shown = [image("r")] * (len(images) if n_placeholders is None else n_placeholders)
    ids = processed(processor, shown, len(shown))["input_ids"][0].tolist()
    return ModelRequest(input_ids=ids, image_data=images, processor=processor, **kw)


def rule_of(excinfo) -> str:
    return excinfo.value.rule


@pytest.mark.parametrize(
    "form",
    [
        lambda img: img,
        lambda img: png(img),
        lambda img: base64.b64encode(png(img)).decode(),
        lambda img: "data:image/png;base64," + base64.b64encode(png(img)).decode(),
        lambda img: png(img, "JPEG"),
    ],
    ids=["pil", "bytes", "base64", "data-url", "jpeg"],
)
def test_every_form_decodes_to_the_same_rgb_image(form) -> None:
    img = image("g")
    req = request([form(img)])
    (got,) = req.image_data
    assert isinstance(got, Image.Image) and got.mode == "RGB" and got.size == (56, 56)
    assert abs(got.getpixel((10, 10))[1] - 200) <= 3


def test_a_file_path_str_or_pathlike_is_read(tmp_path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(png(image("b")))
    for item in (path, str(path)):
        (got,) = request([item]).image_data
        assert got.getpixel((0, 0))[2] > 200


def test_one_image_not_in_a_list_and_areal_style_none_are_accepted() -> None:
    assert len(request(image("r"), n_placeholders=1).image_data) == 1
    _, processor = vlm()
    assert ModelRequest(input_ids=[1, 2], image_data=None, processor=processor).image_data == ()


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "CMYK", "P", "1", "I"])
def test_grayscale_cmyk_palette_and_alpha_modes_become_rgb(mode) -> None:
    (got,) = request([image("r", mode=mode)]).image_data
    assert got.mode == "RGB"


def test_alpha_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (56, 56), (0, 0, 0, 0))
    (got,) = request([png(clear)]).image_data
    assert got.getpixel((5, 5)) == (255, 255, 255)


@pytest.mark.parametrize(
    ("item", "rule"),
    [
        (b"not an image at all", "decodable"),
        (png(image("r"))[:60], "decodable"),  # truncated: the header reads, the pixels do not
        ("definitely/not/a/file.png", "decodable"),
        ("data:text/plain;base64,aGVsbG8=", "decodable"),
        (12345, "decodable"),
        (Image.new("RGB", (0, 0)), "non-empty"),
    ],
    ids=["garbage", "truncated", "missing-path", "non-image-data-url", "int", "zero-size"],
)
def test_bad_images_name_their_rule(item, rule) -> None:
    with pytest.raises(ImageInputError) as excinfo:
        request([item])
    assert rule_of(excinfo) == rule and "image_data[0]" in str(excinfo.value)
    assert isinstance(excinfo.value, WorkflowContractError)


def test_the_pixel_budget_is_checked_from_the_header_before_decoding() -> None:
    big = png(Image.new("RGB", (300, 300)))
    with pytest.raises(ImageInputError) as excinfo:
        request([big], max_image_pixels=200 * 200)
    assert rule_of(excinfo) == "pixel budget" and "90000" in str(excinfo.value)
    with pytest.raises(ImageInputError) as excinfo:
        request([image("r")], max_image_pixels=0)
    assert rule_of(excinfo) == "pixel budget"


def test_a_decompression_bomb_is_refused_by_pils_limit(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50 * 50)
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(png(Image.new("RGB", (80, 80))))
    assert rule_of(excinfo) == "decompression bomb"
    with pytest.raises(ImageInputError) as excinfo:  # PIL itself refuses beyond twice its limit
        decode_image(png(Image.new("RGB", (120, 120))))
    assert rule_of(excinfo) == "decompression bomb"


@pytest.mark.parametrize(("n_images", "n_placeholders"), [(2, 1), (1, 2), (1, 0)])
def test_images_and_placeholders_must_match_in_number(n_images, n_placeholders) -> None:
    with pytest.raises(ImageInputError) as excinfo:
        request([image("r")] * n_images, n_placeholders=n_placeholders)
    assert rule_of(excinfo) == "placeholders"
    assert f"{n_images} images but input_ids hold {n_placeholders}" in str(excinfo.value)


def test_a_placeholder_run_must_hold_the_images_token_count() -> None:
    with pytest.raises(ImageInputError) as excinfo:
        request([image("r", size=(112, 112))])  # the prompt was expanded for a 56x56 image
    assert rule_of(excinfo) == "placeholder length" and "holds 4 tokens, the processor makes 16" in str(excinfo.value)


def test_an_image_without_a_processor_is_refused() -> None:
    _, processor = vlm()
    ids = processed(processor, [image("r")])["input_ids"][0].tolist()
    with pytest.raises(ImageInputError) as excinfo:
        ModelRequest(input_ids=ids, image_data=[image("r")])
    assert rule_of(excinfo) == "processor" and "ModelRequest.processor" in str(excinfo.value)


def test_multi_modal_input_is_checked_against_images_and_placeholders() -> None:
    _, processor = vlm()
    out = processed(processor, [image("r")])
    ids = out["input_ids"][0].tolist()
    mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    req = ModelRequest(input_ids=ids, image_data=[image("r")], processor=processor, multi_modal_input=mm)
    assert req.multi_modal_input["pixel_values"] is out["pixel_values"]  # shared, not copied
    with pytest.raises(ImageInputError) as excinfo:
        ModelRequest(input_ids=ids, image_data=[image("r")], processor=processor,
                     multi_modal_input={**mm, "pixel_values": out["pixel_values"][:12]})  # fmt: skip
    assert rule_of(excinfo) == "pixel rows"
    with pytest.raises(ImageInputError) as excinfo:
        ModelRequest(input_ids=ids, image_data=[image("r")], processor=processor,
                     multi_modal_input={"pixel_values": torch.zeros(64, 1176), "image_grid_thw": torch.tensor([[1, 8, 8]])})  # fmt: skip
    assert rule_of(excinfo) == "image tokens"
    with pytest.raises(ImageInputError) as excinfo:
        ModelRequest(input_ids=ids, multi_modal_input=mm)
    assert rule_of(excinfo) == "processor"


def test_copy_keeps_decoded_images_and_text_requests_are_untouched() -> None:
    req = request([png(image("b"))])
    again = req.copy(input_ids=[*req.input_ids, 98])
    assert again.image_data[0] is req.image_data[0]
    plain = ModelRequest(input_ids=[1, 2, 3])
    assert plain.image_data == () and plain.processor is None and plain.multi_modal_input is None


def test_placeholder_runs_and_base64_encoding_is_memoised() -> None:
    assert placeholder_runs([5, 9, 9, 1, 9, 2, 9, 9, 9], 9) == [2, 1, 3]
    img = image("r")
    assert encode_image_base64(img) is encode_image_base64(img)
    assert decode_image(encode_image_base64(img)).getpixel((1, 1)) == img.getpixel((1, 1))
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(__file__, allow_paths=False)
    assert "reads no local files" in str(excinfo.value)


def test_json_carries_images_as_base64_and_never_the_processor_or_its_tensors() -> None:
    import json

    from rollout_trio import from_json, to_json

    _, processor = vlm()
    out = processed(processor, [image("g")])
    req = ModelRequest(input_ids=out["input_ids"][0].tolist(), image_data=[image("g")], processor=processor,
                       multi_modal_input={"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})  # fmt: skip
    data = json.loads(to_json(req))
    assert "processor" not in data and "multi_modal_input" not in data and "tokenizer" not in data
    assert decode_image(data["image_data"][0]).getpixel((2, 2)) == image("g").getpixel((2, 2))
    with pytest.raises(ImageInputError) as excinfo:  # read back, the images need their processor again
        from_json(to_json(req), ModelRequest)
    assert rule_of(excinfo) == "processor"
    plain = ModelRequest(input_ids=[1, 2])
    assert from_json(to_json(plain), ModelRequest) == plain
