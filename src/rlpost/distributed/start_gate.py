"""The start-up order of a colocated run: the engines first, asleep, then the policy's model.

vLLM sizes its KV cache from the device memory that is free while it starts, and a policy rank building its model on
the same GPU at that moment takes that memory away (a KV cache that changes from run to run, or "no available memory
for the cache blocks"). So a colocated engine is started and put to sleep before any worker group on its devices
allocates. The workers' processes still start beside the engine (their imports overlap the engine's start): each
waits on the gate, the handles of the engines' sleep calls, just before it builds its model. The same order runs on
every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray


@dataclass
class StartGate:
    """What a worker waits for before it builds its model. Ray resolves handles only when they are a call's own
    arguments, so handles inside this object reach the worker's constructor unresolved, and it waits for them after
    its imports."""

    handles: list[ray.ObjectRef[object]]
    """Ready once every colocated engine sleeps."""
    timeout_s: float
    """The longest wait (the engines' start-up included)."""

    def wait(self) -> None:
        """Block until every handle is ready; an engine that failed to start raises its own error here."""
        if self.handles:
            ray.get(list(self.handles), timeout=self.timeout_s)
