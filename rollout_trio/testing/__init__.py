"""Tools for testing workflows against the rollout_trio contract.

``rollout_trio.testing.strategies`` holds Hypothesis strategies (the ``testing`` extra:
``pip install -e ".[testing]"`` in the checkout); :class:`ScriptedEngine`
is an engine whose answers, delays and failures a test scripts.
"""

from ._scripted import ScriptedEngine as ScriptedEngine
from ._scripted import echo_response as echo_response

__all__ = ["ScriptedEngine", "echo_response"]

from .._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
