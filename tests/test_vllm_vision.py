"""RemoteEngine sends a vision request to vLLM as AReaL does: the chat messages, their
image_url parts filled with the request's images, to /v1/chat/completions; the server's
own prompt tokens are checked against the request's, and an aborted answer restarts.

The server is vLLM's HTTP surface replayed through httpx.MockTransport; the request is the
tiny VLM's real processor output. One exchange captured from a real vLLM serving the tiny
VLM (tests/fixtures/vllm_vision) is checked at the end; tests/test_vllm_vision_live.py
talks to such a server."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
import trio
from PIL import Image

from rollout_trio import EngineProtocolError, GenerationConfig, ModelRequest, UnsupportedRequestError
from rollout_trio.engines import RemoteEngine
from rollout_trio.engines._remote_http import RetryPolicy
from rollout_trio.engines._vllm import parse_chat
from tests.vision_helpers import image, messages, processed, vlm

from .test_vllm_fixtures import FakeVLLM


class FakeVisionVLLM(FakeVLLM):
    """FakeVLLM that also answers /v1/chat/completions from its script."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            payload = json.loads(request.content)
            self.seen.append((request.url.path, payload))
            return httpx.Response(200, json=self.script.pop(0))
        return super().__call__(request)


def chat(tokens: list[int], finish: str, prompt: list[int] | None) -> dict:
    body = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "token_ids": tokens,
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5 - i, "top_logprobs": []}
                                         for i, t in enumerate(tokens)]},  # fmt: skip
            }
        ],
    }
    if prompt is not None:
        body["prompt_token_ids"] = prompt
    return body


def engine(fake: FakeVLLM) -> RemoteEngine:
    return RemoteEngine(
        "127.0.0.1:9", "vllm", transport=httpx.MockTransport(fake), setup_timeout=5, seed=0,
        retry=RetryPolicy(attempts=1, backoff_base=0.01),
    )  # fmt: skip


def vision_request(areal_layout: bool = False, **changes) -> ModelRequest:
    processor = vlm()[1]
    img = image("g")
    ids = processed(processor, [img])["input_ids"][0].tolist()
    msgs = messages()
    fields = {
        "input_ids": ids,
        "image_data": [img],
        "processor": processor,
        "vision_msg_vllm": [msgs] if areal_layout else msgs,
        "gconfig": GenerationConfig(max_new_tokens=4),
    }
    fields.update(changes)
    return ModelRequest(**fields)


def chat_calls(fake: FakeVLLM) -> list[dict]:
    return [p for path, p in fake.seen if path == "/v1/chat/completions"]


@pytest.mark.parametrize("areal_layout", [False, True])
async def test_a_vision_request_is_a_chat_call_with_its_images_as_data_urls(areal_layout: bool) -> None:
    req = vision_request(areal_layout)
    fake = FakeVisionVLLM()
    fake.script = [chat([7, 8, 9], "stop", list(req.input_ids))]
    with trio.fail_after(10):
        async with engine(fake) as eng:
            resp = await eng.agenerate(req)
    assert resp.output_tokens == (7, 8, 9) and resp.output_logprobs == (-0.5, -1.5, -2.5)
    assert resp.input_tokens == req.input_ids and resp.stop_reason == "stop"
    (call,) = chat_calls(fake)
    assert call["logprobs"] is True and call["return_tokens_as_token_ids"] is True and call["max_tokens"] == 4
    (part,) = [p for p in call["messages"][0]["content"] if p["type"] == "image_url"]
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert sent.size == (56, 56) and sent.convert("RGB").getpixel((0, 0)) == image("g").getpixel((0, 0))
    assert req.vision_msg_vllm is not None  # the request's own messages are not filled in place
    assert all(p.get("type") != "image_url" for m in messages() for p in m["content"])


