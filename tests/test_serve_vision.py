"""`rollout-trio serve --model tiny-vlm` takes SGLang's image_data on /generate; RemoteEngine
sends a request's images there and gets what the model in process answers."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import pytest
import trio

from rollout_trio import GenerationConfig, ModelRequest, UnsupportedRequestError
from rollout_trio.engines import LocalEngine, RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.engines._sglang import SGLangBackend
from rollout_trio.engines._vllm import VLLMBackend
from rollout_trio.models import tiny_model
from rollout_trio.server import SGLangApp
from tests.conftest_remote import ServeProcess, serve
from tests.vision_helpers import image, png, processed, vlm

GREEDY = GenerationConfig(max_new_tokens=10, greedy=True, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serve("--model", "tiny-vlm", "--segment-tokens", "4", "--seed", "0") as p:
        yield p


def b64(img) -> str:
    return base64.b64encode(png(img)).decode()


def vision_request(images, gconfig=GREEDY) -> ModelRequest:
    _, processor = vlm()
    ids = processed(processor, images)["input_ids"][0].tolist()
    return ModelRequest(input_ids=ids, image_data=images, processor=processor, gconfig=gconfig)


def generate(server, images, n_placeholders=None, **body):
    _, processor = vlm()
    shown = images if n_placeholders is None else [image("r")] * n_placeholders
    ids = processed(processor, shown)["input_ids"][0].tolist()
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True, **body}
    return httpx.post(server.url + "/generate", json=payload, timeout=30)


async def test_remote_engine_sends_images_and_gets_the_in_process_answer(server) -> None:
    requests = [vision_request([image("r")]), vision_request([image("b", (112, 84))]), vision_request([image("g"), image("r")])]
    async with RemoteEngine([server.address], "sglang", setup_timeout=30, retry=RetryPolicy(attempts=2)) as remote:
        answers = [await remote.agenerate(r) for r in requests]
    model, processor = vlm()
    async with LocalEngine(model, processor.tokenizer) as local:
        expected = [await local.agenerate(r) for r in requests]
    for got, want, req in zip(answers, expected, requests):
        assert got.output_tokens == want.output_tokens  # across segments of 4 tokens: the images went each time
        assert got.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-4)
        assert got.input_tokens == req.input_ids


def test_generate_takes_one_image_or_a_list_as_base64_or_data_urls(server) -> None:
    one = generate(server, [image("g")], image_data=b64(image("g")))
    listed = generate(server, [image("g")], image_data=["data:image/png;base64," + b64(image("g"))])
    assert one.status_code == 200 and listed.status_code == 200
    assert one.json()["output_ids"] == listed.json()["output_ids"]


@pytest.mark.parametrize(
    ("images", "n_placeholders", "image_data", "says"),
    [
        ([image("r")], None, [base64.b64encode(b"not a png").decode()], "decodable"),
        ([image("r")], None, [b64(image("r"))[:80]], "decodable"),
        ([image("r")], None, ["/etc/hostname"], "reads no local files"),
        ([image("r")], None, ["https://example.com/cat.png"], "decodable"),
        ([image("r")], 1, [b64(image("r"))] * 2, "2 images but input_ids hold 1"),
        ([image("r")], 2, [b64(image("r"))], "1 images but input_ids hold 2"),
        ([image("r")], None, [b64(image("r", (112, 112)))], "placeholder"),
        ([image("r")], None, [3], "image_data"),
        ([image("r")], None, [b64(image("r"))] * 33, "at most 32"),
    ],
    ids=["garbage", "truncated", "path", "url", "more-images", "fewer-images", "wrong-size", "not-a-string", "too-many"],
)
def test_bad_image_data_is_a_400_naming_the_rule_and_the_server_goes_on(server, images, n_placeholders, image_data, says) -> None:
    bad = generate(server, images, n_placeholders, image_data=image_data)
    assert bad.status_code == 400, bad.text
    assert says in bad.json()["error"]["message"]
    assert generate(server, [image("g")], image_data=[b64(image("g"))]).status_code == 200


def test_a_pixel_budget_and_a_text_only_server_refuse_images() -> None:
    model, tok = tiny_model()
    app = SGLangApp(LocalEngine(model, tok))
    body = {"input_ids": [1, 2], "image_data": [b64(image("r"))]}

    async def main():
        from rollout_trio.server._schema import BadRequest

        with pytest.raises(BadRequest, match="takes no images"):
            await app._generate(body)
        _, processor = vlm()
        small = SGLangApp(LocalEngine(*tiny_model()), processor=processor, max_image_pixels=1000)
        ids = processed(processor, [image("r")])["input_ids"][0].tolist()
        with pytest.raises(BadRequest, match="pixel budget"):
            await small._generate({"input_ids": ids, "image_data": [b64(image("r"))]})

    trio.run(main)


def test_wire_bodies_sglang_image_data_and_vllm_needs_chat_messages() -> None:
    call = SGLangBackend().generate([1, 2], GREEDY, max_new=3, min_new=0, rid="x", image_data=["AAAA"])
    assert call.json["image_data"] == ["AAAA"]
    assert "image_data" not in SGLangBackend().generate([1, 2], GREEDY, max_new=3, min_new=0, rid="x").json
    with pytest.raises(UnsupportedRequestError, match="vision_msg_vllm"):  # images travel in chat messages only
        VLLMBackend().generate([1, 2], GREEDY, max_new=3, min_new=0, rid="x", image_data=["AAAA"])


def test_a_broken_vision_checkpoint_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    from rollout_trio.cli import main

    from rollout_trio.models import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)  # a tokenizer (checked before torch), a config, no weights
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl", "vision_config": {}}')
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--model {tmp_path}: cannot load a vision model and processor from it" in err[0]
