"""Reward functions and warm-up hooks for the deadline / parallelism / warm-up tests.

Top-level and importable, because the verifier pool spawns its workers.
"""

from __future__ import annotations

import os
import time


def logged_sleep(response: str, log_dir: str) -> float:
    """Sleep 0.5 s and write this call's start and end times to log_dir/response."""
    start = time.time()
    time.sleep(0.5)
    end = time.time()
    with open(os.path.join(log_dir, response), "w") as f:
        f.write(f"{start} {end}")
    return 1.0


def hang_or_match(response: str, answer: str) -> float:
    """Never returns on "hang"; else 1.0 iff response == answer."""
    if response == "hang":
        time.sleep(3600)
    return 1.0 if response == answer else 0.0


def slow_warmup() -> None:
    """A warm-up hook that costs far more than the tests' per-call timeout."""
    time.sleep(1.5)
