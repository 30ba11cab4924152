"""Inference engines: the protocol, the embedded LocalEngine and the RemoteEngine client."""

from ._protocol import InferenceEngine as InferenceEngine
from ._protocol import WeightsSource as WeightsSource
