"""CISPO (MiniMax-M1, 2025): a policy gradient whose importance-sampling weight is clipped and held constant.

Per token, loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi with r = pi / pi_old. The clipped PPO
surrogate takes no gradient from a token whose ratio left the clip range; here every token keeps its gradient,
-w A grad log pi, and the clip only bounds its weight w. KL, train/inference IS correction and the reduction over
the batch are ClippedPGLossFn's. tests/unit/losses/test_cispo.py checks it against a plain-Python reference.
"""

from __future__ import annotations

import torch

from rlpost.config.schema.cispo import CISPOLossConfig
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.losses.clipped_pg import ClippedPGLossFn


class CISPOLossFn(ClippedPGLossFn):
    """ClippedPGLossFn with CISPO's surrogate."""

    config_class: type[ClippedPGLossConfig] = CISPOLossConfig

    def surrogate(self, lp: torch.Tensor, lp_old: torch.Tensor, adv: torch.Tensor,
                  token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-sg(w) A lp per token [B, S-1], w the ratio clipped to [1 - ratio_clip_min, 1 + ratio_clip_max]; with the
        ratio and w for the metrics."""
        ratios = torch.exp(lp - lp_old)
        weight = ratios.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max).detach()
        return -adv * weight * lp, ratios, weight
