"""Every argument rule of rollout_trio._normalize, with its whole message.

A bad argument gets a typed error that names the argument and the rule; these tests pin
each message exactly (type, argument name, rule, the values shown), so a message that
names the wrong argument or shows the wrong value fails here. Found by mutation testing:
before this file, a message could lose its argument's name or show another value's type
and every test still passed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rollout_trio._errors import WorkflowContractError
from rollout_trio._normalize import (
    NormConfig,
    group_mean_std,
    normalize_advantages,
    normalize_rewards,
    rollout_time_affine,
)
from rollout_trio._rollout_group import RolloutGroup

GROUPS = NormConfig(mean_level="group", std_level="group", group_size=2)
REAL_RULE = "must hold real numbers (float or integer dtype), got dtype torch.bool"
SPLIT = "Split rollout row rewards differ; supply an explicit rollout_reward for reward normalization."
BOOL2 = torch.tensor([True, False])

CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # NormConfig
    ("flag names the value's type", lambda: NormConfig(leave_one_out="yes"), ValueError,
     "NormConfig.leave_one_out: must be a bool, got str 'yes'"),
    # group_mean_std
    ("values of bools", lambda: group_mean_std(BOOL2), ValueError, f"values: {REAL_RULE}"),
    ("values of two dims", lambda: group_mean_std(torch.ones(2, 2)), ValueError,
     "values: must be a non-empty 1-D tensor, got shape (2, 2)"),
    ("values empty", lambda: group_mean_std([]), ValueError,
     "values: must be a non-empty 1-D tensor, got shape (0,)"),
    ("group_sizes not positive", lambda: group_mean_std([1.0, 2.0], [0, 2]), ValueError,
     "group_sizes: must be positive integers, got [0, 2]"),
    ("group_sizes not a sequence", lambda: group_mean_std([1.0, 2.0], 2), TypeError,  # type: ignore[arg-type]
     "group_sizes: must be a sequence of positive integers, got int"),
    ("group_sizes a string", lambda: group_mean_std([1.0, 2.0], "2"), TypeError,  # type: ignore[arg-type]
     "group_sizes: must be a sequence of positive integers, got str"),
    # rollout_time_affine
    ("references of bools", lambda: rollout_time_affine(BOOL2), ValueError, f"references: {REAL_RULE}"),
    ("references of two dims", lambda: rollout_time_affine(torch.ones(1, 2)), ValueError,
     "references: must be a non-empty 1-D sequence, got shape (1, 2)"),
    ("references an empty tensor", lambda: rollout_time_affine(torch.ones(0)), ValueError,
     "references: must be a non-empty 1-D sequence, got shape (0,)"),
    ("references an empty list", lambda: rollout_time_affine([]), ValueError,
     "references: must be a non-empty 1-D sequence, got shape (0,)"),
    # normalize_advantages
    ("x of bools", lambda: normalize_advantages(BOOL2, NormConfig()), ValueError, f"x: {REAL_RULE}"),
    ("x 0-d", lambda: normalize_advantages(torch.tensor(1.0), NormConfig()), ValueError,
     "x: must have a batch dimension (ndim >= 1), got a 0-d tensor"),
    ("mask of another shape", lambda: normalize_advantages(torch.ones(2, 3), NormConfig(), mask=torch.ones(2, 2)),
     ValueError, "mask: must have the shape of x (2, 3), got (2, 2)"),
    ("mask not 0/1", lambda: normalize_advantages(torch.ones(2), NormConfig(), mask=[1, 2]), ValueError,
     "mask: must hold only 0 and 1 (or False and True)"),
    ("rows not in groups", lambda: normalize_advantages(torch.ones(3), GROUPS), ValueError,
     "NormConfig.group_size: 3 rows do not split into groups of 2; pass group_sizes= for variable-size groups"),
    ("row group sizes do not sum", lambda: normalize_advantages(torch.ones(3), GROUPS, group_sizes=[2, 2]), ValueError,
     "group_sizes: sizes sum to 4, which must equal the number of rows (3)"),
    ("member_counts per group", lambda: normalize_advantages(torch.ones(4), GROUPS, member_counts=[1]), ValueError,
     "member_counts: must give one count per group (2 groups), got 1"),
    ("member_counts beyond rows", lambda: normalize_advantages(torch.ones(4), GROUPS, member_counts=[1, 3]),
     ValueError, "member_counts: a group cannot hold more logical rollouts than rows; counts [1, 3], rows [2, 2]"),
    ("member_counts not positive", lambda: normalize_advantages(torch.ones(4), GROUPS, member_counts=[0, 1]),
     ValueError, "member_counts: must be positive integers, got [0, 1]"),
    ("x not finite", lambda: normalize_advantages(torch.tensor([1.0, float("nan")]), NormConfig()), ValueError,
     "x: must be finite where mask is 1"),
    # normalize_rewards: arguments
    ("rewards of two dims", lambda: normalize_rewards(torch.ones(1, 2), NormConfig()), ValueError,
     "rewards: must be 1-D (one reward per row), got shape (1, 2)"),
    ("rewards not finite", lambda: normalize_rewards([1.0, float("inf")], NormConfig()), ValueError,
     "rewards: must be finite"),
    ("unpenalized of bools", lambda: normalize_rewards([1.0, 2.0], NormConfig(), unpenalized=BOOL2), ValueError,
     f"unpenalized: {REAL_RULE}"),
    ("unpenalized of another shape", lambda: normalize_rewards([1.0, 2.0], NormConfig(), unpenalized=[1.0]),
     ValueError, "unpenalized: must have the shape of rewards (2,), got (1,)"),
    ("bias not finite", lambda: normalize_rewards([1.0], NormConfig(), reward_bias=float("nan")), ValueError,
     "reward_bias: must be a finite real number, got nan"),
    ("scaling not a number", lambda: normalize_rewards([1.0], NormConfig(), reward_scaling="2"), ValueError,  # type: ignore[arg-type]
     "reward_scaling: must be a finite real number, got '2'"),
    ("clip a bool", lambda: normalize_rewards([1.0], NormConfig(), reward_clip=True), ValueError,
     "reward_clip: must be a real number > 0 (inf for no clipping), got True"),
    ("clip zero", lambda: normalize_rewards([1.0], NormConfig(), reward_clip=0.0), ValueError,
     "reward_clip: must be a real number > 0 (inf for no clipping), got 0.0"),
    ("clip not a number", lambda: normalize_rewards([1.0], NormConfig(), reward_clip="1"), ValueError,  # type: ignore[arg-type]
     "reward_clip: must be a real number > 0 (inf for no clipping), got '1'"),
    ("trajectory_rows alone", lambda: normalize_rewards([1.0], NormConfig(), trajectory_rows=[1]), ValueError,
     "trajectory_rows: only meaningful together with rollout_groups"),
    ("rollout sizes do not split", lambda: normalize_rewards([1.0, 2.0, 3.0], GROUPS), ValueError,
     "NormConfig.group_size: 3 logical rollouts do not split into groups of 2; "
     "pass group_sizes= for variable-size groups"),
    ("rollout group sizes do not sum", lambda: normalize_rewards([1.0, 2.0], GROUPS, group_sizes=[3]), ValueError,
     "group_sizes: sizes sum to 3, which must equal the number of logical rollouts (2)"),
    # normalize_rewards: rollout_groups
    ("one RolloutGroup unwrapped",
     lambda: normalize_rewards([1.0], NormConfig(), rollout_groups=RolloutGroup((1,), (1.0,))), TypeError,
     "rollout_groups: must be a sequence with one RolloutGroup (or None) per trajectory, "
     "got a single RolloutGroup (wrap it in a list)"),
    ("rollout_groups not a sequence", lambda: normalize_rewards([1.0], NormConfig(), rollout_groups=5), TypeError,  # type: ignore[arg-type]
     "rollout_groups: must be a sequence, got int"),
    ("rollout_groups a string", lambda: normalize_rewards([1.0], NormConfig(), rollout_groups="a"), TypeError,  # type: ignore[arg-type]
     "rollout_groups: must be a sequence, got str"),
    ("an entry not a group", lambda: normalize_rewards([1.0, 2.0], NormConfig(), rollout_groups=[None, 3],  # type: ignore[list-item]
                                                       trajectory_rows=[1, 1]), TypeError,
     "rollout_groups[1]: must be a RolloutGroup or None, got int"),
    ("trajectory_rows not positive",
     lambda: normalize_rewards([1.0], NormConfig(), rollout_groups=[None], trajectory_rows=[0]), ValueError,
     "trajectory_rows: must be positive integers, got [0]"),
    ("trajectory_rows per trajectory",
     lambda: normalize_rewards([1.0], NormConfig(), rollout_groups=[None], trajectory_rows=[1, 1]), ValueError,
     "trajectory_rows: must give one row count per trajectory (1), got 2"),
    ("trajectory_rows needed for None", lambda: normalize_rewards([1.0], NormConfig(), rollout_groups=[None]),
     ValueError, "trajectory_rows: required when rollout_groups holds None (each row of such a "
     "trajectory is its own rollout, so its row count must be given)"),
    ("rows not covered",
     lambda: normalize_rewards([1.0, 2.0, 3.0], NormConfig(), rollout_groups=[RolloutGroup((1, 1), (None, None))]),
     ValueError, "rewards: has 3 rows but rollout_groups cover 2 rows; they must be equal (rows of each trajectory, in order)"),
    ("group_sizes against the groups",
     lambda: normalize_rewards([1.0, 2.0], NormConfig(), rollout_groups=[RolloutGroup((1, 1), (None, None))],
                               group_sizes=[1, 1]), ValueError,
     "group_sizes: must equal the logical rollouts per trajectory [2] (taken from rollout_groups), "
     "got [1, 1]; pass only one of them"),
    ("group_sizes checked first",
     lambda: normalize_rewards([1.0, 2.0], NormConfig(), rollout_groups=[RolloutGroup((1, 1), (None, None))],
                               group_sizes=[0]), ValueError, "group_sizes: must be positive integers, got [0]"),
    ("rows of a group against trajectory_rows",
     lambda: normalize_rewards([1.0, 2.0], NormConfig(), rollout_groups=[RolloutGroup((1, 1), (None, None))],
                               trajectory_rows=[3]), WorkflowContractError, None),
    # the split-rows rule names the rollout, its trajectory, its rows and their rewards
    ("split rows in the second trajectory",
     lambda: normalize_rewards([1.0, 5.0, 2.0, 7.0], NormConfig(),
                               rollout_groups=[RolloutGroup((1, 1), (None, None)), RolloutGroup((2,), (None,))]),
     WorkflowContractError, f"rollout_reward: rollout 0 of trajectory 1: rows 2..3 have rewards [2.0, 7.0]. {SPLIT}"),
    ("split rows after plain rows",
     lambda: normalize_rewards([1.0, 5.0, 2.0, 7.0], NormConfig(), rollout_groups=[None, RolloutGroup((2,), (None,))],
                               trajectory_rows=[2, 2]), WorkflowContractError,
     f"rollout_reward: rollout 0 of trajectory 1: rows 2..3 have rewards [2.0, 7.0]. {SPLIT}"),
    ("split rows after a group and plain rows",
     lambda: normalize_rewards([3.0, 3.0, 1.0, 2.0, 7.0], NormConfig(),
                               rollout_groups=[RolloutGroup((2,), (None,)), None, RolloutGroup((2,), (None,))],
                               trajectory_rows=[2, 1, 2]), WorkflowContractError,
     f"rollout_reward: rollout 0 of trajectory 2: rows 3..4 have rewards [2.0, 7.0]. {SPLIT}"),
    ("split rows behind a penalty",
     lambda: normalize_rewards([0.5, 0.5, 3.0], NormConfig(), rollout_groups=[RolloutGroup((2, 1), (None, None))],
                               unpenalized=[1.0, 0.0, 3.0]), WorkflowContractError,
     f"rollout_reward: rollout 0 of trajectory 0: rows 0..1 have rewards [0.5, 0.5] (unpenalized [1.0, 0.0]). {SPLIT}"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_argument_rule_raises_its_type_with_its_whole_message(
    call: Callable[[], Any], error: type[Exception] | None, message: str | None
) -> None:
    """The error's type and its message, whole (``None``: the call succeeds, or only the type
    is pinned where the message comes from RolloutGroup's own rule)."""
    if error is None:
        call()
        return
    with pytest.raises(error) as info:
        call()
    if message is not None:
        assert str(info.value) == message, str(info.value)


def test_the_group_rows_rule_names_the_trajectory() -> None:
    """A group whose row counts disagree with ``trajectory_rows`` is named by its index."""
    with pytest.raises(WorkflowContractError, match=re.escape("rollout_groups[1]: ")):
        normalize_rewards(
            [1.0, 2.0, 3.0],
            NormConfig(),
            rollout_groups=[None, RolloutGroup((1, 1), (None, None))],
            trajectory_rows=[1, 3],
        )