async def test_a_server_tokenizing_the_prompt_otherwise_is_an_error_naming_the_position() -> None:
    req = vision_request()
    other = list(req.input_ids)
    other[3] += 1
    fake = FakeVisionVLLM()
    fake.script = [chat([7], "stop", other)]
    with trio.fail_after(10):
        async with engine(fake) as eng:
            with pytest.raises(EngineProtocolError, match="differ from the request's .* input_ids from position 3"):
                await eng.agenerate(req)


async def test_an_aborted_vision_answer_is_generated_again_from_the_start() -> None:
    req = vision_request()
    fake = FakeVisionVLLM()
    fake.script = [chat([5, 6], "abort", list(req.input_ids)), chat([7, 8], "stop", list(req.input_ids))]
    with trio.fail_after(10):
        async with engine(fake) as eng:
            resp = await eng.agenerate(req)
    assert resp.output_tokens == (7, 8)  # not 5, 6, 7, 8: the second call answered anew
    first, second = chat_calls(fake)
    assert first["messages"] == second["messages"] and second["max_tokens"] == 4


@pytest.mark.parametrize(
    "changes, rule",
    [
        ({"vision_msg_vllm": None}, "vLLM takes images only in chat messages"),
        ({"vision_msg_vllm": messages(n_images=2)}, "more image parts than the request's 1 images"),
        ({"vision_msg_vllm": [{"role": "user", "content": "no image part"}]}, "0 image parts for the request's 1 images"),
    ],
)
async def test_vision_requests_vllm_cannot_take_are_refused_naming_the_rule(changes, rule) -> None:
    req = vision_request(**changes)
    fake = FakeVisionVLLM()
    with trio.fail_after(10):
        async with engine(fake) as eng:
            with pytest.raises(UnsupportedRequestError, match=rule):
                await eng.agenerate(req)
    assert chat_calls(fake) == []


@pytest.mark.parametrize(
    "mutate, rule",
    [
        (lambda b: b["choices"][0]["logprobs"]["content"][0].update(token="hello"), "must be 'token_id:N'"),
        (lambda b: b["choices"][0].update(token_ids=[1, 2]), "token_ids disagrees"),
        (lambda b: b["choices"][0].update(logprobs=None), "logprobs: missing"),
        (lambda b: b.update(prompt_token_ids=["x"]), "prompt_token_ids"),
    ],
)
def test_malformed_chat_answers_are_protocol_errors(mutate, rule) -> None:
    body = chat([3, 4], "stop", [1, 2])
    mutate(body)
    with pytest.raises(EngineProtocolError, match=rule):
        parse_chat(body)


# ------------------------------------------- one exchange captured from a real vLLM server

CAPTURED = __import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "vllm_vision"


async def test_the_captured_vllm_exchange_is_what_remote_engine_sends_and_reads() -> None:
    """tests/fixtures/vllm_vision: vLLM 0.32 (CPU) serving the tiny VLM answered the request
    RemoteEngine sends today, and the answer is the local model's greedy one."""
    from tests.vision_helpers import reference

    request = json.loads((CAPTURED / "chat_image.request.json").read_text())
    response = json.loads((CAPTURED / "chat_image.response.json").read_text())
    assert response["status"] == 200
    req = vision_request(gconfig=GenerationConfig(max_new_tokens=4, greedy=True))
    fake = FakeVisionVLLM()
    fake.script = [response["body"]]
    with trio.fail_after(10):
        async with engine(fake) as eng:
            resp = await eng.agenerate(req)
    (sent,) = chat_calls(fake)
    assert sent == request  # field for field, the image's data URL included
    model, processor = vlm()
    tokens, logprobs = reference(model, processor, [image("g")], len(resp.output_tokens))
    assert list(resp.output_tokens) == tokens == response["body"]["choices"][0]["token_ids"]
    assert list(resp.output_logprobs) == pytest.approx(logprobs, abs=1e-4)
    assert list(response["body"]["prompt_token_ids"]) == list(req.input_ids)  # the server's tokenization is ours
