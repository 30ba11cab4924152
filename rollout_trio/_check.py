"""``check_trajectory_format``: check a workflow result against the contract, for debugging."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._errors import WorkflowContractError
from ._interaction import Interaction
from ._trajectory import Trajectory

__all__ = ["check_trajectory_format"]


def check_trajectory_format(
    data: Any,
    *,
    batch_size: int | None = None,
    expected_keys: set[str] | None = None,
) -> bool:
    """Check a workflow result against the contract, for debugging custom workflows.

    Args:
        data: what a workflow returned: ``None``, a dict of tensors, a :class:`Trajectory`,
            or a dict of :class:`Interaction` (checked when converted, so accepted here).
        batch_size: the rows the result must have (default: any).
        expected_keys: keys the result must hold (default: none beyond the contract's).

    Returns:
        True when ``data`` keeps the contract (it never returns False).

    Raises:
        WorkflowContractError: naming the key and the rule ``data`` breaks (a wrong type,
            an empty dict, a batch size or key set other than asked).
    """
    if data is None:
        return True
    if isinstance(data, Trajectory):
        traj = data
    else:
        if not isinstance(data, Mapping):
            raise WorkflowContractError(f"trajectory: expected None, a dict or a Trajectory, got {type(data).__name__}")
        if not data:
            raise WorkflowContractError("trajectory: the dict is empty; expected input_ids and attention_mask at least")
        if all(isinstance(v, Interaction) for v in data.values()):
            return True
        traj = Trajectory.from_dict(data)
    if batch_size is not None and traj.batch_size != batch_size:
        raise WorkflowContractError(f"'input_ids': batch size mismatch; expected {batch_size} rows, got {traj.batch_size}")
    if expected_keys is not None:
        missing = sorted(set(expected_keys) - set(traj.to_dict()))
        if missing:
            raise WorkflowContractError(f"trajectory: keys {missing} are missing; expected {sorted(expected_keys)}")
    return True
