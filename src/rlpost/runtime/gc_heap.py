"""Python's cyclic garbage collector in rlpost's processes: off while they import, less often in the engine.

A collection walks every tracked object of the generations it collects, and the oldest generation ends up holding
everything a process imported. Importing vLLM, transformers and torch's compiler stack makes hundreds of thousands
of objects and triggers a collection every few hundred allocations, each older one walking more of that growing
heap. So a process's start (the engine's, a policy worker's, the driver's before `ray.init`) spends a large share of
its time in collections that free almost nothing, and a full collection of an imported torch + transformers heap is
slow on its own.

`paused_gc` turns the collector off for a block of imports. With `freeze` (the default), what exists when the block
ends moves to the permanent generation (`gc.freeze`, as vLLM does with its own heap once started), so no later
collection walks it again, neither during the rest of the start nor in the steady state. Only objects made before
the block ends are frozen; a block should therefore hold imports (long-lived module state), not the building of
objects that are dropped later: a frozen object that becomes cyclic garbage is never freed.

`raise_young_threshold` is for the steady state of a process that keeps thousands of short-lived containers alive
at once: vLLM's engine holds a call's samples (token lists, a logprob dict per token) until it returns them, so
with Python's default threshold of 700 several young collections run inside every generation call, each walking
objects that are still in use; at 50,000 a collection runs once in several calls, when most of them are freed.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc(freeze: bool = True) -> Iterator[None]:
    """The cyclic collector off inside the block (explicit `gc.collect()` calls still run); on exit, with `freeze`,
    every object tracked so far is frozen, then the collector is on again. A no-op where the collector is already
    off (a nested block, or a process that runs without it)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()


def collect_and_freeze() -> None:
    """One full collection, then freeze what survives: after a block paused with `freeze=False` that also made
    cyclic garbage, which is freed here instead of frozen."""
    gc.collect()
    gc.freeze()


def import_frozen(*modules: str) -> None:
    """Import `modules` (dotted names) with the collector paused, then freeze what the process holds. Nothing
    happens when all of them are imported already: a process that builds a second engine or worker (a test, a
    benchmark) does not freeze what the first left as cyclic garbage (vLLM's engines are full of cycles)."""
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return
    with paused_gc():
        for name in missing:
            importlib.import_module(name)


YOUNG_THRESHOLD = 50_000
"""The young generation's threshold `raise_young_threshold` sets (Python's default: 700)."""


def raise_young_threshold(threshold0: int = YOUNG_THRESHOLD) -> None:
    """Collect the young generation only once `threshold0` more tracked objects were allocated than freed (never
    lowering a higher threshold already set); the older generations' thresholds are kept."""
    t0, t1, t2 = gc.get_threshold()
    gc.set_threshold(max(t0, threshold0), t1, t2)
