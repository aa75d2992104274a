"""Worker groups beside the policy (rlpost.algorithms.units.SideGroup), built by its backend from a copy of its block:
PPO's critic, a distillation teacher. Each sits on the policy's bundles (one more actor on each) or on bundles of its
own."""

from __future__ import annotations

import dataclasses

from rlpost.config.schema.master import MasterConfig
from rlpost.config.schema.megatron import MegatronPolicyConfig
from rlpost.config.schema.policy import DTensorPolicyConfig, PolicyConfig
from rlpost.distributed.virtual_cluster import RayVirtualCluster


def side_config(cfg: MasterConfig, model_name: str, **changes: object) -> PolicyConfig:
    """The policy's block for another model: no engine, no LoRA (a side group trains in full or not at all), with
    `changes` applied."""
    p = cfg.policy
    out = dataclasses.replace(p, model_name=model_name, generation=None, **changes)  # type: ignore[arg-type]
    if isinstance(out, DTensorPolicyConfig):
        lora = dataclasses.replace(out.dtensor_cfg.lora_cfg, enabled=False)
        out.dtensor_cfg = dataclasses.replace(out.dtensor_cfg, lora_cfg=lora)
    elif isinstance(out, MegatronPolicyConfig):
        out.megatron_cfg = dataclasses.replace(out.megatron_cfg,
                                               peft=dataclasses.replace(out.megatron_cfg.peft, enabled=False))
    return out


def with_lr(block: PolicyConfig, lr: float) -> PolicyConfig:
    """`block` with its learning rate set to `lr`: policy.optimizer.kwargs.lr, and on Megatron the lr, min_lr and
    warm-up start that the preset derived from it, scaled alike."""
    scale = lr / float(block.optimizer.kwargs["lr"])
    out = dataclasses.replace(block, optimizer=dataclasses.replace(block.optimizer,
                                                                  kwargs={**block.optimizer.kwargs, "lr": lr}))
    if isinstance(out, MegatronPolicyConfig):
        m = out.megatron_cfg
        opt = dataclasses.replace(m.optimizer, lr=m.optimizer.lr * scale, min_lr=m.optimizer.min_lr * scale)
        sched = dataclasses.replace(m.scheduler, lr_warmup_init=m.scheduler.lr_warmup_init * scale)
        out.megatron_cfg = dataclasses.replace(m, optimizer=opt, scheduler=sched)
    return out


def side_cluster(name: str, cfg: MasterConfig, policy_cluster: RayVirtualCluster, colocated: bool,
                 num_workers: int | None) -> RayVirtualCluster | None:
    """Bundles of the group's own (None when it shares the policy's): `num_workers` on one node, else as many as
    the policy has, on as many nodes."""
    if colocated:
        return None
    workers = num_workers or policy_cluster.workers_per_node
    nodes = 1 if num_workers else policy_cluster.num_nodes
    return RayVirtualCluster(name, workers, nodes, policy_cluster.use_gpus, cfg.cluster.worker_num_cpus, 1,
                             cfg.cluster.placement_timeout_s, device=policy_cluster.device)

