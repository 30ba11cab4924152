"""LocalEngine serving the tiny VLM: batched image requests give transformers' own answers."""

from __future__ import annotations

import pytest
import torch
import trio

from rollout_trio import GenerationConfig, ImageInputError, ModelRequest, UnsupportedRequestError
from rollout_trio.engines import LocalEngine
from rollout_trio.models import tiny_model
from rollout_trio.models_vision import save_vlm, tiny_vlm
from tests.test_local_engine import wait_until
from tests.vision_helpers import device, image, processed, reference

torch.set_num_threads(1)
N_NEW = 6


@pytest.fixture(scope="module")
def served():
    model, processor = tiny_vlm(device=device())
    return model, processor


def request(processor, images, *, precomputed=False, n_new=N_NEW):
    out = processed(processor, images)
    mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if precomputed and images else None
    return ModelRequest(
        input_ids=out["input_ids"][0].tolist(), image_data=images, processor=processor, multi_modal_input=mm,
        gconfig=GenerationConfig(max_new_tokens=n_new, greedy=True, ignore_eos=True),
    )  # fmt: skip


async def generate_all(engine, reqs):
    results = [None] * len(reqs)

    async def one(i):
        results[i] = await engine.agenerate(reqs[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(reqs)):
            nursery.start_soon(one, i)
    return results


async def test_concurrent_image_and_text_requests_batch_and_match_generate(served) -> None:
    model, processor = served
    prompts = [[image("r")], [image("b", (112, 112))], [], [image("g"), image("r", (84, 56))], [image("g")]]
    reqs = [request(processor, p, precomputed=i % 2 == 0) for i, p in enumerate(prompts)]
    async with LocalEngine(model, processor.tokenizer) as engine:
        results = await generate_all(engine, reqs)
        stats = engine.statistics()
    assert stats.max_batch_rows > 1  # the requests shared decode steps
    for p, req, resp in zip(prompts, reqs, results):
        tokens, logprobs = reference(model, processor, p, N_NEW)
        assert list(resp.output_tokens) == tokens
        assert resp.output_logprobs == pytest.approx(logprobs, abs=2e-4)
        assert list(resp.input_tokens) == list(req.input_ids)  # placeholders included, as sent


async def test_images_are_processed_by_the_engine_when_the_request_has_no_tensors(served) -> None:
    model, processor = served
    async with LocalEngine(model, processor.tokenizer) as engine:
        mine, theirs = await generate_all(engine, [request(processor, [image("b")], precomputed=True), request(processor, [image("b")])])
    assert mine.output_tokens == theirs.output_tokens
    assert mine.output_logprobs == pytest.approx(theirs.output_logprobs, abs=1e-5)


async def test_an_interrupted_image_request_resumes_with_its_images(served) -> None:
    model, processor = served
    req = request(processor, [image("g", (112, 84))], n_new=120)
    async with LocalEngine(model, processor.tokenizer) as engine:
        done = []

        async def run():
            done.append(await engine.agenerate(req))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await wait_until(lambda: engine.statistics().steps_per_rid.get(req.rid, 0) >= 3)
            await engine.pause()  # drops the KV cache: the resume re-prefills prompt, images and tokens so far
            await engine.resume()
        assert engine.statistics().interrupts == 1
    (resp,) = done
    tokens, logprobs = reference(model, processor, [image("g", (112, 84))], 120)
    assert list(resp.output_tokens) == tokens
    assert resp.output_logprobs == pytest.approx(logprobs, abs=2e-4)


async def test_an_image_request_to_a_text_model_is_refused_and_others_go_on(served) -> None:
    _, processor = served
    text_model, tok = tiny_model(device=device())
    async with LocalEngine(text_model, tok) as engine:
        with pytest.raises(UnsupportedRequestError, match="takes no images"):
            await engine.agenerate(request(processor, [image("r")]))
        ok = await engine.agenerate(ModelRequest(input_ids=[257, 10], gconfig=GenerationConfig(max_new_tokens=2)))
    assert ok.output_len >= 1


async def test_bad_images_fail_their_own_request_only(served) -> None:
    model, processor = served
    good = request(processor, [image("r")])
    async with LocalEngine(model, processor.tokenizer) as engine:
        with pytest.raises(ImageInputError):
            ModelRequest(input_ids=good.input_ids, image_data=[b"broken"], processor=processor)
        resp = await engine.agenerate(good)
    assert resp.output_len == N_NEW


async def test_from_pretrained_serves_a_saved_vlm(served, tmp_path) -> None:
    model, processor = served
    save_vlm(model, processor, tmp_path / "vlm")
    async with LocalEngine.from_pretrained(tmp_path / "vlm", device=device()) as engine:
        (resp,) = await generate_all(engine, [request(processor, [image("g")])])
        await engine.update_weights(tmp_path / "vlm", version=3)
        (again,) = await generate_all(engine, [request(processor, [image("g")])])
    assert resp.output_tokens == again.output_tokens and set(again.output_versions) == {3}
