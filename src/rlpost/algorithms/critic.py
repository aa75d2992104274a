"""PPO's critic: the value model's worker group (rlpost.algorithms.side_groups).

It loads `critic.model_name` (default: the policy's model) with a one-output head on every token (`value_head`),
trains in full with the policy's optimizer at `critic.lr`, never generates, and keeps no reference model.
"""

from __future__ import annotations

from pathlib import Path

from rlpost.algorithms.side_groups import side_cluster, side_config, with_lr
from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.policy import PolicyConfig
from rlpost.distributed.start_gate import StartGate
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.models.policy.lm_policy import Policy

CRITIC_DIR = "critic"
"""The critic's part of a checkpoint: step_N/critic/{weights,optimizer}."""


def critic_config(cfg: MasterConfig) -> PolicyConfig:
    """The critic's policy block: the policy's, with the value head, the critic's model, lr and micro-batch."""
    c = cfg.critic
    assert c is not None  # MasterConfig refuses algo=ppo without it
    p = cfg.policy
    return with_lr(side_config(cfg, c.model_name or p.model_name, value_head=True,
                               train_micro_batch_size=c.train_micro_batch_size or p.train_micro_batch_size), c.lr)


def critic_cluster(cfg: MasterConfig, policy_cluster: RayVirtualCluster) -> RayVirtualCluster | None:
    """The critic's own bundles (None when it shares the policy's)."""
    c = cfg.critic
    assert c is not None
    return side_cluster("ppo_critic_cluster", cfg, policy_cluster, c.colocated, c.num_workers)


def build_critic(cfg: MasterConfig, cluster: RayVirtualCluster, checkpoint: Path | None, device: str,
                 gate: StartGate | None = None) -> Policy:
    """The critic's workers (not waited for), loading its part of `checkpoint` when resuming; each builds its model
    once `gate` is ready (rlpost.distributed.start_gate)."""
    weights = optim = None
    if checkpoint is not None:
        weights, optim = str(checkpoint / CRITIC_DIR / "weights"), str(checkpoint / CRITIC_DIR / "optimizer")
    return Policy(cluster, critic_config(cfg), weights_path=weights, optimizer_path=optim, init_reference_model=False,
                  device=device, timeout_s=cfg.cluster.call_timeout_s, name="critic", start_after=gate)
