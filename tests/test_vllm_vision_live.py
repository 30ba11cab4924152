"""RemoteEngine against a real vLLM serving the tiny VLM (issue 30): the image goes as a
data URL in a chat message, the server's own prompt tokens equal the processor's, and its
answer and logprobs are the local model's.

The server is the session's second one (tests/vllm_server.py ``vllm_vision_url``): vLLM
0.32's CPU build from the vLLM environment, with bench/vllm_vision.py's torchvision overlay
(its Qwen2-VL module and transformers' processor import torchvision), on the tiny VLM saved
with ``rollout_trio.models_vision.save_vlm``. tests/fixtures/vllm_vision holds one exchange
captured from it, which tests/test_vllm_vision.py checks everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from rollout_trio import GenerationConfig
from rollout_trio.engines import RemoteEngine
from tests.vision_helpers import image, reference, vlm

from .test_vllm_vision import vision_request
from .vllm_server import VISION_SKIP_REASON, vision_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vision_available(), reason=VISION_SKIP_REASON)]

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm_vision"


@pytest.mark.parametrize("colour", ["r", "g", "b"])
async def test_the_tiny_vlm_on_vllm_answers_as_it_does_locally(vllm_vision_url: str, colour: str) -> None:
    model, processor = vlm()
    req = vision_request(gconfig=GenerationConfig(max_new_tokens=4, greedy=True), image_data=[image(colour)])
    with trio.fail_after(120):
        async with RemoteEngine(vllm_vision_url, "vllm", seed=0, setup_timeout=60) as eng:
            resp = await eng.agenerate(req)  # raises when the server's prompt tokens differ
    tokens, logprobs = reference(model, processor, [image(colour)], len(resp.output_tokens))
    assert list(resp.output_tokens) == tokens
    assert list(resp.output_logprobs) == pytest.approx(logprobs, abs=1e-4)
    assert resp.input_tokens == tuple(req.input_ids) and resp.stop_reason == "stop"


async def test_the_captured_exchange_is_what_the_server_answers_today(vllm_vision_url: str) -> None:
    """The fixture's request, sent again: the same tokens and logprobs (seeded sampling)."""
    import httpx

    request = json.loads((FIXTURES / "chat_image.request.json").read_text())
    captured = json.loads((FIXTURES / "chat_image.response.json").read_text())["body"]
    async with httpx.AsyncClient(timeout=120) as client:
        live = (await client.post(vllm_vision_url.rstrip("/") + "/v1/chat/completions", json=request)).json()
    got, want = live["choices"][0], captured["choices"][0]
    assert got["token_ids"] == want["token_ids"] and live["prompt_token_ids"] == captured["prompt_token_ids"]
    assert [c["logprob"] for c in got["logprobs"]["content"]] == pytest.approx([c["logprob"] for c in want["logprobs"]["content"]], abs=1e-4)
