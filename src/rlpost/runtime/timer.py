"""Step timer: nested named phases, reported as seconds under `timing/train/<phase>`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    """Accumulates wall time per phase name until `reset`."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": v for k, v in self.times.items()}

    def reset(self) -> None:
        self.times = {}
