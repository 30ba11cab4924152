"""The agent endpoint takes OpenAI image_url parts (data URLs and local files, never the
network) with the tiny VLM behind it, and the interactions carry the images to the rows."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
import torch

from rollout_trio import interactions_to_trajectory, resolve_workflow
from rollout_trio.agents import AgentRolloutWorkflow, OpenAIEndpoint
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from tests.vision_helpers import image, png, reference, vlm

torch.set_num_threads(1)


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def ask(url: str, text: str = "Which colour? r, g or b.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


class ColourAgent:
    """Asks about an image, then about a second one with the first answer in the history."""

    async def run(self, data, **kwargs):
        client = openai.AsyncOpenAI(max_retries=0, **kwargs)
        messages = ask(data["first"])
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, *ask(data["second"], "And this one?")]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        return 1.0


async def test_an_sdk_agent_sends_images_and_the_rows_carry_them(tmp_path) -> None:
    model, processor = vlm()
    path = tmp_path / "blue.png"
    path.write_bytes(png(image("b", (112, 84))))
    wf = AgentRolloutWorkflow(ColourAgent(), processor=processor)
    async with LocalEngine(model, processor.tokenizer) as engine:
        result = await wf.arun_episode(engine, {"first": data_url(image("g")), "second": f"file://{path}"})
    first, second = result.values()
    want, _ = reference(model, processor, [image("g")], 4)
    assert list(first.model_response.output_tokens)[:2] == want[:2]  # the model saw the image (greedy, as in process)
    assert first.multi_modal_input["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert second.multi_modal_input["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]  # both images of the history
    assert first.messages[0]["content"][0]["type"] == "image_url"  # recorded as sent
    traj = interactions_to_trajectory(result)
    assert traj.batch_size == 2 and len(traj.extras["multi_modal_input"]) == 2
    assert traj.extras["mm_token_type_ids"].sum(dim=1).tolist() == [4, 4 + 12]


async def call(endpoint: OpenAIEndpoint, messages) -> httpx.Response:
    with endpoint.session() as session:
        async with httpx.AsyncClient(transport=endpoint.in_process_transport(), base_url="http://agent") as client:
            return await client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 2},
                                     headers={"Authorization": f"Bearer {session.key}"})  # fmt: skip


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://example.com/cat.png", "https URLs are not fetched"),
        ("http://127.0.0.1:1/cat.png", "http URLs are not fetched"),
        ("relative/cat.png", "absolute local file path"),
        ("/nonexistent/cat.png", "no such file"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "decodable"),
        ("", "non-empty string"),
    ],
)
async def test_bad_image_urls_are_400s_naming_the_part(url, says) -> None:
    model, processor = vlm()
    async with LocalEngine(model, processor.tokenizer) as engine:
        endpoint = OpenAIEndpoint(engine, processor=processor)
        resp = await call(endpoint, ask(url))
        ok = await call(endpoint, ask(data_url(image("r"))))
    assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
    assert "messages[0].content[0].image_url.url" in resp.json()["error"]["message"] or says == "decodable"
    assert ok.status_code == 200


async def test_local_files_can_be_refused_and_a_text_model_refuses_images(tmp_path) -> None:
    model, processor = vlm()
    path = tmp_path / "red.png"
    path.write_bytes(png(image("r")))
    async with LocalEngine(model, processor.tokenizer) as engine:
        strict = OpenAIEndpoint(engine, processor=processor, local_image_files=False)
        assert "reads no local files" in (await call(strict, ask(str(path)))).json()["error"]["message"]
        budget = OpenAIEndpoint(engine, processor=processor, max_image_pixels=1000)
        assert "pixel budget" in (await call(budget, ask(data_url(image("r"))))).json()["error"]["message"]
    text_model, tok = tiny_model()
    async with LocalEngine(text_model, tok) as engine:
        resp = await call(OpenAIEndpoint(engine, tok), ask(data_url(image("r"))))
    assert resp.status_code == 400 and "need a vision model" in resp.json()["error"]["message"]


async def test_a_client_cannot_smuggle_parts_and_images_only_in_user_messages() -> None:
    model, processor = vlm()
    async with LocalEngine(model, processor.tokenizer) as engine:
        endpoint = OpenAIEndpoint(engine, processor=processor)
        smuggled = await call(endpoint, [{"role": "user", "content": "hi", "parts": [["image", "/etc/hostname"]]}])
        system = await call(endpoint, [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(image("r"))}}]},
                                       {"role": "user", "content": "hi"}])  # fmt: skip
    assert smuggled.status_code in (200, 400) and "hostname" not in smuggled.text
    if smuggled.status_code == 200:
        assert smuggled.json()["usage"]["prompt_tokens"] < 30  # no image went in
    assert system.status_code == 400 and "user messages only" in system.json()["error"]["message"]


def test_resolve_workflow_keeps_the_processor() -> None:
    _, processor = vlm()
    wf = resolve_workflow(AgentRolloutWorkflow(ColourAgent(), processor=processor))
    assert wf is not None
