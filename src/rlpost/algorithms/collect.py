"""GRPO's first phase: collect the step's batch. Prompts are repeated num_generations_per_prompt
times, the engine gets the current weights first when they are stale, the rollouts are generated
and scored, and with dynamic sampling more prompts are drawn until enough groups vary.

Also home of the reward shaping the batch is judged by (scaled and overlong-shaped rewards), which
the advantages use too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlpost.algorithms.advantages import (
    apply_overlong_reward_shaping,
    calculate_baseline_and_std_per_prompt,
    scale_rewards,
)
from rlpost.algorithms.dynamic_sampling import DynamicSampler
from rlpost.algorithms.grpo_setup import GRPOComponents
from rlpost.algorithms.multi_turn import run_rollouts, turn_settings
from rlpost.algorithms.refit import wake_for_generation
from rlpost.algorithms.rollouts import RolloutBatch
from rlpost.config.schema.grpo import GRPOConfig
from rlpost.data.rows import PromptRow
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.models.policy.interfaces import TrainResult
from rlpost.runtime.timer import Timer


def sample_seeds(seed: int, step: int, n: int, salt: int = 0) -> list[int]:
    """Per-sample sampling seeds: a resumed run draws exactly what an uninterrupted one would."""
    return [(seed * 1_000_003 + step * 10_007 + salt * 7919 + i) % (2**31 - 1) for i in range(n)]


def validation_seeds(seed: int, step: int, start: int, n: int, repeat: int = 0) -> list[int]:
    """Seeds of validation rows start..start+n-1 at `step` (one batch of grpo.val_batch_size). `rlpost eval` of
    the checkpoint step_N draws its first sample per prompt with these (repeat 0), so it reproduces the run's
    validation at step N; repeat j > 0 seeds its further samples."""
    return sample_seeds(seed, step, n, salt=1 + start + repeat * 1_000_003)


def shaped_rewards(grpo_cfg: GRPOConfig, batch: RolloutBatch) -> torch.Tensor:
    """[B] rewards after grpo.reward_scaling and grpo.reward_shaping (overlong penalty)."""
    rewards = scale_rewards(batch.rewards, grpo_cfg.reward_scaling)
    return apply_overlong_reward_shaping(rewards, batch.gen["generation_lengths"].float(), grpo_cfg.reward_shaping)


def group_std(grpo_cfg: GRPOConfig, batch: RolloutBatch) -> torch.Tensor:
    """Per-sample std of its whole group's shaped rewards: what dynamic sampling decides on."""
    rewards = shaped_rewards(grpo_cfg, batch)
    _, std = calculate_baseline_and_std_per_prompt(batch.group_ids, rewards, torch.ones_like(rewards), False)
    return std


def rollout_rows(components: GRPOComponents, rows: list[PromptRow]) -> tuple[list[PromptRow], torch.Tensor]:
    """The rows tokenized and repeated num_generations_per_prompt times, and their group ids."""
    per_prompt = components.cfg.grpo.num_generations_per_prompt
    processed = components.processor.batch(rows)
    repeated = [p for p in processed for _ in range(per_prompt)]
    return repeated, torch.arange(len(processed)).repeat_interleave(per_prompt)


def step_samples(components: GRPOComponents, rows: list[PromptRow], step: int,
                 salt: int = 0) -> tuple[list[PromptRow], torch.Tensor, list[int]]:
    """The rows of step `step`'s generation batch `salt` (`rollout_rows`), their group ids and sampling seeds."""
    repeated, group_ids = rollout_rows(components, rows)
    return repeated, group_ids, sample_seeds(components.cfg.grpo.seed, step, len(repeated), salt=salt)


@dataclass
class Collected:
    """The step's batch and what it took to get it."""

    batch: RolloutBatch
    """The samples the step trains on."""
    generated_rewards: torch.Tensor
    """[N] raw rewards of every sample generated this step (dynamic sampling may have made several batches)."""
    sampler: DynamicSampler | None = None
    """The dynamic sampler (its counters go into the step's metrics), or None."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainedBatch:
    """A GRPO step's batch, trained: what the step loop books and logs."""

    collected: Collected
    train_data: BatchedDataDict
    """The whole batch's training tensors (for the step's metrics and save state)."""
    advantages: torch.Tensor
    results: TrainResult
    """The policy's training result for the whole batch."""


def collect_batch(
    components: GRPOComponents,
    rows: list[PromptRow],
    next_rows: Callable[[], list[PromptRow]],
    step: int,
    timer: Timer,
) -> Collected:
    """Generate and score `rows` (and, with dynamic sampling, more from `next_rows`) until the batch
    is full. The engine serves the policy's current weights (the step refit it first); it sleeps after each
    generation phase and is woken before the next."""
    grpo_cfg = components.cfg.grpo
    sampler = (DynamicSampler(grpo_cfg.num_prompts_per_step * grpo_cfg.num_generations_per_prompt,
                              grpo_cfg.dynamic_sampling_max_gen_batches) if grpo_cfg.use_dynamic_sampling else None)
    generated: list[torch.Tensor] = []
    while True:
        repeated, group_ids, seeds = step_samples(components, rows, step, sampler.gen_batches if sampler else 0)
        if generated:  # the engine slept after the previous batch: same weights, so a wake, not a refit
            wake_for_generation(components.policy, components.generation, components.colocated)
        # books "generation" and "reward_calculation" (scoring) apart; warns on slow rewards
        rollout = run_rollouts(repeated, group_ids, components.generation, components.tokenizer, components.envs,
                               turn_settings(components.cfg), components.cfg.generation.async_rollouts(),
                               seeds=seeds, timer=timer, label=f"step {step}")
        with timer.time("generation"):
            components.generation.finish_generation()
        generated.append(rollout.rewards)
        batch = rollout if sampler is None else sampler.add(rollout, group_std(grpo_cfg, rollout))
        if batch is not None:
            return Collected(batch, torch.cat(generated), sampler)
        rows = next_rows()
