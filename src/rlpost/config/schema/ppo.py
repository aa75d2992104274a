"""PPO's blocks (`algo=ppo`): `ppo` (GAE, value loss, whitening, warm-up) and `critic` (the value model's workers).

PPO runs GRPO's machinery (engine, environments, step loop, checkpoints): steps, batch sizes and validation stay
under `grpo.*`; what PPO adds is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import require
from rlpost.config.fields import NON_NEGATIVE, POSITIVE, POSITIVE_OR_NONE, Block, checked, within
from rlpost.config.schema.side_group import check_placement


@dataclass
class PPOConfig(Block):
    """Advantages from a learned value function (GAE) instead of group baselines."""

    gamma: float = checked(1.0, within("[0, 1]"))
    """Discount of the token-level rewards (NeMo RL / verl `gamma`)."""
    lam: float = checked(1.0, within("[0, 1]"))
    """GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 the one-step TD error."""
    kl_in_reward: float = checked(0.0, NON_NEGATIVE)
    """Coefficient of a per-token KL penalty to the reference policy put into the reward (k1: lp_old - lp_ref,
    subtracted at every response token); 0 = none. The KL is then not also a loss term (keep
    loss_fn.reference_policy_kl_penalty=0)."""
    whiten_advantages: bool = True
    """Normalise the advantages to mean 0 and variance 1 over every valid token of the step's batch (all ranks,
    all micro-batches: computed on the driver before the batch is sharded)."""
    value_clip: float | None = checked(0.2, POSITIVE_OR_NONE)
    """Clip of the value update: the loss is max((v - R)^2, (v_old + clamp(v - v_old, ±clip) - R)^2) / 2; None =
    unclipped."""
    critic_warmup_steps: int = checked(0, NON_NEGATIVE)
    """The first this-many steps train the critic only; the policy starts learning after them."""


@dataclass
class CriticConfig(Block):
    """The value model: the policy's backend and architecture with a one-output head on every token (HF
    `AutoModelForTokenClassification`, num_labels=1), in a worker group of its own."""

    model_name: str | None = None
    """Local HF directory of the critic's body; None = the policy's model (its LM head replaced by the value
    head)."""
    lr: float = checked(1.0e-4, POSITIVE)
    """The critic's learning rate (its optimizer is otherwise the policy's)."""
    colocated: bool = True
    """Share the policy's workers' resources (one more actor on each of their bundles); false = bundles of its
    own, `num_workers` of them."""
    num_workers: int | None = checked(None, POSITIVE_OR_NONE)
    """Ranks of a critic on its own resources; None = as many as the policy has."""
    train_micro_batch_size: int | None = checked(None, POSITIVE_OR_NONE)
    """Samples per forward/backward micro-batch of the critic; None = the policy's."""

    def check(self, path: str) -> None:
        super().check(path)
        require(self.model_name is None or bool(self.model_name), f"{path}.model_name", self.model_name,
                "must name a local model directory (or be null: the policy's)")
        check_placement(path, self.colocated, self.num_workers)
