"""A reward whose module takes ``ROLLOUT_TRIO_TEST_IMPORT_S`` seconds to import (like a heavy verifier)."""

import os
import time

time.sleep(float(os.environ.get("ROLLOUT_TRIO_TEST_IMPORT_S", "0")))


def score(x, hang=False):
    while hang:
        time.sleep(3600)
    return x * 2
