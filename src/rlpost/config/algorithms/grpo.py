"""GRPO's rules across blocks (its block: rlpost.config.schema.grpo; its code: rlpost.algorithms.grpo)."""

from __future__ import annotations

from rlpost.config.errors import require
from rlpost.config.schema.master import MasterConfig


def group_rules(master: MasterConfig) -> None:
    """Group baselines compare a prompt's samples: at least two of each (GRPO's, and RLOO's leave-one-out)."""
    g = master.grpo
    require(g.num_generations_per_prompt >= 2, "grpo.num_generations_per_prompt", g.num_generations_per_prompt,
            "must be >= 2: the group baseline needs at least two samples per prompt")
