"""RLOO (`algo=rloo`): REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024).

A prompt's k samples are each other's baseline: sample i's advantage is its reward minus the mean of the other
k - 1 rewards, A_i = r_i - (sum_j r_j - r_i) / (k - 1), not divided by any std. Everything else is GRPO's: the engine,
environments, step loop and loss. With one optimizer step per rollout batch (the default) the clipped loss's ratio
is exactly 1 and the update is REINFORCE's, -A log pi averaged over the batch's tokens; with several, the clip
bounds how far each later step moves (as verl's and TRL's RLOO do).
"""

from __future__ import annotations

import torch

from rlpost.algorithms.advantages import rloo_advantages
from rlpost.algorithms.grpo_unit import GRPOUnit
from rlpost.config.schema.master import MasterConfig


class RLOOUnit(GRPOUnit):
    """GRPO's unit with RLOO's advantages."""

    def advantages(self, cfg: MasterConfig, group_ids: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """[B] r_i minus the mean of the other rewards of sample i's prompt group."""
        return rloo_advantages(group_ids, rewards)


UNIT = RLOOUnit()
