"""GenerationConfig, ModelRequest, ModelResponse and RolloutGroup: defaults and validation."""

import numpy as np
import pytest
import torch

from rollout_trio import GenerationConfig, ModelRequest, ModelResponse, RolloutGroup, WorkflowContractError


def test_generation_config_defaults_match_the_reference():
    g = GenerationConfig()
    assert (g.n_samples, g.max_new_tokens, g.min_new_tokens, g.max_tokens) == (1, 16384, 0, 32768)
    assert (g.greedy, g.top_p, g.top_k, g.temperature) == (False, 1.0, int(1e8), 1.0)
    assert (g.stop_token_ids, g.ignore_eos, g.skip_special_tokens, g.stop) == ((), False, True, None)
    assert (g.frequency_penalty, g.seed, g.lora_name, g.use_beam_search) == (0.0, None, "default_lora", False)
    assert (g.reward_normalization, g.drop_incomplete_group) == (False, False)
    assert not g.top_k_active


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_new_tokens", 0, "max_new_tokens > 0"),
        ("temperature", -0.1, "temperature >= 0"),
        ("top_p", 0.0, "0 < top_p <= 1"),
        ("top_p", 1.5, "0 < top_p <= 1"),
        ("n_samples", 0, "n_samples >= 1"),
        ("top_k", 0, "top_k >= 1"),
        ("max_tokens", True, "max_tokens > 0"),
        ("stop_token_ids", [1, -2], "non-negative"),
        ("greedy", 1, "a bool"),
    ],
)
def test_generation_config_rejects_bad_values_naming_field_and_rule(field, value, rule):
    with pytest.raises(WorkflowContractError, match=rule) as info:
        GenerationConfig(**{field: value})
    assert f"GenerationConfig.{field}" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_generation_config_new_revalidates_and_adds_stop_ids():
    g = GenerationConfig(stop_token_ids=[5])
    assert g.new(temperature=0.5).temperature == 0.5
    with pytest.raises(WorkflowContractError):
        g.new(top_p=2.0)

    class Tok:
        pad_token_id, eos_token_id = 7, 5

    assert g.with_stop_and_pad_token_ids(Tok()).stop_token_ids == (5, 7)
    assert GenerationConfig(greedy=True, temperature=0.7).effective_temperature == 0.0


def test_model_request_defaults_and_validation():
    r1, r2 = ModelRequest(input_ids=[1, 2]), ModelRequest(input_ids=[1, 2])
    assert r1.rid != r2.rid and r1.input_ids == (1, 2) and r1.gconfig == GenerationConfig()
    with pytest.raises(WorkflowContractError, match=r"ModelRequest.input_ids\[1\]"):
        ModelRequest(input_ids=[1, -1])
    with pytest.raises(WorkflowContractError, match="a GenerationConfig"):
        ModelRequest(input_ids=[1], gconfig={"temperature": 1.0})
    copy = r1.copy(input_ids=[1, 2, 3])
    assert copy.rid == r1.rid and copy.input_ids == (1, 2, 3) and copy.metadata is not r1.metadata


def _resp(**kw):
    base = dict(input_tokens=[1], output_tokens=[2, 3], output_logprobs=[-0.1, -0.2], output_versions=[0, 1])
    base.update(kw)
    return ModelResponse(**base)


def test_model_response_lengths_must_agree():
    assert _resp().output_len == 2 and _resp().input_len == 1
    with pytest.raises(WorkflowContractError, match=r"output_logprobs: must have one entry per output token \(len\(output_tokens\) == 2\), got 1"):
        _resp(output_logprobs=[-0.1])
    with pytest.raises(WorkflowContractError, match="output_versions"):
        _resp(output_versions=[0, 1, 2])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"output_logprobs": [-0.1, float("nan")]}, r"output_logprobs\[1\]"),
        ({"output_logprobs": [-0.1, 0.5]}, "log-probability <= 0"),
        ({"stop_reason": "eos"}, "stop_reason"),
        ({"latency": -1.0}, "latency >= 0"),
        ({"output_versions": [0, 1.5]}, r"output_versions\[1\]"),
    ],
)
def test_model_response_rejects_bad_fields(kw, match):
    with pytest.raises(WorkflowContractError, match=match):
        _resp(**kw)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((0, 1),), "positive integers"),
        (((True, 1),), "positive integers"),
        (((),), "positive integers"),
        (((1,), (float("nan"),)), "must be finite"),
        (((1, 1), (1.0,)), "must match row_counts"),
        (((1,), (True,)), "not a bool"),
        (((1,), (torch.zeros(2),)), "must be a scalar"),
        (((1,), ("1",)), "finite real number"),
    ],
)
def test_rollout_group_validation(args, match):
    """spec/group.md case 33, plus the scalar types DESIGN.md admits and refuses."""
    with pytest.raises(WorkflowContractError, match=match):
        RolloutGroup(*args)


def test_rollout_group_accepts_numpy_and_tensor_references_as_floats():
    g = RolloutGroup([2, 1], [np.float32(0.5), torch.tensor(2.0)])
    assert g.row_counts == (2, 1) and g.rewards == (0.5, 2.0)
    assert RolloutGroup((3,)).rewards == (None,)
    assert g.member_index() == [0, 0, 1] and g.n_rows == 3 and g.n_rollouts == 2


def test_rollout_group_row_count_mismatch():
    """spec/group.md case 34: a 1-row trajectory with RolloutGroup((2,))."""
    with pytest.raises(WorkflowContractError, match="sum to 2, expected 1"):
        RolloutGroup((2,)).validate_rows(1)
