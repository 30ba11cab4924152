"""RLVRWorkflow and MultiTurnWorkflow: every case of spec/executor.md §10 / cases 120-126."""

import sys
import types

import pytest
import torch

from rollout_trio import GenerationConfig, ModelResponse, workflow_context
from rollout_trio.workflow_context import StatsRecorder
from rollout_trio.models import tiny_model
from rollout_trio.engines import LocalEngine
from rollout_trio.rewards import RewardFunction
from rollout_trio.testing import ScriptedEngine
from rollout_trio.workflows import MultiTurnWorkflow, RLVRWorkflow
from rollout_trio.workflows._multi_turn import FEEDBACK

EOS = 2


class FakeTok:
    """decode(ids) = "[n tokens]"; the user's question is [11, 12], the generation prompt [13]."""

    eos_token_id = EOS
    pad_token_id = 0
    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False, **kw):
        ids = []
        for m in messages:
            if m["role"] == "assistant":
                ids += [80]
            elif m["content"] == FEEDBACK:
                ids += [91]
            else:
                ids += [11, 12]
        return ids + ([13] if add_generation_prompt else [])

    def decode(self, ids, **kw):
        return f"[{len(ids)} tokens]"


DATA = {"messages": [{"role": "user", "content": "q"}], "answer": "42"}


def scripted(outputs):
    """Answers with the given (tokens, versions) pairs in order; logprobs -0.5, -0.1, ..."""
    queue = list(outputs)

    def script(req):
        tokens, versions = queue.pop(0)
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=tokens,
            output_logprobs=[-0.5, -0.1][: len(tokens)] + [-0.2] * (len(tokens) - 2),
            output_versions=versions,
            stop_reason="stop",
        )

    return ScriptedEngine(script)


def recording(rewards):
    calls = []
    queue = list(rewards)

    def reward(prompt, completion, prompt_ids, completion_ids, **data):
        calls.append((prompt, completion, prompt_ids, completion_ids, data))
        return queue.pop(0)

    return reward, calls


async def test_rlvr_spec_example_exact_tensors_and_reward_call():
    reward, calls = recording([1])
    engine = scripted([([21, 22], [3, 4])])
    traj = await RLVRWorkflow(reward, GenerationConfig(max_new_tokens=8), FakeTok()).arun_episode(engine, DATA)
    assert calls == [("[3 tokens]", "[2 tokens]", [11, 12, 13], [21, 22], DATA)]
    assert traj.input_ids.tolist() == [[11, 12, 13, 21, 22]] and traj.input_ids.dtype == torch.int32
    assert traj.loss_mask.tolist() == [[0, 0, 0, 1, 1]] and traj.loss_mask.dtype == torch.int32
    assert traj.logprobs[0].tolist() == pytest.approx([0, 0, 0, -0.5, -0.1]) and traj.logprobs.dtype == torch.float32
    assert traj.versions.tolist() == [[-1, -1, -1, 3, 4]] and traj.versions.dtype == torch.int32
    assert traj.extras["turn_ids"].tolist() == [[-1, -1, -1, 0, 0]]
    assert traj.attention_mask.tolist() == [[True] * 5] and traj.attention_mask.dtype == torch.bool
    assert traj.rewards.tolist() == [1.0] and traj.rewards.dtype == torch.float32
    assert traj.is_truncated.tolist() == [False]
    g = engine.requests[0].gconfig
    assert (g.n_samples, g.max_new_tokens) == (1, 8) and {0, EOS} <= set(g.stop_token_ids)


async def test_rlvr_reward_from_an_import_string_is_imported_on_the_first_episode():
    mod = types.ModuleType("rt_lazy_rewards")
    sys.modules[mod.__name__] = mod
    try:
        wf = RLVRWorkflow("rt_lazy_rewards.score", None, FakeTok())  # not defined yet: lazy
        mod.score = lambda prompt, completion, p_ids, c_ids, **data: float(len(c_ids))
        traj = await wf.arun_episode(scripted([([21, 22, 23], [0, 0, 0])]), DATA)
    finally:
        del sys.modules[mod.__name__]
    assert traj.rewards.tolist() == [3.0]


async def test_rlvr_is_truncated_and_stats_and_a_configured_reward_function():
    recorder = StatsRecorder()
    engine = ScriptedEngine()  # echo: stops at max_new_tokens -> "length"
    wf = RLVRWorkflow(RewardFunction(lambda *a, **k: 0.5, timeout=5), GenerationConfig(max_new_tokens=2), FakeTok())
    with workflow_context.use_stats_recorder(recorder), workflow_context.use(workflow_context.WorkflowContext(is_eval=True)):
        traj = await wf.arun_episode(engine, DATA)
    assert traj.is_truncated.tolist() == [True]
    stats = recorder.export()
    assert stats.pop("eval-rollout/reward") == 0.5
    # each phase's wall time, under the eval scope (issue 28: phases reach the stats)
    assert set(stats) == {"eval-rollout/phase/generate_seconds", "eval-rollout/phase/reward_seconds"}
    assert all(v >= 0 for v in stats.values())


