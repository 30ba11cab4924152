"""``python -m rollout_trio``: the same as the ``rollout-trio`` command."""

import sys

from .cli import main

sys.exit(main())
