"""``python -m bench``: every side-by-side benchmark against AReaL 1.0.4 (see run_all.py)."""

import sys

from bench.run_all import main

sys.exit(main())
