"""GRPO's second phase: the collected batch's advantages, then its [B, S] training tensors.

Used by the synchronous step (grpo.py), by the overlapped one chunk by chunk (overlap.py: a group's advantages
need only that group) and by async GRPO's trainer.
"""

from __future__ import annotations

import torch

from rlpost.algorithms.collect import shaped_rewards
from rlpost.algorithms.grpo_setup import GRPOComponents
from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.algorithms.train_data import build_train_data
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.runtime.timer import Timer


def _advantages(components: GRPOComponents, batch: RolloutBatch) -> torch.Tensor:
    """The algorithm's advantages of the batch's shaped rewards (rlpost.algorithms.units.RolloutUnit.advantages)."""
    cfg = components.cfg
    return components.unit.advantages(cfg, batch.group_ids, shaped_rewards(cfg.grpo, batch))


def prepare(components: GRPOComponents, batch: RolloutBatch, timer: Timer) -> tuple[BatchedDataDict, torch.Tensor]:
    """Advantages of the collected batch, then the [B, S] training tensors."""
    with timer.time("reward_calculation"):
        advantages = _advantages(components, batch)
    with timer.time("data_processing"):
        train_data = training_tensors(components, batch, advantages)
    return train_data, advantages


def training_tensors(components: GRPOComponents, batch: RolloutBatch, advantages: torch.Tensor) -> BatchedDataDict:
    """The [B, S] training tensors of `batch` with per-sample `advantages` [B] (PPO replaces them with per-token
    ones)."""
    mask = torch.tensor([r["loss_multiplier"] for r in batch.rows])
    if components.cfg.grpo.overlong_filtering:
        mask = mask * (~batch.gen["truncated"].bool()).float()
    return build_train_data(batch, advantages, mask, components.tokenizer.pad_token_id,
                            components.cfg.policy.make_sequence_length_divisible_by)
