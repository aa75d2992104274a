"""Which policy version the rollout engine serves, and the refit that brings it up to date.

Training bumps the policy's version; `sync`, called before anything generates, refits the engine (timed as the
step's "refit") when the engine's version is older, and otherwise wakes it if it sleeps. The refit itself is `refit_policy_generation`: one path for every layout, the
transport chosen by where the engine lives (docs/backends.md).
"""

from __future__ import annotations

from rlpost.algorithms.grpo_setup import GRPOComponents, generation_dtype
from rlpost.algorithms.refit import refit_policy_generation, wake_for_generation
from rlpost.runtime.timer import Timer


class EngineWeights:
    """The engine's weights version against the policy's, and the refits between them."""

    def __init__(self, components: GRPOComponents) -> None:
        self.components = components
        self.dtype = generation_dtype(components.cfg)
        self.policy_version, self.engine_version = 0, -1  # the engine starts with the checkpoint's weights, unchecked

    def policy_updated(self) -> None:
        """The policy took an optimizer step: the engine is behind."""
        self.policy_version += 1

    def refit(self) -> float:
        """Refit now; the seconds it took."""
        c = self.components
        took = refit_policy_generation(c.policy, c.generation, c.colocated, self.dtype,
                                       c.cfg.policy.refit_buffer_size_gb)
        self.engine_version = self.policy_version
        return took

    def sync(self, timer: Timer) -> None:
        """Make the engine ready to generate the policy's current weights: a refit when it is behind (timed on
        `timer` as "refit"), else a wake when it sleeps (a colocated engine sleeps after every generation phase)."""
        if self.engine_version != self.policy_version:
            with timer.time("refit"):
                self.refit()
        else:
            c = self.components
            wake_for_generation(c.policy, c.generation, c.colocated)
