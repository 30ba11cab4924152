"""Inference engines: the protocol, the embedded LocalEngine and the RemoteEngine client."""

from ._local import LocalEngine as LocalEngine
from ._local import LocalEngineStatistics as LocalEngineStatistics
from ._protocol import InferenceEngine as InferenceEngine
from ._protocol import WeightsSource as WeightsSource
from ._remote import RemoteEngine as RemoteEngine
from ._remote_http import RetryPolicy as RetryPolicy
from ._replay import ReplayEngine as ReplayEngine
from ._replay import ReplayMismatchError as ReplayMismatchError
from ._transport import TrioTransport as TrioTransport
