"""``python -m rollout_trio``: the same as the ``rollout-trio`` command."""

import sys

try:
    from .cli import console_main
except KeyboardInterrupt:  # Ctrl-C at once: as the command would say it
    print("rollout-trio: interrupted while starting; nothing ran", file=sys.stderr)
    sys.exit(130)

console_main()
