"""Reward functions for the verifier-pool tests (importable by spawned workers)."""

import time


def maybe_hang(response: str, answer: str) -> float:
    if response == "hang":
        time.sleep(3600)
    if response == "boom":
        raise ValueError("verifier bug")
    return 1.0 if response == answer else 0.0
