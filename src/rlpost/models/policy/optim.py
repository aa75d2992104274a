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


def build_optimizer(cfg: PytorchOptimizerConfig, params: Iterable[torch.nn.Parameter],
                    dry_run: bool = False) -> torch.optim.Optimizer:
    """The optimizer `cfg` names over `params`. `dry_run` (the driver's pre-flight, which only checks that the
    class takes the arguments): torch's own `add_param_group` runs without its dynamo-disable wrapper, whose first
    call imports torch._dynamo (a slow import, on the path to the first step); the checks are the same
    function's, and a class with its own `add_param_group` is built as it is."""
    cls = resolve(cfg.name, key="policy.optimizer.name")
    kwargs: dict[str, Any] = dict(cfg.kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if dry_run:
        cls = _without_dynamo_wrapper(cls)
    return cls(params, **kwargs)


def _without_dynamo_wrapper(cls: type) -> type:
    """`cls`, or a subclass of the same name whose `add_param_group` is torch.optim.Optimizer's undecorated one
    (`__wrapped__`, set by the functools.wraps of torch's `_disable_dynamo`); `cls` itself where torch has no such
    attribute or the class defines its own."""
    plain = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if plain is None or getattr(cls, "add_param_group", None) is not torch.optim.Optimizer.add_param_group:
        return cls
    return type(cls.__name__, (cls,), {"add_param_group": plain, "__module__": cls.__module__})


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