async def test_rlvr_with_the_real_tiny_engine_and_tokenizer():
    model, tok = tiny_model()
    seen = []

    def reward(prompt, completion, prompt_ids, completion_ids, **data):
        seen.append(completion)
        return 1.0 if completion.startswith("5") else 0.0

    async with LocalEngine(model, tok, seed=0) as engine:
        traj = await RLVRWorkflow(reward, GenerationConfig(max_new_tokens=8, greedy=True), tok).arun_episode(
            engine, {"messages": [{"role": "user", "content": "What is 2+3?"}]}
        )
    prompt_len = int((traj.loss_mask[0] == 0).sum())
    assert traj.input_ids[0, :prompt_len].tolist() == tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert traj.rewards.tolist() == [1.0 if seen[0].startswith("5") else 0.0]
    assert (traj.versions[traj.loss_mask == 0] == -1).all()


async def test_multi_turn_spec_example():
    reward, calls = recording([0, 1])
    engine = scripted([([21, 22], [5, 5]), ([31, 32], [6, 6])])
    recorder = StatsRecorder()
    wf = MultiTurnWorkflow(reward, None, FakeTok(), max_turns=3, turn_discount=0.9)
    assert wf.multi_turn_prompt_ids == [91, 13]
    with workflow_context.use_stats_recorder(recorder):
        traj = await wf.arun_episode(engine, DATA)
    assert traj.input_ids.tolist() == [[11, 12, 13, 21, 22, EOS, 91, 13, 31, 32]]
    assert traj.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 1, 1]]
    assert traj.extras["turn_ids"].tolist() == [[-1, -1, -1, 0, 0, -1, -1, -1, 1, 1]]
    assert traj.versions.tolist() == [[-1, -1, -1, 5, 5, -1, -1, -1, 6, 6]]
    assert traj.logprobs[0].tolist() == pytest.approx([0, 0, 0, -0.5, -0.1, 0, 0, 0, -0.5, -0.1])
    assert traj.rewards.tolist() == pytest.approx([0.9])
    assert recorder.export() == {"rollout/reward": pytest.approx(0.9), "rollout/num_turns": 2.0}
    # The second attempt saw the first, the eos and the feedback turn.
    assert list(engine.requests[1].input_ids) == [11, 12, 13, 21, 22, EOS, 91, 13]
    assert calls[1][2] == [11, 12, 13, 21, 22, EOS, 91, 13] and calls[1][3] == [31, 32]


async def test_multi_turn_all_failures_use_every_turn_and_feedback_between():
    reward, _ = recording([0, 0, 0])
    engine = scripted([([21], [0]), ([22], [0]), ([23], [0])])
    traj = await MultiTurnWorkflow(reward, None, FakeTok(), max_turns=3, turn_discount=0.5).arun_episode(engine, DATA)
    assert len(engine.requests) == 3
    assert traj.rewards.tolist() == [0.0]
    ids = traj.input_ids[0].tolist()
    assert ids.count(91) == 2 and ids[-1] == 23  # feedback twice, not after the last attempt


async def test_multi_turn_stops_on_a_negative_reward():
    reward, _ = recording([-1])
    engine = scripted([([21, 22], [0, 0])])
    traj = await MultiTurnWorkflow(reward, None, FakeTok(), max_turns=3, turn_discount=0.9).arun_episode(engine, DATA)
    assert len(engine.requests) == 1 and traj.rewards.tolist() == [-1.0]


async def test_multi_turn_output_ending_in_eos_gets_no_second_eos():
    reward, _ = recording([0, 1])
    engine = scripted([([21, EOS], [0, 0]), ([31], [1])])
    traj = await MultiTurnWorkflow(reward, None, FakeTok(), max_turns=2).arun_episode(engine, DATA)
    assert traj.input_ids.tolist() == [[11, 12, 13, 21, EOS, 91, 13, 31]]
    assert traj.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 1]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_turns": 0}, "max_turns must be positive"), ({"turn_discount": 0}, r"turn_discount must be in \(0, 1\]."), ({"turn_discount": 1.5}, r"turn_discount must be in \(0, 1\].")],
)
def test_multi_turn_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiTurnWorkflow(lambda *a, **k: 0.0, None, FakeTok(), **{"max_turns": 2, **kwargs})


async def test_multi_turn_with_the_real_tiny_tokenizer_masks_feedback():
    model, tok = tiny_model()
    wf = MultiTurnWorkflow(lambda *a, **k: 0.0, GenerationConfig(max_new_tokens=4), tok, max_turns=2)
    assert tok.decode(wf.multi_turn_prompt_ids) == f"<|im_start|>user\n{FEEDBACK}<|im_end|>\n<|im_start|>assistant\n"
    async with LocalEngine(model, tok, seed=0) as engine:
        traj = await wf.arun_episode(engine, {"messages": [{"role": "user", "content": "What is 1+1?"}]})
    assert (traj.versions[traj.loss_mask == 0] == -1).all() and (traj.versions[traj.loss_mask == 1] == 0).all()
    text = tok.decode(traj.input_ids[0][traj.loss_mask[0] == 0].tolist())
    assert FEEDBACK in text
