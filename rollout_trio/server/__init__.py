"""An HTTP server speaking SGLang's native protocol in front of an InferenceEngine.

``rollout-trio serve`` runs it with a :class:`~rollout_trio.engines.LocalEngine` on
Hypercorn; tests and ``RemoteEngine`` talk to it exactly as they would to an SGLang
server, over a socket or in process through ``httpx.ASGITransport(sglang_asgi(app))``.
"""

from .._http import ServerLimits as ServerLimits
from .._http import serve_app as serve_app
from ._asgi import sglang_asgi as sglang_asgi
from ._schema import BadRequest as BadRequest
from ._sglang_app import Reply as Reply
from ._sglang_app import SGLangApp as SGLangApp

__all__ = ["BadRequest", "Reply", "SGLangApp", "ServerLimits", "serve_app", "sglang_asgi"]

from .._util import fixup_module_metadata as _fixup_module_metadata  # noqa: E402

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
