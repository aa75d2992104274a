"""A reward function whose module is slow to import in a verifier worker (like math-verify's sympy).

The import sleeps only where RLPOST_TEST_SLOW_IMPORT_S is set: the test sets it before the pool
spawns its workers, so pytest's own import stays fast.
"""

from __future__ import annotations

import os
import time

time.sleep(float(os.environ.get("RLPOST_TEST_SLOW_IMPORT_S", "0")))


def match(response: str, answer: str) -> float:
    """1.0 iff response == answer."""
    return 1.0 if response == answer else 0.0
