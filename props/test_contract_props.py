"""Properties of the trajectory contract: round-trips, padding and validation."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rollout_trio import (
    GenerationConfig,
    ModelResponse,
    Trajectory,
    WorkflowContractError,
    concat_trajectories,
    converter,
    from_json,
    split_trajectories,
    to_json,
)
from rollout_trio._rollout_group import as_reward_scalar
from rollout_trio.testing import strategies as rst
from tests.group_helpers import assert_same_trajectory


@given(rst.trajectories())
def test_to_dict_then_from_dict_is_the_identity(traj):
    """Trajectory.from_dict(t.to_dict()) equals t, key by key, dtype and shape included."""
    assert_same_trajectory(Trajectory.from_dict(traj.to_dict()), traj)


@given(rst.trajectories())
def test_json_round_trip_is_the_identity(traj):
    """from_json(to_json(t)) equals t exactly, floats included."""
    assert_same_trajectory(from_json(to_json(traj), Trajectory), traj)


@given(rst.generation_configs())
def test_generation_config_dict_round_trip_is_the_identity(g):
    """Structuring the unstructured config gives back an equal config."""
    assert converter.structure(converter.unstructure(g), GenerationConfig) == g


@given(rst.model_responses())
def test_model_response_json_round_trip_is_the_identity(resp):
    """from_json(to_json(r)) == r for every valid response."""
    assert from_json(to_json(resp), ModelResponse) == resp


@given(rst.trajectory_groups())
def test_concat_then_split_gives_back_the_originals(trajs):
    """Splitting the joined batch by row counts and widths returns every original exactly."""
    joined = concat_trajectories(trajs)
    pieces = split_trajectories(joined, [t.batch_size for t in trajs], widths=[t.seqlen for t in trajs])
    for piece, orig in zip(pieces, trajs):
        assert torch.equal(piece.input_ids, orig.input_ids)
        assert piece.logical_group() == orig.logical_group()
        assert_same_trajectory(
            Trajectory.from_dict({k: v for k, v in piece.to_dict().items() if k not in ("rollout_group", "rollout_reward")}),
            Trajectory.from_dict({k: v for k, v in orig.to_dict().items() if k not in ("rollout_group", "rollout_reward")}),
        )


@given(rst.trajectory_groups())
def test_padding_never_changes_values_inside_the_original_extents(trajs):
    """Each original occupies its rows' top-left corner of the batch unchanged, and every
    padded position holds its key's pad value (attention False, versions -1, else 0)."""
    joined = concat_trajectories(trajs).to_dict()
    start = 0
    for t in trajs:
        rows = slice(start, start + t.batch_size)
        for key, value in t.to_dict().items():
            if not isinstance(value, torch.Tensor):
                continue
            got = joined[key][rows]
            if value.ndim == 1:
                assert torch.equal(got, value), key
                continue
            assert torch.equal(got[:, : value.shape[1]], value), key
            pad = {"attention_mask": False, "versions": -1}.get(key, 0)
            assert bool((got[:, value.shape[1] :] == pad).all()), key
        start += t.batch_size
    assert start == joined["input_ids"].shape[0]


@given(rst.trajectory_groups())
def test_row_counts_of_the_joined_group_sum_to_its_rows(trajs):
    """The joined rollout_group has one entry per logical rollout of the inputs, summing to B."""
    joined = concat_trajectories(trajs)
    assert joined.rollout_group.n_rows == joined.batch_size
    assert joined.rollout_group.n_rollouts == sum(t.logical_group().n_rollouts for t in trajs)


@given(rst.trajectories())
def test_validation_accepts_everything_the_strategies_generate(traj):
    """Every generated trajectory passes validation again as a plain dict."""
    Trajectory.from_dict(traj.to_dict())


@given(rst.corrupted_trajectory_dicts())
def test_validation_rejects_every_single_field_corruption(case):
    """Breaking any one rule of a valid dict raises WorkflowContractError whose first
    quoted name is the broken key (the form every contract message uses: 'key': rule)."""
    desc, bad = case
    key = desc.split(":")[0]
    with pytest.raises(WorkflowContractError) as info:
        Trajectory.from_dict(bad)
    named = re.findall(r"'([A-Za-z_]+)'", str(info.value))
    assert named[:1] == [key], (desc, str(info.value))


