"""Torch optimizer and LR scheduler from PytorchOptimizerConfig / the `policy.scheduler` list.

Import paths go through the `_target_` allow-list. Several schedulers plus one milestones entry
become a SequentialLR; no scheduler means a constant lr. The scheduler is stepped once per
`train()` call (once per GRPO step), as NeMo RL's DTensor worker does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlpost.config.schema.policy import PytorchOptimizerConfig, SchedulerMilestones, parse_scheduler
from rlpost.runtime.build import resolve


def build_optimizer(cfg: PytorchOptimizerConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    cls = resolve(cfg.name, key="policy.optimizer.name")
    kwargs: dict[str, Any] = dict(cfg.kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, **kwargs)


def build_scheduler(entries: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    parsed = parse_scheduler("policy.scheduler", entries)
    scheds = []
    milestones: list[int] = []
    for i, e in enumerate(parsed):
        if isinstance(e, SchedulerMilestones):
            milestones = list(e.milestones)
            continue
        cls = resolve(e.name, key=f"policy.scheduler[{i}].name")
        scheds.append(cls(optimizer, **e.kwargs))
    if not scheds:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    if len(scheds) == 1:
        return scheds[0]
    return torch.optim.lr_scheduler.SequentialLR(optimizer, scheds, milestones)
