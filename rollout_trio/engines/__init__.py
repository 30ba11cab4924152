"""Inference engines: the protocol, the embedded LocalEngine and the RemoteEngine client.

This package is the home of the :class:`InferenceEngine` protocol, which workflows, groups
and executors import; importing it loads the protocol only. The concrete engines (and
what they need: torch, transformers, the HTTP client) are imported on first access to
their name, so the protocol's home never pulls them in and no import cycle runs through
it (executor -> engines is the one direction).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._util import fixup_module_metadata as _fixup_module_metadata
from ._protocol import InferenceEngine as InferenceEngine
from ._protocol import WeightsSource as WeightsSource

if TYPE_CHECKING:
    from ._local import LocalEngine as LocalEngine
    from ._local import LocalEngineStatistics as LocalEngineStatistics
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

#: Public name -> the private module that defines it (imported on first access).
_LAZY = {
    "LocalEngine": "._local",
    "LocalEngineStatistics": "._local",
    "RemoteEngine": "._remote",
    "RetryPolicy": "._remote_http",
    "ReplayEngine": "._replay",
    "ReplayMismatchError": "._replay",
    "TrioTransport": "._transport",
    "ConnectionLimits": "._transport",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    _fixup_module_metadata(__name__, {name: value})  # public names report the public module
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


_fixup_module_metadata(__name__, globals())
