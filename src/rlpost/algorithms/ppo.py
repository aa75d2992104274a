"""PPO (`algo=ppo`): GRPO's step with advantages from a learned value function.

`ppo_step` is one step, read top to bottom: collect_batch (refit when stale, generate, score) -> the training
tensors -> the policy's prev / reference logprobs -> the critic's values -> token rewards (the environment's reward
on the last response token, minus ppo.kl_in_reward * KL on every token) -> GAE -> whitening -> train the critic
-> train the policy (after ppo.critic_warmup_steps) with the same ClippedPG loss as GRPO. `PPO` is GRPO's algorithm
for the shared step loop with this step; validation, checkpoints (the critic beside the policy), logging and stops
are the loop's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from rlpost.algorithms.collect import TrainedBatch, collect_batch, shaped_rewards
from rlpost.algorithms.critic import CriticGroup
from rlpost.algorithms.engine_weights import EngineWeights
from rlpost.algorithms.gae import explained_variance, gae, masked_whiten, token_rewards
from rlpost.algorithms.grpo import GRPO, logprobs, loop_parts, step_result, train
from rlpost.algorithms.grpo_setup import GRPOComponents
from rlpost.algorithms.grpo_unit import GRPOUnit
from rlpost.algorithms.loop import StepLoop, StepResult
from rlpost.algorithms.prepare import training_tensors
from rlpost.algorithms.units import SideGroup
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.ppo import PPOConfig
from rlpost.data.rows import PromptRow
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.value import ClippedValueLossFn
from rlpost.models.policy.interfaces import TrainResult
from rlpost.models.policy.lm_policy import Policy
from rlpost.runtime.timer import Timer


@dataclass
class PPOBatch(TrainedBatch):
    """A PPO step's batch, trained: GRPO's, plus what the critic made of it."""

    critic_metrics: dict[str, float]
    """train/value_loss, train/explained_variance, train/value_clip_fraction, train/returns/mean, ..."""
    policy_trained: bool
    """False during the critic's warm-up steps."""


def _parts(components: GRPOComponents) -> tuple[PPOConfig, Policy]:
    ppo = components.cfg.ppo
    assert ppo is not None  # algo=ppo's block
    return ppo, components.side(CriticGroup.name)


def kl_in_reward(cfg: MasterConfig) -> float:
    """The coefficient of the KL penalty in the reward (ppo.kl_in_reward)."""
    assert cfg.ppo is not None
    return cfg.ppo.kl_in_reward


def ppo_advantages(components: GRPOComponents, train_data: BatchedDataDict, rewards: torch.Tensor,
                   values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token rewards -> GAE -> whitening, on the whole batch: {advantages, returns, values} [B, S] and the
    unwhitened `raw_advantages`."""
    ppo, _ = _parts(components)
    mask = train_data["token_mask"] * train_data["sample_mask"][:, None]
    kl = None
    coef = kl_in_reward(components.cfg)
    if coef > 0:  # k1 per token: the trainer's pre-update logprobs against the reference's
        kl = train_data["prev_logprobs"] - train_data["reference_policy_logprobs"]
    r = token_rewards(rewards, mask, kl, coef)
    adv, returns = gae(r, values, mask, ppo.gamma, ppo.lam)
    whitened = masked_whiten(adv, mask) if ppo.whiten_advantages else adv
    return {"advantages": whitened, "returns": returns, "values": values * mask, "raw_advantages": adv}


def ppo_step(components: GRPOComponents, rows: list[PromptRow], step: int, timer: Timer,
             weights: EngineWeights) -> PPOBatch:
    """One PPO step on the prompts `rows` (see the module docstring)."""
    ppo, critic = _parts(components)
    weights.sync(timer)  # the engine takes the policy's weights (a wake when it has them)
    collected = collect_batch(components, rows, components.dataloader.next_batch, step, timer)
    batch = collected.batch
    with timer.time("data_processing"):
        rewards = shaped_rewards(components.cfg.grpo, batch)
        train_data = training_tensors(components, batch, torch.zeros(batch.size))
    logprobs(components, train_data, timer)
    if kl_in_reward(components.cfg) > 0:
        with timer.time("policy_and_reference_logprobs"):
            if "prev_logprobs" not in train_data:
                train_data["prev_logprobs"] = components.policy.get_logprobs(train_data)["logprobs"]
            if "reference_policy_logprobs" not in train_data:
                train_data["reference_policy_logprobs"] = components.policy.get_reference_policy_logprobs(
                    train_data)["reference_logprobs"]
    with timer.time("critic_values"):
        values = critic.get_values(train_data)["values"]
    with timer.time("advantages"):
        out = ppo_advantages(components, train_data, rewards, values)
        raw = out.pop("raw_advantages")
        for key, value in out.items():
            train_data[key] = value
    with timer.time("critic_training"):
        critic_result = critic.train(train_data, ClippedValueLossFn(ppo.value_clip))
    trained = step > ppo.critic_warmup_steps
    results = train(components, train_data, weights, timer) if trained else _untrained()
    mask = train_data["token_mask"] * train_data["sample_mask"][:, None]
    n = mask.sum().clamp(min=1.0)
    critic_metrics = {
        "train/value_loss": critic_result.loss,
        "train/value_clip_fraction": critic_result.metrics.get("value_clip_fraction", 0.0),
        "train/critic_grad_norm": critic_result.grad_norm,
        "train/explained_variance": explained_variance(values, out["returns"], mask),
        "train/values/mean": float((values * mask).sum() / n),
        "train/returns/mean": float((out["returns"] * mask).sum() / n),
        "train/advantages/raw_mean": float((raw * mask).sum() / n),
        "train/policy_trained": float(trained),
    }
    per_token = (out["advantages"] * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [B]: what the batch metrics show
    return PPOBatch(collected, train_data, per_token, results, critic_metrics, trained)


def _untrained() -> TrainResult:
    """The policy's result for a critic warm-up step: no update."""
    return TrainResult(loss=0.0, grad_norm=0.0, lr=0.0, params_finite=True, all_mb_metrics={}, metrics={})


class PPO(GRPO):
    """GRPO's step-loop algorithm with `ppo_step`: the engine serves the policy's current weights at every step."""

    def step(self, step: int, timer: Timer) -> StepResult:
        loader = self.components.dataloader
        done = ppo_step(self.components, loader.next_batch(), step, timer, self.weights)
        self._trained = done.train_data
        last = step >= self.schedule.max_num_steps or loader.epochs_done() >= self.schedule.max_num_epochs
        result = step_result(self.components, done, loader.state_dict(), last)
        result.metrics.update(done.critic_metrics)
        return result


@contextmanager
def ppo_loop(components: GRPOComponents) -> Iterator[StepLoop]:
    """The step loop of a PPO run."""
    yield StepLoop(PPO(components), loop_parts(components))


class PPOUnit(GRPOUnit):
    """`algo=ppo` (rlpost.config.algorithms): the critic beside the policy, GAE in `ppo_step`."""

    def side_groups(self, cfg: MasterConfig) -> list[SideGroup]:
        assert cfg.critic is not None  # algo=ppo's block
        return [CriticGroup(cfg, cfg.critic)]

    def reference_needed(self, cfg: MasterConfig) -> bool:
        return kl_in_reward(cfg) > 0

    def loop(self, components: GRPOComponents) -> AbstractContextManager[StepLoop]:
        return ppo_loop(components)


UNIT = PPOUnit()
