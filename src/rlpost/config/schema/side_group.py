"""Rules of a worker group beside the policy (PPO's critic, a distillation teacher), shared by the algorithms that
build one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlpost.config.errors import require

if TYPE_CHECKING:
    from rlpost.config.schema.master import MasterConfig


def check_placement(path: str, colocated: bool, num_workers: int | None) -> None:
    """A worker group beside the policy: `num_workers` only for one of its own."""
    if colocated:
        require(num_workers is None, f"{path}.num_workers", num_workers,
                "a colocated group runs on the policy's workers' bundles",
                f"set {path}.colocated=false to give it workers of its own")


def side_group_rules(master: MasterConfig, group: str, why: str) -> None:
    """A side group is built by the policy's backend, on whole-vocabulary logits (tensor parallel size 1), with
    synchronous, unoverlapped steps (`why`: what it needs of the whole batch)."""
    p = master.policy
    require(p.serves_value_model, "policy._target_", p._target_, f"this backend builds no {group}",
            "use policy=dtensor, dtensor_v2 or megatron")
    require(p.parallel_sizes()["tp"] == 1, p.tp_key(), p.parallel_sizes()["tp"],
            f"the {group} needs whole-vocabulary logits and heads: tensor parallel size 1")
    require(not master.grpo.async_grpo.enabled, "grpo.async_grpo.enabled", True,
            f"a {group} runs with synchronous steps: {why}")
    require(master.grpo.overlap_generation_and_training is not True, "grpo.overlap_generation_and_training", True,
            f"a {group} needs generation and training apart: {why}")


def where(colocated: bool, num_workers: int | None, train_world: int) -> str:
    """A side group's placement, for the plan."""
    return (f"on the policy's {train_world} worker slot(s), beside it" if colocated else
            f"{num_workers or train_world} worker(s) of its own")
