"""AReaL's names for workflow authors, mapped onto rollout_trio (docs/areal.md).

``install()`` lets AReaL workflow files run unchanged: ``import areal.api...`` is then
served from the modules of this package (one per AReaL module, see
:data:`COVERED`) while the real AReaL is not installed.
"""

from ._errors import ArealCompatError
from ._hook import COVERED, current_options, install, installed, uninstall

__all__ = ["COVERED", "ArealCompatError", "current_options", "install", "installed", "uninstall"]
