"""PPO's blocks (`algo=ppo`): `ppo` (GAE, value loss, whitening, warm-up) and `critic` (the value model's workers).

PPO runs GRPO's machinery (engine, environments, step loop, checkpoints): steps, batch sizes and validation stay
under `grpo.*`; what PPO adds is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import non_negative, positive, require
from rlpost.config.schema.side_group import check_placement


@dataclass
class PPOConfig:
    """Advantages from a learned value function (GAE) instead of group baselines."""

    gamma: float = 1.0
    """Discount of the token-level rewards (NeMo RL / verl `gamma`)."""
    lam: float = 1.0
    """GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 the one-step TD error."""
    kl_in_reward: float = 0.0
    """Coefficient of a per-token KL penalty to the reference policy put into the reward (k1: lp_old - lp_ref,
    subtracted at every response token); 0 = none. The KL is then not also a loss term (keep
    loss_fn.reference_policy_kl_penalty=0)."""
    whiten_advantages: bool = True
    """Normalise the advantages to mean 0 and variance 1 over every valid token of the step's batch (all ranks,
    all micro-batches: computed on the driver before the batch is sharded)."""
    value_clip: float | None = 0.2
    """Clip of the value update: the loss is max((v - R)^2, (v_old + clamp(v - v_old, ±clip) - R)^2) / 2; None =
    unclipped."""
    critic_warmup_steps: int = 0
    """The first this-many steps train the critic only; the policy starts learning after them."""

    def check(self, path: str) -> None:
        require(0.0 <= self.gamma <= 1.0, f"{path}.gamma", self.gamma, "must be in [0, 1]")
        require(0.0 <= self.lam <= 1.0, f"{path}.lam", self.lam, "must be in [0, 1]")
        non_negative(f"{path}.kl_in_reward", self.kl_in_reward)
        positive(f"{path}.value_clip", self.value_clip, allow_none=True)
        non_negative(f"{path}.critic_warmup_steps", self.critic_warmup_steps)


@dataclass
class CriticConfig:
    """The value model: the policy's backend and architecture with a one-output head on every token (HF
    `AutoModelForTokenClassification`, num_labels=1), in a worker group of its own."""

    model_name: str | None = None
    """Local HF directory of the critic's body; None = the policy's model (its LM head replaced by the value
    head)."""
    lr: float = 1.0e-4
    """The critic's learning rate (its optimizer is otherwise the policy's)."""
    colocated: bool = True
    """Share the policy's workers' resources (one more actor on each of their bundles); false = bundles of its
    own, `num_workers` of them."""
    num_workers: int | None = None
    """Ranks of a critic on its own resources; None = as many as the policy has."""
    train_micro_batch_size: int | None = None
    """Samples per forward/backward micro-batch of the critic; None = the policy's."""

    def check(self, path: str) -> None:
        require(self.model_name is None or bool(self.model_name), f"{path}.model_name", self.model_name,
                "must name a local model directory (or be null: the policy's)")
        positive(f"{path}.lr", self.lr)
        positive(f"{path}.train_micro_batch_size", self.train_micro_batch_size, allow_none=True)
        check_placement(path, self.colocated, self.num_workers)
