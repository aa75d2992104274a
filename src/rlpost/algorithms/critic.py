"""PPO's critic: the value model's worker group (a `SideGroup`, rlpost.algorithms.units).

It loads `critic.model_name` (default: the policy's model) with a one-output head on every token (`value_head`),
trains in full with the policy's optimizer at `critic.lr`, never generates, and keeps no reference model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlpost.algorithms.side_groups import side_cluster, side_config, with_lr
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.config.schema.ppo import CriticConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlpost.distributed.batched_data_dict import BatchedDataDict
    from rlpost.distributed.start_gate import StartGate
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.policy.lm_policy import Policy
    from rlpost.runtime.timer import Timer

CRITIC_DIR = "critic"
"""The critic's part of a checkpoint: step_N/critic/{weights,optimizer}."""


class CriticGroup:
    """The critic's workers: the policy's backend with a value head."""

    name = "critic"
    checkpoint_dir: str | None = CRITIC_DIR

    def __init__(self, cfg: MasterConfig, critic: CriticConfig) -> None:
        self.cfg, self.critic = cfg, critic
        self.colocated = critic.colocated

    def config(self) -> PolicyConfig:
        """The critic's policy block: the policy's, with the value head, the critic's model, lr and micro-batch."""
        c, p = self.critic, self.cfg.policy
        return with_lr(side_config(self.cfg, c.model_name or p.model_name, value_head=True,
                                   train_micro_batch_size=c.train_micro_batch_size or p.train_micro_batch_size), c.lr)

    def before_start(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Nothing to check: the critic reads the policy's tokens with its own head."""

    def cluster(self, policy_cluster: RayVirtualCluster) -> RayVirtualCluster | None:
        return side_cluster("ppo_critic_cluster", self.cfg, policy_cluster, self.colocated, self.critic.num_workers)

    def build(self, cluster: RayVirtualCluster, checkpoint: Path | None, device: str,
              gate: StartGate | None) -> Policy:
        from rlpost.models.policy.lm_policy import Policy

        weights = optim = None
        if checkpoint is not None:
            weights, optim = str(checkpoint / CRITIC_DIR / "weights"), str(checkpoint / CRITIC_DIR / "optimizer")
        return Policy(cluster, self.config(), weights_path=weights, optimizer_path=optim, init_reference_model=False,
                      device=device, timeout_s=self.cfg.cluster.call_timeout_s, name="critic", start_after=gate)

    def score(self, group: Policy, train_data: BatchedDataDict, timer: Timer) -> None:
        """Nothing before the policy's logprobs: PPO's step asks the critic for its values after them."""
