"""The cattrs converter: JSON and config dicts."""

import cattrs
import pytest
import torch

from rollout_trio import (
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    RolloutGroup,
    Trajectory,
    WorkflowContractError,
    converter,
    from_json,
    to_json,
)


def test_generation_config_from_a_config_dict():
    g = converter.structure({"temperature": 0.7, "stop_token_ids": [1, 2], "stop": ["\n"]}, GenerationConfig)
    assert g.temperature == 0.7 and g.stop_token_ids == (1, 2) and g.stop == ("\n",)
    assert converter.unstructure(g)["stop_token_ids"] == [1, 2]


def test_config_typos_and_bad_values_are_errors():
    with pytest.raises(cattrs.errors.ForbiddenExtraKeysError, match="temprature"):
        converter.structure({"temprature": 0.7}, GenerationConfig)
    with pytest.raises(WorkflowContractError, match="GenerationConfig.top_p"):
        converter.structure({"top_p": 0}, GenerationConfig)


def test_request_and_response_round_trip_without_the_tokenizer():
    req = ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(greedy=True), tokenizer=object(), metadata={"k": 1})
    data = converter.unstructure(req)
    assert "tokenizer" not in data
    back = from_json(to_json(req), ModelRequest)
    assert back == req and back.metadata == {"k": 1} and back.tokenizer is None
    resp = ModelResponse(input_tokens=[1], output_tokens=[2], output_logprobs=[-0.25], output_versions=[3], latency=0.5)
    assert from_json(to_json(resp), ModelResponse) == resp


def test_trajectory_json_keeps_dtypes_values_and_groups():
    t = Trajectory(
        input_ids=torch.tensor([[1, 2], [3, 0]], dtype=torch.int16),
        attention_mask=torch.tensor([[True, True], [True, False]]),
        logprobs=torch.tensor([[0.0, -0.1], [0.0, 0.0]], dtype=torch.float32),
        rollout_group=RolloutGroup((1, 1), (0.5, None)),
        extras={"uid": ["a", "b"], "score": torch.tensor([1.0, 2.0], dtype=torch.float64)},
    )
    back = from_json(to_json(t), Trajectory)
    for key, value in t.to_dict().items():
        got = back.to_dict()[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value), key
        else:
            assert got == value, key


def test_malformed_tensor_json_is_a_contract_error():
    with pytest.raises(WorkflowContractError, match="unknown tensor dtype"):
        converter.structure({"input_ids": {"__tensor__": "int33", "shape": [1], "data": [1]}}, Trajectory)
