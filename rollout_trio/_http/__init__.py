"""The HTTP layer shared by ``rollout-trio serve`` and the agent endpoint.

One ASGI app (:class:`HTTPApp`: routing, limits, bodies, disconnects), one server
(:func:`serve_app`: Hypercorn's public API), one strict converter for request bodies.
Nothing here imports Starlette; Hypercorn is imported only when a socket is served.
"""

from ._app import ClientGone as ClientGone
from ._app import HTTPApp as HTTPApp
from ._app import HTTPError as HTTPError
from ._app import Request as Request
from ._app import Response as Response
from ._app import json_bytes as json_bytes
from ._app import send_response as send_response
from ._in_process import InProcessClient as InProcessClient
from ._in_process import InProcessTransport as InProcessTransport
from ._convert import TypeRule as TypeRule
from ._convert import check_text as check_text
from ._convert import strict_converter as strict_converter
from ._limits import ServerLimits as ServerLimits
from ._serve import serve_app as serve_app

__all__ = [
    "ClientGone",
    "HTTPApp",
    "HTTPError",
    "InProcessClient",
    "InProcessTransport",
    "Request",
    "Response",
    "ServerLimits",
    "TypeRule",
    "check_text",
    "json_bytes",
    "send_response",
    "serve_app",
    "strict_converter",
]
