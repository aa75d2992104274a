"""DAPO dynamic sampling: keep only groups whose rewards vary, across generation batches.

Kept groups accumulate in a cache until it holds at least num_prompts_per_step x G samples, which
are then cut to exactly that many; after `dynamic_sampling_max_gen_batches` batches without enough
it raises.
"""

from __future__ import annotations

import torch

from rlpost.algorithms.rollouts import RolloutBatch


class DynamicSamplingExhausted(RuntimeError):
    """Too few groups with varied rewards after the allowed number of generation batches."""


def varied_groups(batch: RolloutBatch, std: torch.Tensor) -> list[int]:
    """Indices of the samples whose group has non-zero std of the rewards the advantages use.

    `std` [B] is the per-sample std from the advantage baseline, computed on the scaled and shaped
    rewards; a group is kept when any of its samples sees a non-zero std (a leave-one-out std can
    be 0 for one sample of a varied group).
    """
    keep = []
    for g in torch.unique(batch.group_ids).tolist():
        idx = (batch.group_ids == g).nonzero().flatten().tolist()
        if float(std[idx].abs().max()) > 0:
            keep.extend(idx)
    return keep


class DynamicSampler:
    """Caches kept samples across generation batches of one step."""

    def __init__(self, target: int, max_gen_batches: int) -> None:
        self.target = target
        self.max_gen_batches = max_gen_batches
        self.cache: list[RolloutBatch] = []
        self.gen_batches = 0
        self.discarded = 0

    def add(self, batch: RolloutBatch, std: torch.Tensor) -> RolloutBatch | None:
        """Add a batch; the filled batch once there are enough samples, else None (generate another)."""
        self.gen_batches += 1
        keep = varied_groups(batch, std)
        self.discarded += batch.size - len(keep)
        if keep:
            self.cache.append(batch.select(keep))
        have = sum(b.size for b in self.cache)
        if have >= self.target:
            full = RolloutBatch.concat(self.cache)
            return full.select(list(range(self.target)))
        if self.gen_batches >= self.max_gen_batches:
            raise DynamicSamplingExhausted(
                f"dynamic sampling: only {have} of {self.target} samples had varied rewards after "
                f"{self.gen_batches} generation batches (grpo.dynamic_sampling_max_gen_batches)"
            )
        return None