@given(st.data())
def test_from_response_rows_always_validate_and_mark_only_outputs(data):
    """The single-turn row trains exactly the output tokens and stamps -1 on the prompt."""
    resp = data.draw(rst.model_responses())
    t = Trajectory.from_response(resp, data.draw(rst.rewards()))
    assert int(t.loss_mask.sum()) == resp.output_len
    assert bool((t.versions[t.loss_mask == 0] == -1).all())


_EDGE_LOGPROBS = st.sampled_from([0.0, -0.0, -1e-45, -5e-324, -3.4028234663852886e38, -3.5e38, -1e300, -1.7976931348623157e308])


@st.composite
def _edge_responses(draw: st.DrawFn) -> ModelResponse:
    """Responses the checking constructor accepts, at the edges of what int32/float32 hold
    (empty prompts and outputs, the largest ids, logprobs beyond float32's range)."""
    token = st.integers(0, 2**31 - 1) | st.integers(0, 5)
    n_out = draw(st.integers(0, 4))
    return ModelResponse(
        input_tokens=draw(st.lists(token, max_size=4)),
        output_tokens=draw(st.lists(token, min_size=n_out, max_size=n_out)),
        output_logprobs=draw(st.lists(_EDGE_LOGPROBS | st.floats(-50.0, 0.0), min_size=n_out, max_size=n_out)),
        output_versions=draw(st.lists(st.integers(-3, 2**31 - 1), min_size=n_out, max_size=n_out)),
        stop_reason=draw(st.sampled_from(["stop", "length", "abort"])),
    )


@given(_edge_responses() | rst.model_responses(), rst.any_rewards(), st.none() | rst.any_rewards(), st.booleans())
def test_from_response_equals_the_checking_constructor_or_raises_what_it_raises(resp, reward, reference, extra):
    """from_response (which skips re-validating what the response guarantees) gives the
    same trajectory as the checking constructor fed the same fields, and raises the same
    error type when that constructor refuses them."""
    lps, n_in = list(resp.output_logprobs), resp.input_len
    extras = {"uid": ["a"]} if extra else {}

    def checked() -> Trajectory:
        return Trajectory(
            input_ids=torch.tensor([[*resp.input_tokens, *resp.output_tokens]], dtype=torch.int32),
            attention_mask=torch.ones(1, n_in + resp.output_len, dtype=torch.bool),
            loss_mask=torch.tensor([[0] * n_in + [1] * resp.output_len], dtype=torch.int32),
            logprobs=torch.tensor([[0.0] * n_in + lps], dtype=torch.float32),
            versions=torch.tensor([[-1] * n_in + list(resp.output_versions)], dtype=torch.int32),
            rewards=torch.tensor([as_reward_scalar(reward, what="reward")], dtype=torch.float32),
            is_truncated=torch.tensor([resp.stop_reason == "length"]),
            rollout_reward=reference,
            extras=extras,
        )

    try:
        expected = checked()
    except WorkflowContractError as exc:
        with pytest.raises(type(exc)):
            Trajectory.from_response(resp, reward, rollout_reward=reference, **extras)
        return
    assert_same_trajectory(Trajectory.from_response(resp, reward, rollout_reward=reference, **extras), expected)


@given(rst.trajectory_groups(max_rows=1))
def test_joining_plain_dicts_equals_joining_trajectories(trajs):
    """The fast path for plain dicts of one-row tensors gives exactly what the general
    path gives for the same items as Trajectory objects."""
    fast = concat_trajectories([t.to_dict() for t in trajs])
    general = concat_trajectories(trajs)
    assert_same_trajectory(fast, general)


@given(rst.trajectory_groups(max_rows=1, min_size=2), st.data())
def test_a_corrupted_item_is_named_whichever_path_joins_it(trajs, data):
    """Breaking one value rule in item k of a joinable list raises an error naming slot k."""
    k = data.draw(st.integers(0, len(trajs) - 1))
    items = [t.to_dict() for t in trajs]
    items[k] = {**items[k], "input_ids": torch.full_like(items[k]["input_ids"], -1)}
    with pytest.raises(WorkflowContractError, match=f"^slot {k}: 'input_ids'"):
        concat_trajectories(items)
