"""``python -m rollout_trio.cli``: the same as the ``rollout-trio`` command (and ``python -m rollout_trio``)."""

import sys

try:
    from . import console_main
except KeyboardInterrupt:  # Ctrl-C at once: as the command would say it
    print("rollout-trio: interrupted while starting; nothing ran", file=sys.stderr)
    sys.exit(130)

console_main()
