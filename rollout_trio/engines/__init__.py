"""Inference engines: the protocol, the embedded LocalEngine and the RemoteEngine client."""

from ._local import LocalEngine as LocalEngine
from ._local import LocalEngineStatistics as LocalEngineStatistics
from ._protocol import InferenceEngine as InferenceEngine
from ._protocol import WeightsSource as WeightsSource
from ._remote import RemoteEngine as RemoteEngine
from ._remote_http import RetryPolicy as RetryPolicy
from ._replay import ReplayEngine as ReplayEngine
from ._replay import ReplayMismatchError as ReplayMismatchError
from ._transport import ConnectionLimits as ConnectionLimits
from ._transport import TrioTransport as TrioTransport

__all__ = [
    "ConnectionLimits",
    "InferenceEngine",
    "LocalEngine",
    "LocalEngineStatistics",
    "RemoteEngine",
    "RetryPolicy",
    "TrioTransport",
    "WeightsSource",
]

from .._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
