"""Reward functions that cannot stall or hang the rollout.

:class:`RewardFunction` runs a (synchronous) verifier in a thread by default, or in a
pool of worker processes whose calls are killed, with everything they started, when
they run past the timeout::

    async with RewardFunction(verify, timeout=5, isolation="process") as reward:
        r = await reward(prompt, completion, prompt_ids, completion_ids, **data)
"""

from .._util import fixup_module_metadata as _fixup_module_metadata
from ._errors import RewardError as RewardError
from ._errors import RewardResourceError as RewardResourceError
from ._errors import RewardTimeoutError as RewardTimeoutError
from ._errors import RewardWorkerError as RewardWorkerError
from ._function import RewardFunction as RewardFunction
from ._function import RewardStatistics as RewardStatistics
from ._function import RewardThreadsExhaustedWarning as RewardThreadsExhaustedWarning

__all__ = [
    "RewardError",
    "RewardFunction",
    "RewardResourceError",
    "RewardStatistics",
    "RewardThreadsExhaustedWarning",
    "RewardTimeoutError",
    "RewardWorkerError",
]

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
