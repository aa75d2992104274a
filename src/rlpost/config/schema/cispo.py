"""CISPO's loss config (`loss=cispo`, placed at `loss_fn`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import require
from rlpost.config.fields import NON_NEGATIVE, checked
from rlpost.config.schema.loss import ClippedPGLossConfig


@dataclass
class CISPOLossConfig(ClippedPGLossConfig):
    """CISPO (MiniMax-M1): the importance-sampling weight sg(clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max)) times
    A log pi, so every token keeps its gradient (a clipped PPO ratio drops the tokens past the clip). The KL, IS
    correction and token- or sequence-level reduction are the clipped loss's."""

    _target_: str = "rlpost.losses.cispo.CISPOLossFn"
    """Loss class."""
    ratio_clip_min: float = 1.0
    """The weight's lower bound is 1 - this; 1 = no lower bound (MiniMax-M1 set none)."""
    ratio_clip_max: float = checked(4.0, NON_NEGATIVE)
    """The weight's upper bound is 1 + this (MiniMax-M1 tuned only this one)."""
    reference_policy_kl_penalty: float = checked(0.0, NON_NEGATIVE)
    """KL coefficient beta; 0 skips the reference-model pass."""

    def check(self, path: str) -> None:
        require(0.0 <= self.ratio_clip_min <= 1.0, f"{path}.ratio_clip_min", self.ratio_clip_min,
                "must be in [0, 1] (1: no lower bound on the IS weight)")
        for key in ("ratio_clip_c", "sequence_level_importance_ratios", "disable_ppo_ratio"):
            require(getattr(self, key) in (None, False), f"{path}.{key}", getattr(self, key),
                    "is the clipped PPO surrogate's; CISPO clips the importance-sampling weight instead",
                    "use loss=token_level for it")
        super().check(path)
