"""LocalEngine against a real (tiny, offline) model and tokenizer: no mocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import trio

from rollout_trio import (
    EngineError,
    EngineTimeoutError,
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    UnsupportedRequestError,
)
from rollout_trio.engines import InferenceEngine, LocalEngine
from rollout_trio.models import tiny_model

torch.set_num_threads(1)

IM_END = 258
A, B = ord("A"), ord("B")


def chat(tok, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def req(ids: list[int], **gconfig) -> ModelRequest:
    return ModelRequest(input_ids=ids, gconfig=GenerationConfig(**gconfig))


async def wait_until(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    # A deadline guards the test from hanging; it is not a timing assertion.
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.002)


async def generate_into(engine: LocalEngine, r: ModelRequest, out: list[ModelResponse]) -> None:
    """Run one request in the background of a test, keeping its response."""
    out.append(await engine.agenerate(r))


def steps(engine: LocalEngine, rid: str) -> int:
    return engine.statistics().steps_per_rid.get(rid, 0)


@pytest.fixture
def model_tok():
    return tiny_model()


def reference_logprobs(model, prompt: list[int], out: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each output token, from one full forward pass (no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(out)[:, None])[:, 0]


async def test_is_an_inference_engine(model_tok) -> None:
    model, tok = model_tok
    engine = LocalEngine(model, tok)
    assert isinstance(engine, InferenceEngine)
    with pytest.raises(EngineError, match="async with"):
        await engine.agenerate(req(chat(tok, "hi")))


async def test_greedy_is_deterministic_alone_and_batched(model_tok) -> None:
    model, tok = model_tok
    prompt = chat(tok, "What is 3+4?")
    async with LocalEngine(model, tok) as engine:
        first = await engine.agenerate(req(prompt, greedy=True, max_new_tokens=8))
        second = await engine.agenerate(req(prompt, greedy=True, max_new_tokens=8))
        batched: list[ModelResponse] = []

        async def noise(i: int) -> None:
            await engine.agenerate(req(chat(tok, "x" * (i + 1)), seed=i, ignore_eos=True, max_new_tokens=6 + i))

        async def target() -> None:
            batched.append(await engine.agenerate(req(prompt, greedy=True, max_new_tokens=8)))

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(noise, i)
            nursery.start_soon(target)
            for i in range(4, 7):
                nursery.start_soon(noise, i)
        assert engine.statistics().max_batch_rows > 1
    assert first.output_tokens == second.output_tokens == batched[0].output_tokens
    assert first.output_logprobs == second.output_logprobs
    torch.testing.assert_close(
        torch.tensor(batched[0].output_logprobs), torch.tensor(first.output_logprobs), atol=1e-5, rtol=0
    )
    assert first.output_tokens[-1] == IM_END and first.stop_reason == "stop"
    assert first.input_tokens == tuple(prompt)
    assert first.output_versions == (0,) * len(first.output_tokens)
    assert 0 < first.ttft <= first.latency


async def test_stop_tokens_and_length_limits(model_tok) -> None:
    model, tok = model_tok
    prompt = chat(tok, "What is 3+4?")
    async with LocalEngine(model, tok) as engine:
        greedy = await engine.agenerate(req(prompt, greedy=True, max_new_tokens=8))
        digit = greedy.output_tokens[0]
        # A request stop token ends generation right after it is emitted (it is kept).
        stopped = await engine.agenerate(req(prompt, greedy=True, stop_token_ids=[digit]))
        assert stopped.output_tokens == (digit,) and stopped.stop_reason == "stop"
        # ignore_eos: eos does not stop, max_new_tokens does.
        long = await engine.agenerate(req(prompt, greedy=True, ignore_eos=True, max_new_tokens=5))
        assert len(long.output_tokens) == 5 and long.stop_reason == "length"
        assert long.output_tokens[: len(greedy.output_tokens)] == greedy.output_tokens
        # max_tokens caps prompt + output.
        capped = await engine.agenerate(req(prompt, greedy=True, ignore_eos=True, max_tokens=len(prompt) + 3))
        assert len(capped.output_tokens) == 3 and capped.stop_reason == "length"
        # min_new_tokens masks stop tokens until reached.
        early = await engine.agenerate(req(prompt, greedy=True, min_new_tokens=4, max_new_tokens=10))
        assert IM_END not in early.output_tokens[:4] and len(early.output_tokens) >= 5
        assert early.output_tokens[-1] == IM_END


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 5, 0.9), (1.3, 100_000_000, 1.0)])
async def test_logprobs_match_a_direct_forward_pass(model_tok, temperature, top_k, top_p) -> None:
    model, tok = model_tok
    prompts = [chat(tok, q) for q in ("What is 3+4?", "Hi", "What is 12+30? Think.", "1")]
    async with LocalEngine(model, tok) as engine:
        results: dict[int, ModelResponse] = {}

        async def one(i: int) -> None:
            results[i] = await engine.agenerate(
                req(prompts[i], temperature=temperature, top_k=top_k, top_p=top_p, seed=i,
                    ignore_eos=True, max_new_tokens=10 + 3 * i)
            )

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        greedy = await engine.agenerate(req(prompts[0], greedy=True, ignore_eos=True, max_new_tokens=6))
    for i, res in results.items():
        ref = reference_logprobs(model, prompts[i], list(res.output_tokens), temperature)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), ref, atol=1e-4, rtol=0)
    # Greedy reports log_softmax(logits), i.e. T = 1.
    ref = reference_logprobs(model, prompts[0], list(greedy.output_tokens), 1.0)
    torch.testing.assert_close(torch.tensor(greedy.output_logprobs), ref, atol=1e-4, rtol=0)


async def test_seeded_sampling_is_reproducible_under_concurrency(model_tok) -> None:
    model, tok = model_tok
    prompt = chat(tok, "What is 3+4?")
    async with LocalEngine(model, tok) as engine:
        out: dict[tuple[int, int], tuple[int, ...]] = {}

        async def one(seed: int, copy: int) -> None:
            res = await engine.agenerate(req(prompt, seed=seed, ignore_eos=True, max_new_tokens=6))
            out[seed, copy] = res.output_tokens

        async with trio.open_nursery() as nursery:
            for seed in range(6):
                for copy in range(2):
                    nursery.start_soon(one, seed, copy)
    assert all(out[s, 0] == out[s, 1] for s in range(6))
    assert len({out[s, 0] for s in range(6)}) > 1


async def test_concurrent_requests_share_forward_passes(model_tok) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok) as engine:
        results: list[ModelResponse] = []

        async def one(i: int) -> None:
            results.append(
                await engine.agenerate(req(chat(tok, f"q{i}"), seed=i, ignore_eos=True, max_new_tokens=16))
            )

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        stats = engine.statistics()
    total = sum(len(r.output_tokens) for r in results)
    assert total == 8 * 16
    assert stats.generated_tokens == total
    assert stats.forward_passes < total // 4  # one pass serves many requests
    assert stats.max_batch_rows == 8


async def test_cancel_removes_the_request_from_the_batch(model_tok) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok) as engine:
        victim = req(chat(tok, "long"), ignore_eos=True, max_new_tokens=1000)
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def run_victim() -> None:
                with scope:
                    await engine.agenerate(victim)
                    pytest.fail("the cancelled request completed")

            nursery.start_soon(run_victim)
            await wait_until(lambda: steps(engine, victim.rid) >= 3)
            scope.cancel()
        spent = steps(engine, victim.rid)
        before = engine.statistics().decode_steps
        other = await engine.agenerate(req(chat(tok, "next"), ignore_eos=True, max_new_tokens=20))
        stats = engine.statistics()
    assert len(other.output_tokens) == 20  # the engine still works
    assert stats.decode_steps >= before + 19  # ...and kept stepping
    assert stats.steps_per_rid[victim.rid] == spent < 1000  # but never for the cancelled request
    assert victim.rid not in stats.live_rids


async def test_pause_holds_requests_and_resume_continues_them(model_tok) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok) as engine:
        first = req(chat(tok, "a"), ignore_eos=True, greedy=True, max_new_tokens=300)
        held = req(chat(tok, "b"), ignore_eos=True, greedy=True, max_new_tokens=10)
        results: dict[str, ModelResponse] = {}

        async def run(r: ModelRequest) -> None:
            results[r.rid] = await engine.agenerate(r)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, first)
            await wait_until(lambda: steps(engine, first.rid) >= 3)
            await engine.pause()
            paused = engine.statistics()
            assert paused.paused and first.rid in paused.live_rids
            nursery.start_soon(run, held)
            await wait_until(lambda: held.rid in engine.statistics().live_rids)
            # A paused request waits inside its caller's cancel scope.
            with trio.move_on_after(0.05) as scope:
                await engine.agenerate(req(chat(tok, "c"), max_new_tokens=4))
            assert scope.cancelled_caught
            again = engine.statistics()
            assert again.forward_passes == paused.forward_passes and not results
            await engine.resume()
        stats = engine.statistics()
    assert len(results[first.rid].output_tokens) == 300 and len(results[held.rid].output_tokens) == 10
    assert stats.interrupts >= 1 and not stats.paused and not stats.live_rids
    async with LocalEngine(model, tok) as fresh:  # resuming re-prefills: same greedy tokens
        straight = await fresh.agenerate(req(chat(tok, "a"), ignore_eos=True, greedy=True, max_new_tokens=300))
    assert results[first.rid].output_tokens == straight.output_tokens
    torch.testing.assert_close(
        torch.tensor(results[first.rid].output_logprobs), torch.tensor(straight.output_logprobs), atol=1e-4, rtol=0
    )


async def test_request_timeout_while_paused(model_tok) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok, request_timeout=0.05) as engine:
        await engine.pause()
        r = req(chat(tok, "a"), max_new_tokens=4)
        with pytest.raises(EngineTimeoutError, match="request_timeout"):
            await engine.agenerate(r)
        assert r.rid not in engine.statistics().live_rids


def assert_versions_revealed(res: ModelResponse, token_version: dict[int, int]) -> None:
    assert res.output_tokens, "no tokens"
    for i, (tok, ver) in enumerate(zip(res.output_tokens, res.output_versions, strict=True)):
        assert token_version[tok] == ver, f"token {i}: {tok} was produced by version {token_version[tok]}, stamped {ver}"
    assert set(res.output_versions) == set(token_version.values()), "the response does not span both versions"
    assert list(res.output_versions) == sorted(res.output_versions)


async def test_update_weights_mid_generation_from_state_dict() -> None:
    model, tok = tiny_model(forced_token=A)
    new_weights = tiny_model(forced_token=B)[0].state_dict()
    async with LocalEngine(model, tok, version=0) as engine:
        r = req(chat(tok, "go"), max_new_tokens=400)
        out: list[ModelResponse] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate_into, engine, r, out)
            await wait_until(lambda: steps(engine, r.rid) >= 5)
            await engine.update_weights(new_weights, 1)
            assert engine.get_version() == 1
        assert engine.statistics().interrupts >= 1
    assert_versions_revealed(out[0], {A: 0, B: 1})
    assert len(out[0].output_tokens) == 400 and out[0].stop_reason == "length"


async def test_update_weights_from_checkpoint_path_while_paused(tmp_path) -> None:
    model, tok = tiny_model(forced_token=A)
    newer, _ = tiny_model(forced_token=B)
    newer.save_pretrained(tmp_path / "v7")
    async with LocalEngine(model, tok, version=6) as engine:
        r = req(chat(tok, "go"), max_new_tokens=300)
        out: list[ModelResponse] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(generate_into, engine, r, out)
            await wait_until(lambda: steps(engine, r.rid) >= 3)
            await engine.pause()
            assert r.rid in engine.statistics().live_rids  # deterministically mid-generation
            await engine.update_weights(tmp_path / "v7", 7)
            assert engine.statistics().paused  # an explicit pause outlives the update
            await engine.resume()
    assert_versions_revealed(out[0], {A: 6, B: 7})
    assert len(out[0].output_tokens) == 300


async def test_update_weights_rejects_mismatched_weights(model_tok) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok) as engine:
        with pytest.raises(EngineError, match="update_weights"):
            await engine.update_weights({"nonsense": torch.zeros(3)}, 1)
        assert engine.get_version() == 0 and not engine.statistics().paused
        res = await engine.agenerate(req(chat(tok, "ok"), greedy=True, max_new_tokens=4))
        assert res.output_versions == (0,) * len(res.output_tokens)


@pytest.mark.parametrize(
    ("field", "gconfig", "error"),
    [
        ("n_samples", {"n_samples": 2}, UnsupportedRequestError),
        ("stop", {"stop": ["\n"]}, UnsupportedRequestError),
        ("use_beam_search", {"use_beam_search": True}, UnsupportedRequestError),
        ("frequency_penalty", {"frequency_penalty": 0.5}, UnsupportedRequestError),
        ("max_tokens", {"max_tokens": 5}, ValueError),
    ],
)
async def test_bad_requests_name_the_field(model_tok, field, gconfig, error) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok) as engine:
        with pytest.raises(error, match=field):
            await engine.agenerate(req(chat(tok, "hello"), **gconfig))
        assert not engine.statistics().live_rids


async def test_bad_prompts_name_the_field(model_tok) -> None:
    model, tok = model_tok
    async with LocalEngine(model, tok) as engine:
        with pytest.raises(ValueError, match=r"input_ids.*at least one token"):
            await engine.agenerate(req([]))
        with pytest.raises(ValueError, match=r"input_ids\[1\].*vocabulary"):
            await engine.agenerate(req([1, 999]))
        res = await engine.agenerate(req([1, 2], greedy=True, max_new_tokens=2))
        assert len(res.output_tokens) >= 1


async def test_from_pretrained_serves_a_saved_checkpoint(model_tok, tmp_path) -> None:
    model, tok = model_tok
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    prompt = chat(tok, "What is 3+4?")
    async with LocalEngine(model, tok) as engine:
        want = await engine.agenerate(req(prompt, greedy=True, ignore_eos=True, max_new_tokens=6))
    async with LocalEngine.from_pretrained(tmp_path, device="cpu", dtype=torch.float32) as engine:
        got = await engine.agenerate(req(prompt, greedy=True, ignore_eos=True, max_new_tokens=6))
    assert got.output_tokens == want.output_tokens
    torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs), atol=1e-5, rtol=0)


async def test_leaving_the_context_joins_the_worker(model_tok) -> None:
    model, tok = model_tok
    engine = LocalEngine(model, tok)
    async with engine:
        thread = engine._thread
        assert thread is not None and thread.is_alive()
        with trio.move_on_after(0.01):  # leave with a request in flight
            await engine.agenerate(req(chat(tok, "x"), ignore_eos=True, max_new_tokens=1000))
    assert not thread.is_alive()
    with pytest.raises(EngineError, match="not running"):
        await engine.agenerate(req(chat(tok, "x")))
