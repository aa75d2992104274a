"""Reward functions for the verifier-pool tests (importable by spawned workers)."""

import time


def maybe_hang(response: str, answer: str) -> float:
    if response == "hang":
        time.sleep(3600)
    if response == "boom":
        raise ValueError("verifier bug")
    return 1.0 if response == answer else 0.0


def maybe_die(response: str, answer: str) -> float:
    """The worker process exits on "die" (as if killed by the OS); else 1.0 iff response == answer."""
    if response == "die":
        import os

        os._exit(1)
    return 1.0 if response == answer else 0.0
