"""Differential tests: padding/concatenation and normalization equal AReaL 1.0.4's.

AReaL runs in its own environment (bench/.areal-venv, created by ``python -m bench`` or
``python -m bench.areal_env``) as one worker subprocess for the whole module; each
Hypothesis example sends a batch of cases in one round trip. Without that environment
the module is skipped, with the reason.

The deliberate differences (docs/normalization.md) are kept out of the equality
properties and each has its own test below showing it:

* ``versions`` is padded with -1 (AReaL: 0);
* leave-one-out over a group of one gives 0 (AReaL: the value over its std, as if the
  baseline were 0);
* a std ``<= eps`` divides by 1 in ``normalize_rewards`` (AReaL: by ``std + eps``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import areal_env
from bench.areal_client import Areal, decode, encode
from rollout_trio import NormConfig, Trajectory, concat_trajectories, normalize_advantages, normalize_rewards
from rollout_trio.testing import strategies as rts

if not areal_env.ready():
    pytest.skip(
        f"AReaL 1.0.4 environment absent ({areal_env.VENV}); create it with `python -m bench.areal_env`",
        allow_module_level=True,
    )

LEVELS = ["batch", "group", None]


@pytest.fixture(scope="module")
def areal() -> Iterator[Areal]:
    with Areal(areal_env.python()) as worker:
        assert worker.info["areal"] == "1.0.4"
        yield worker


# --------------------------------------------------------------------------- padding


def _plain(t: Trajectory) -> dict[str, Any]:
    """The tensor and list values: what both sides concatenate (``rollout_group`` /
    ``rollout_reward`` are our metadata; AReaL would keep the first item's)."""
    return {k: v for k, v in t.to_dict().items() if isinstance(v, (torch.Tensor, list))}


def _areal_concat(areal: Areal, groups: list[list[Trajectory]]) -> list[dict[str, Any]]:
    cases = [[{k: encode(v) for k, v in _plain(t).items()} for t in g] for g in groups]
    return [{k: decode(v) for k, v in r.items()} for r in areal("concat", cases=cases)["results"]]


def _padded_columns(group: list[Trajectory]) -> torch.Tensor:
    """True where concatenation padded a row (columns past that item's own width)."""
    width = max(t.input_ids.shape[1] for t in group)
    rows = [torch.arange(width).expand(t.batch_size, width) >= t.input_ids.shape[1] for t in group]
    return torch.cat(rows)


@settings(max_examples=60, deadline=None)
@given(st.lists(rts.trajectory_groups(min_size=1, max_size=4), min_size=1, max_size=8))
def test_concatenation_equals_areal_except_versions_padding(areal: Areal, groups: list[list[Trajectory]]) -> None:
    """Every concatenated key equals AReaL's ``concat_padded_tensors`` (values, dtype,
    shape); ``versions`` equals it wherever concatenation did not pad."""
    for group, theirs in zip(groups, _areal_concat(areal, groups), strict=True):
        ours = _plain(concat_trajectories(group))
        assert ours.keys() == theirs.keys()
        pad = _padded_columns(group)
        for key, value in theirs.items():
            if isinstance(value, list):
                assert ours[key] == value, key
                continue
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
            if key == "versions":
                assert torch.equal(ours[key][~pad], value[~pad])
            else:
                assert torch.equal(ours[key], value), key


def test_difference_versions_padded_with_minus_one(areal: Areal) -> None:
    """Deliberate difference: where concatenation pads, our ``versions`` is -1, AReaL's 0
    (so ``versions == -1`` wherever ``loss_mask == 0`` holds after packing)."""
    short = Trajectory.from_dict(
        {
            "input_ids": torch.tensor([[5, 6, 7]]),
            "attention_mask": torch.ones(1, 3, dtype=torch.bool),
            "loss_mask": torch.tensor([[0, 1, 1]]),
            "logprobs": torch.tensor([[0.0, -0.5, -0.25]]),
            "versions": torch.tensor([[-1, 3, 3]]),
            "rewards": torch.tensor([1.0]),
        }
    )
    long = Trajectory.from_dict({**short.to_dict(), "input_ids": torch.tensor([[5, 6, 7, 8, 9]]),
                                 "attention_mask": torch.ones(1, 5, dtype=torch.bool),
                                 "loss_mask": torch.tensor([[0, 1, 1, 1, 1]]),
                                 "logprobs": torch.tensor([[0.0, -0.5, -0.25, -1.0, -2.0]]),
                                 "versions": torch.tensor([[-1, 3, 3, 4, 4]])})
    (theirs,) = _areal_concat(areal, [[short, long]])
    ours = concat_trajectories([short, long])
    assert ours.versions[0].tolist() == [-1, 3, 3, -1, -1]
    assert theirs["versions"][0].tolist() == [-1, 3, 3, 0, 0]
    assert torch.equal(ours.loss_mask, theirs["loss_mask"])  # the rest agrees


# --------------------------------------------------------------------------- normalization


@st.composite
def norm_cases(draw: st.DrawFn, *, two_d: bool) -> dict[str, Any]:
    """A batch of whole groups, a config, and (2-D) a mask. Values are multiples of 1/4,
    so a std is either 0 or far above any eps drawn: the ``std <= eps`` rule never
    changes a result here (its own test shows it)."""
    group_size = draw(st.integers(1, 5))
    rows = group_size * draw(st.integers(1, 4))
    shape = (rows, draw(st.integers(1, 4))) if two_d else (rows,)
    n = rows * (shape[1] if two_d else 1)
    x = torch.tensor(draw(st.lists(st.integers(-40, 40), min_size=n, max_size=n)), dtype=torch.float32) / 4
    config = {
        "mean_level": draw(st.sampled_from(LEVELS)),
        "std_level": draw(st.sampled_from(LEVELS)),
        "mean_leave1out": draw(st.booleans()),
        "std_unbiased": draw(st.booleans()),
        "eps": draw(st.sampled_from([1e-5, 1e-3, 1e-2])),
        "group_size": group_size,
    }
    mask = None
    if two_d and draw(st.booleans()):
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape).to(torch.int32)
    return {"x": x.reshape(shape), "config": config, "mask": mask}


