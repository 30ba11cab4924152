"""An HTTP server speaking SGLang's native protocol in front of an InferenceEngine.

``rollout-trio serve`` runs it with a :class:`~rollout_trio.engines.LocalEngine`; tests and
``RemoteEngine`` talk to it exactly as they would to an SGLang server.
"""

from ._http import HttpServer as HttpServer
from ._http import Request as Request
from ._http import Response as Response
from ._sglang_app import SGLangApp as SGLangApp

__all__ = ["HttpServer", "Request", "Response", "SGLangApp"]

from .._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
