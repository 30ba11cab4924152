"""Inference servers placed by Ray: ``pip install "rollout-trio[ray]"``.

:func:`open_ray_fleet` starts N servers as Ray actors (one placement group each) and
sglang-router in front of them, keeps each one running through process, actor and node
losses, and yields the router's address and key for ``RemoteEngine(router=...)``. See
docs/fleet.md ("On a Ray cluster").
"""

from ._fleet import RayFleet, RayServer, open_ray_fleet
from ._process import SERVER_KINDS, RayFleetError

__all__ = ["SERVER_KINDS", "RayFleet", "RayFleetError", "RayServer", "open_ray_fleet"]