def _ours_config(c: dict[str, Any]) -> NormConfig:
    return NormConfig(
        mean_level=c["mean_level"],
        std_level=c["std_level"],
        leave_one_out=c["mean_leave1out"],
        std_unbiased=c["std_unbiased"],
        eps=c["eps"],
        group_size=c["group_size"],
    )


def _loo_of_one(c: dict[str, Any]) -> bool:
    return c["mean_leave1out"] and c["mean_level"] == "group" and c["group_size"] == 1


def _areal_normalize(areal: Areal, cases: list[dict[str, Any]]) -> list[torch.Tensor]:
    wire = [{"x": encode(c["x"]), "config": c["config"], "mask": encode(c["mask"])} for c in cases]
    return [decode(r) for r in areal("normalize", cases=wire)["results"]]


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.lists(norm_cases(two_d=True), min_size=1, max_size=12))
def test_normalize_advantages_equals_areal_normalization(areal: Areal, cases: list[dict[str, Any]]) -> None:
    """``normalize_advantages`` (masked, token-weighted) equals AReaL's ``Normalization``
    on every level, mask, leave-one-out, bias and eps, except leave-one-out over groups
    of one."""
    cases = [c for c in cases if not _loo_of_one(c["config"])]
    for case, theirs in zip(cases, _areal_normalize(areal, cases), strict=True):
        ours = normalize_advantages(case["x"], _ours_config(case["config"]), mask=case["mask"])
        _close(ours, theirs)


@settings(max_examples=60, deadline=None)
@given(st.lists(norm_cases(two_d=False), min_size=1, max_size=12))
def test_normalize_rewards_equals_areal_normalization(areal: Areal, cases: list[dict[str, Any]]) -> None:
    """``normalize_rewards`` over per-row rollouts equals AReaL's ``Normalization`` of the
    reward vector, except leave-one-out over groups of one."""
    cases = [c for c in cases if not _loo_of_one(c["config"])]
    for case, theirs in zip(cases, _areal_normalize(areal, cases), strict=True):
        _close(normalize_rewards(case["x"], _ours_config(case["config"])), theirs)


def test_difference_leave_one_out_of_a_group_of_one_gives_zero(areal: Areal) -> None:
    """Deliberate difference: a group of one has no peer to leave out, so it is its own
    baseline and normalizes to 0; AReaL uses baseline 0 and returns the value over its
    std (here 1, unbiased std of one)."""
    x = torch.tensor([2.0, -1.0, 0.5])
    config = {"mean_level": "group", "std_level": "group", "mean_leave1out": True, "std_unbiased": True,
              "eps": 1e-5, "group_size": 1}
    (theirs,) = _areal_normalize(areal, [{"x": x, "config": config, "mask": None}])
    torch.testing.assert_close(theirs, x / (1 + 1e-5))
    assert normalize_rewards(x, _ours_config(config)).tolist() == [0.0, 0.0, 0.0]
    assert normalize_advantages(x, _ours_config(config)).tolist() == [0.0, 0.0, 0.0]


def test_difference_std_at_most_eps_divides_by_one(areal: Areal) -> None:
    """Deliberate difference: in ``normalize_rewards`` a group whose std is ``<= eps``
    is only centred (divisor 1); AReaL divides by ``std + eps``, blowing a 1e-7 spread up
    to about 0.5. ``normalize_advantages`` keeps AReaL's divisor."""
    x = torch.tensor([1.0, 1.0 + 2e-7], dtype=torch.float32)
    config = {"mean_level": "group", "std_level": "group", "mean_leave1out": False, "std_unbiased": False,
              "eps": 1e-5, "group_size": 2}
    (theirs,) = _areal_normalize(areal, [{"x": x, "config": config, "mask": None}])
    centred = (x.double() - x.double().mean()).float()
    ours = normalize_rewards(x, _ours_config(config))
    torch.testing.assert_close(ours, centred)
    spread = float(x.double().std(unbiased=False))
    torch.testing.assert_close(theirs, (centred.double() / (spread + 1e-5)).float())
    assert abs(float(theirs[0])) > 0.001 > abs(float(ours[0]))
    _close(normalize_advantages(x, _ours_config(config)), theirs)
