"""The deliberate differences from the reference that docs/normalization.md lists (issue 11 item 8)."""

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


@pytest.mark.parametrize("d", [5e-9, 1e-8])
def test_a_std_at_or_below_eps_divides_by_one(d: float) -> None:
    mean, scale = rollout_time_affine([-d, d])  # population std d <= 1e-8
    assert scale.item() == 1.0
    # A row of -1 in the rollout whose reference is -d keeps its value; AReaL 1.0.4
    # would divide by d + 1e-8 and give about -5e7.
    assert rollout_time_apply(-1.0, mean, scale).item() == -1.0
    config = NormConfig(mean_level="group", std_level="group", std_unbiased=False, eps=1e-5, group_size=2)
    out = normalize_rewards(torch.tensor([0.0, 1.8e-5], dtype=torch.float64), config)  # std 9e-6 <= eps
    assert out.tolist() == pytest.approx([-9e-6, 9e-6], rel=1e-5)  # centred, divided by 1


def test_the_doc_lists_each_difference_with_its_test() -> None:
    text = DOC.read_text()
    section = text[text.index("## Differences from the reference") :]
    named = re.findall(r"Test:\s*`(test_\w+)`", section)
    assert named == [
        "test_leave_one_out_over_a_group_of_one_gives_zero",
        "test_versions_are_padded_with_minus_one",
        "test_a_std_at_or_below_eps_divides_by_one",
    ]
    assert all(name in globals() for name in named)
