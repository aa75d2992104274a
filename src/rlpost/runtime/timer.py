"""Step timer: nested named phases, reported as seconds under `timing/train/<phase>`.

While `recording_spans()` is on (logger.ray_timeline), every timed phase of every Timer is also kept as a span:
(thread name, phase, wall-clock start, seconds), for the run's timeline (rlpost.runtime.ray_timeline).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

Span = tuple[str, str, float, float]
"""(thread name, phase name, wall-clock start in seconds since the epoch, seconds)."""

MAX_SPANS = 200_000
"""The most recent spans kept (about 30 MB; a GRPO step times about ten phases): Ray keeps its last 100,000 calls."""

_spans: deque[Span] | None = None


@contextmanager
def recording_spans(limit: int = MAX_SPANS) -> Iterator[deque[Span]]:
    """Keep every Timer phase timed inside the block (any thread) in the yielded deque, the last `limit` of them."""
    global _spans
    spans: deque[Span] = deque(maxlen=limit)
    _spans = spans
    try:
        yield spans
    finally:
        _spans = None


class Timer:
    """Accumulates wall time per phase name until `reset`."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        spans = _spans
        start = time.time() if spans is not None else 0.0
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            self.times[name] = self.times.get(name, 0.0) + seconds
            if spans is not None:
                spans.append((threading.current_thread().name, name, start, seconds))

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": v for k, v in self.times.items()}

    def reset(self) -> None:
        self.times = {}
