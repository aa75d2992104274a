"""RLOO's rules and plan rows (its code: rlpost.algorithms.rloo; steps, batches and validation: the grpo block)."""

from __future__ import annotations

from rlpost.config.algorithms.grpo import group_rules
from rlpost.config.errors import require
from rlpost.config.schema.master import MasterConfig


def rloo_rules(master: MasterConfig) -> None:
    """At least two samples per prompt; GRPO's advantage switches are RLOO's fixed choice (they would have no
    effect)."""
    group_rules(master)
    g = master.grpo
    require(not g.normalize_rewards, "grpo.normalize_rewards", True,
            "algo=rloo's advantage is the reward minus the mean of the group's other rewards, not divided by a std",
            "use algo=grpo for std-normalised advantages")
    require(g.use_leave_one_out_baseline, "grpo.use_leave_one_out_baseline", False,
            "algo=rloo's baseline always leaves the sample out", "use algo=grpo for the whole group's mean")


def plan_rows(master: MasterConfig, train_world: int) -> list[tuple[str, str]]:
    """How the advantages are made."""
    k = master.grpo.num_generations_per_prompt
    return [("advantages", f"RLOO: each sample's reward minus the mean of its prompt's other {k - 1}, not "
                           "normalised")]
