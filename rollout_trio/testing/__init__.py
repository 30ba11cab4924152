"""Tools for testing workflows against the rollout_trio contract.

``rollout_trio.testing.strategies`` holds Hypothesis strategies; :class:`ScriptedEngine`
is an engine whose answers, delays and failures a test scripts.
"""

from ._scripted import ScriptedEngine as ScriptedEngine
from ._scripted import echo_response as echo_response
