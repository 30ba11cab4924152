"""The deliberate differences from AReaL that docs/normalization.md lists (issue 11 item 8), each
against the AReaL version its rule comes from (issue 32): trainer-side rules against AReaL 1.0.4,
rollout-time rules against AReaL main since PR #1516 (1.0.4 has no rollout-time normalization)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rollout_trio import NormConfig, concat_trajectories, normalize_rewards
from rollout_trio._normalize import rollout_time_affine, rollout_time_apply

DOC = Path(__file__).resolve().parent.parent / "docs" / "normalization.md"


def test_leave_one_out_over_a_group_of_one_gives_zero() -> None:
    config = NormConfig(mean_level="group", std_level="group", leave_one_out=True, std_unbiased=True, eps=1e-5)
    out = normalize_rewards(torch.tensor([7.0, 1.0, 5.0]), config, group_sizes=[1, 2])
    assert out[0].item() == 0.0  # AReaL 1.0.4 would give 7.0
    # The pair: each baseline is the other member, std around it (unbiased, n - 1 = 1).
    assert out[1:].tolist() == pytest.approx([-4 / (32**0.5 + 1e-5), 4 / (32**0.5 + 1e-5)], rel=1e-6)


def test_versions_are_padded_with_minus_one() -> None:
    def row(n_prompt: int, n_out: int) -> dict[str, torch.Tensor]:
        n = n_prompt + n_out
        return {
            "input_ids": torch.ones(1, n, dtype=torch.int64),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * n_prompt + [1] * n_out]),
            "versions": torch.tensor([[-1] * n_prompt + [3] * n_out]),
        }

    joined = concat_trajectories([row(1, 1), row(2, 3)])
    assert joined.versions.tolist() == [[-1, 3, -1, -1, -1], [-1, -1, 3, 3, 3]]  # the reference: [-1, 3, 0, 0, 0]
    assert bool((joined.versions[joined.loss_mask == 0] == -1).all())


def _areal_main_1516(references: list[float]) -> tuple[float, float]:
    """AReaL main's rollout-time rule since PR #1516 (commit 95d70052f, after v2.0.0):
    float32, population std (1.0 for one rollout), divisor ``std + 1e-8``, no fallback.
    AReaL 1.0.4 has no rollout-time normalization to compare with."""
    r = torch.tensor(references, dtype=torch.float32)
    std = r.std(unbiased=False) if r.numel() > 1 else torch.tensor(1.0)
    return r.mean().item(), (std + 1e-8).item()


@pytest.mark.parametrize("d", [5e-9, 1e-8])
def test_a_rollout_time_std_at_or_below_1e_8_divides_by_one(d: float) -> None:
    mean, scale = rollout_time_affine([-d, d])  # population std d <= 1e-8
    assert scale.item() == 1.0
    # A row of -1 in the rollout whose reference is -d keeps its value; AReaL main since
    # #1516 divides by d + 1e-8 and gives about -5e7 (-6.7e7 for d = 5e-9).
    assert rollout_time_apply(-1.0, mean, scale).item() == -1.0
    areal_mean, areal_scale = _areal_main_1516([-d, d])
    assert (-1.0 - areal_mean) / areal_scale < -4e7


def test_above_1e_8_the_rollout_time_rule_is_areal_mains() -> None:
    """Where no fallback applies, ours equals #1516's (up to its float32 statistics)."""
    refs = [0.0, 1.0, 1.0, 3.0]
    mean, scale = rollout_time_affine(refs)
    areal_mean, areal_scale = _areal_main_1516(refs)
    assert (mean.item(), scale.item()) == pytest.approx((areal_mean, areal_scale), rel=1e-6)


def test_a_trainer_side_std_at_or_below_eps_divides_by_one() -> None:
    config = NormConfig(mean_level="group", std_level="group", std_unbiased=False, eps=1e-5, group_size=2)
    out = normalize_rewards(torch.tensor([0.0, 1.8e-5], dtype=torch.float64), config)  # std 9e-6 <= eps
    assert out.tolist() == pytest.approx([-9e-6, 9e-6], rel=1e-5)  # centred, divided by 1
    # AReaL 1.0.4's Normalization divides by std + eps: 9e-6 / 1.9e-5, about 0.47.


def test_the_doc_lists_each_difference_with_its_test() -> None:
    text = DOC.read_text()
    section = text[text.index("## Differences from the reference") :]
    named = re.findall(r"Test:\s*`(test_\w+)`", section)
    assert named == [
        "test_leave_one_out_over_a_group_of_one_gives_zero",
        "test_versions_are_padded_with_minus_one",
        "test_a_rollout_time_std_at_or_below_1e_8_divides_by_one",
        "test_a_trainer_side_std_at_or_below_eps_divides_by_one",
    ]
    assert all(name in globals() for name in named)


def test_the_doc_credits_rollout_time_normalization_to_areal_main_not_1_0_4() -> None:
    """Issue 32: AReaL 1.0.4 has no rollout-time normalization; it came with #1516."""
    text = " ".join(DOC.read_text().split())
    assert "1.0.4's rollout-time" not in text
    assert "It has **no rollout-time normalization at all**" in text
    assert "PR #1516" in text and "95d70052f" in text
    source = " ".join(Path(__file__).read_text().split())
    assert "AReaL 1.0.4 " + "would divide" not in source
