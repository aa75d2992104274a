"""`algo=grpo` as a unit (rlpost.config.algorithms): group baselines and GRPO's step loop, synchronous
(rlpost.algorithms.grpo) or asynchronous (rlpost.algorithms.async_grpo, with grpo.async_grpo.enabled). The other
rollout algorithms subclass `GRPOUnit` and override what differs."""

from __future__ import annotations

from contextlib import AbstractContextManager

from rlpost.algorithms.async_grpo import async_grpo_loop
from rlpost.algorithms.grpo import grpo_loop
from rlpost.algorithms.grpo_setup import GRPOComponents
from rlpost.algorithms.loop import StepLoop
from rlpost.algorithms.units import RolloutUnit


class GRPOUnit(RolloutUnit):
    """GRPO: what setup and the step ask of it (RolloutUnit's answers) and its step loop."""

    def loop(self, components: GRPOComponents) -> AbstractContextManager[StepLoop]:
        """The run's step loop."""
        if components.cfg.grpo.async_grpo.enabled:
            return async_grpo_loop(components)
        return grpo_loop(components)


UNIT = GRPOUnit()
