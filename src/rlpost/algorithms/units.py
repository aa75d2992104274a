"""The code side of a rollout algorithm: what setup, the step and the runner call of it.

The registry (rlpost.config.algorithms) names, for each `algo=`, the module whose `UNIT` this is, and for
each add-on the module whose `side_group(cfg)` builds its worker group. `RolloutUnit` is what setup and the step
ask of an algorithm, with GRPO's answers; rlpost.algorithms.grpo.GRPOUnit adds the step loop. An algorithm subclasses
GRPOUnit and overrides what differs: its worker groups beside the policy (`SideGroup`: PPO's critic), its advantages
(RLOO's leave-one-out), whether the reference model runs for it, and its step loop.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from rlpost.config.algorithms import algorithm, set_addons

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlpost.config.schema.master import MasterConfig
    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.distributed.start_gate import StartGate
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy
    from rlpost.runtime.timer import Timer


class SideGroup(Protocol):
    """A worker group beside the policy, built by its backend (rlpost.algorithms.side_groups)."""

    name: str
    """Its workers' actor name (critic, teacher)."""
    colocated: bool
    """One more actor on each of the policy's bundles; False: bundles of its own (`cluster`)."""
    checkpoint_dir: str | None
    """Its part of a checkpoint (step_N/<dir>) when it trains; None when it never does."""

    def before_start(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Checks that need the policy's tokenizer, before Ray starts (ConfigError)."""

    def cluster(self, policy_cluster: RayVirtualCluster) -> RayVirtualCluster | None:
        """Its own bundles (None when it shares the policy's)."""

    def build(self, cluster: RayVirtualCluster, checkpoint: Path | None, device: str,
              gate: StartGate | None) -> Policy:
        """Its workers (not waited for), loading its part of `checkpoint` when resuming; each builds its model once
        `gate` opens."""

    def score(self, group: Policy, train_data: BatchedDataDict, timer: Timer) -> None:
        """Before the policy's logprobs: put what the loss reads of it into `train_data` (nothing, for most)."""


@dataclass
class Side:
    """A side group of a run: what it is and its workers."""

    spec: SideGroup
    group: Policy


class RolloutUnit:
    """What setup and the step ask of a rollout algorithm, with GRPO's answers: no side groups of its own,
    group-baseline advantages, no reference model of its own."""

    def side_groups(self, cfg: MasterConfig) -> list[SideGroup]:
        """Its worker groups beside the policy (add-ons' come on top: `run_side_groups`)."""
        return []

    def advantages(self, cfg: MasterConfig, group_ids: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """[B] advantages of a rollout batch from its (shaped) rewards [B] and prompt groups [B]: the group
        baseline (leave-one-out: grpo.use_leave_one_out_baseline), divided by the group's std
        (grpo.normalize_rewards)."""
        from rlpost.algorithms.advantages import calculate_baseline_and_std_per_prompt, compute_advantages

        g = cfg.grpo
        valid = torch.ones_like(rewards)
        baseline, std = calculate_baseline_and_std_per_prompt(group_ids, rewards, valid, g.use_leave_one_out_baseline)
        return compute_advantages(rewards, baseline, std, g.normalize_rewards)

    def reference_needed(self, cfg: MasterConfig) -> bool:
        """The reference model runs for the algorithm itself (beside what the loss reads)."""
        return False


def unit_of(cfg: MasterConfig) -> RolloutUnit:
    """The code of the run's algorithm (its registry entry's module's `UNIT`)."""
    unit = importlib.import_module(algorithm(cfg.algo).unit).UNIT
    assert isinstance(unit, RolloutUnit), f"{algorithm(cfg.algo).unit}.UNIT is not a RolloutUnit"
    return unit


def run_side_groups(cfg: MasterConfig) -> list[SideGroup]:
    """Every side group of the run: its algorithm's, then its add-ons'."""
    groups = unit_of(cfg).side_groups(cfg)
    return groups + [importlib.import_module(addon.unit).side_group(cfg) for addon in set_addons(cfg)]
