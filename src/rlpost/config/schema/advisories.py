"""Run-health advisories (`logger.advisories`): the signs of a run that goes nowhere, each warned about once
(rlpost.algorithms.advisories)."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.fields import POSITIVE, POSITIVE_OR_NONE, Block, Rule, checked

SHARE = Rule(lambda v: 0 < v <= 1, "must be in (0, 1]", allow_none=True)


@dataclass
class AdvisoriesConfig(Block):
    """Thresholds of the advisories; None turns one off."""

    enabled: bool = True
    """Check each step: a rule that fires prints one `rlpost: warning:` line the first time and counts 1 under
    advisories/<rule> in that step's metrics (the report draws a band there)."""
    window: int = checked(10, POSITIVE)
    """Steps a condition must hold in a row before it fires, and steps of the run's own history a comparison needs
    first (so a run's first steps do not warn)."""
    zero_variance_share: float | None = checked(0.9, SHARE)
    """Share of prompt groups whose samples all got the same reward (no learning signal in GRPO's advantages)."""
    truncated_share: float | None = checked(0.25, SHARE)
    """Share of responses cut at max_new_tokens (runs that generate more than one token)."""
    prob_error_rise: float | None = checked(0.02, POSITIVE_OR_NONE)
    """Rise of train/token_mult_prob_error over its median of the run's first `window` steps (engine and trainer
    drifting apart)."""
    flat_reward_steps: int | None = checked(30, POSITIVE_OR_NONE)
    """Steps over which train/reward has moved by less than flat_reward_tolerance."""
    flat_reward_tolerance: float = checked(0.01, POSITIVE)
    """The reward's range (max - min) below which it counts as flat."""
    throughput_drop: float | None = checked(0.5, SHARE)
    """Generation or training tokens/s below this share of the run's median."""
    stall_factor: float | None = checked(5.0, POSITIVE_OR_NONE)
    """A step that takes this many times the run's median step (a worker or the engine waiting on the other)."""
