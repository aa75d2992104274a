"""Loss configs, placed at `loss_fn` (`loss=token_level|sequence_level|nll`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config.errors import ConfigError, require
from rlpost.config.fields import NON_NEGATIVE, POSITIVE, Block, checked, options, within


@dataclass
class LossConfig(Block):
    """Base of every loss config: the loss class to build."""

    _target_: str = "rlpost.losses.clipped_pg.ClippedPGLossFn"
    """Loss class, built by rlpost.runtime.build with this config."""


@dataclass
class ClippedPGLossConfig(LossConfig):
    """PPO-style clipped policy-gradient loss with KL penalty (NeMo RL ClippedPGLossConfig)."""

    reference_policy_kl_penalty: float = checked(0.01, NON_NEGATIVE)
    """KL coefficient beta; 0 skips the reference-model pass."""
    reference_policy_kl_type: str = checked("k3", options("k1", "k2", "k3"))
    """KL estimator: 'k1', 'k2' or 'k3' (Schulman 2020)."""
    kl_input_clamp_value: float = checked(20.0, POSITIVE)
    """Clamp on log(pi_ref/pi) before the estimator."""
    kl_output_clamp_value: float = checked(10.0, POSITIVE)
    """Clamp on the per-token KL value."""
    ratio_clip_min: float = checked(0.2, within("[0, 1)"))
    """epsilon_low: the ratio is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = checked(0.2, NON_NEGATIVE)
    """epsilon_high: the ratio is clipped above at 1 + ratio_clip_max (DAPO clip-higher when larger)."""
    ratio_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None = off."""
    use_on_policy_kl_approximation: bool = False
    """Weight the KL by pi/pi_gen so it estimates the on-policy KL."""
    use_importance_sampling_correction: bool = False
    """Correct the train/inference mismatch with exp(lp_prev - lp_gen) weights."""
    truncated_importance_sampling_ratio: float | None = None
    """Cap on the IS weights (TIS); requires use_importance_sampling_correction."""
    token_level_loss: bool = True
    """True: mean over all valid tokens of the global batch; False: per-sequence mean, then mean over sequences."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, exp(mean token log-ratio); requires token_level_loss=false."""
    disable_ppo_ratio: bool = False
    """REINFORCE/RLOO: use -A * logprob instead of the clipped ratio."""
    force_on_policy_ratio: bool = False
    """rho = exp(lp - sg(lp)) = 1 and no prev-logprobs forward pass. Automatic (and exact) when the
    rollout batch is one optimizer step; set it to force the approximation with several steps."""
    distillation_kl_coef: float = checked(0.0, NON_NEGATIVE)
    """Add this times the reverse KL to a teacher on its top-k tokens (rlpost.losses.distillation) to the
    loss; needs a teacher (`distillation=teacher distillation.teacher.model_path=...`). 0 = none."""

    def check(self, path: str) -> None:
        super().check(path)
        if self.ratio_clip_c is not None:
            require(self.ratio_clip_c > 1, f"{path}.ratio_clip_c", self.ratio_clip_c, "dual clip needs c > 1")
        if self.truncated_importance_sampling_ratio is not None:
            POSITIVE(f"{path}.truncated_importance_sampling_ratio", self.truncated_importance_sampling_ratio)
            require(
                self.use_importance_sampling_correction,
                f"{path}.truncated_importance_sampling_ratio",
                self.truncated_importance_sampling_ratio,
                "truncated IS requires use_importance_sampling_correction=true",
            )
        if self.sequence_level_importance_ratios:
            require(
                not self.token_level_loss,
                f"{path}.sequence_level_importance_ratios",
                self.sequence_level_importance_ratios,
                "sequence-level importance ratios (GSPO) require token_level_loss=false",
            )
        if self.disable_ppo_ratio and self.sequence_level_importance_ratios:
            raise ConfigError(
                f"{path}.disable_ppo_ratio",
                True,
                "disable_ppo_ratio cannot be combined with sequence_level_importance_ratios",
            )


@dataclass
class DistillationLossConfig(LossConfig):
    """On-policy distillation's loss (`loss=distillation`, algo=distillation): the per-token KL between the student
    and the teacher on the teacher's top-k tokens (NeMo RL's DistillationLossFn names)."""

    _target_: str = "rlpost.losses.distillation.DistillationLossFn"
    """Loss class."""
    kl_type: str = checked("reverse", options("reverse", "forward", "mixed"))
    """'reverse' (KL(student || teacher), on-policy distillation's), 'forward' or 'mixed'."""
    mixed_kl_weight: float = checked(0.5, within("[0, 1]"))
    """With kl_type=mixed: the forward KL's weight (the reverse KL's is 1 - this)."""


@dataclass
class NLLLossConfig(LossConfig):
    """Token-level negative log-likelihood (SFT)."""

    _target_: str = "rlpost.losses.clipped_pg.NLLLoss"
    """Loss class."""


@dataclass
class DPOLossConfig(LossConfig):
    """NeMo RL's DPO loss (`loss=dpo`, algo=dpo): w_p * -log sigmoid(beta * (r_chosen - r_rejected)) + w_s * NLL of
    the chosen response, with the implicit reward r = sum (or mean) over response tokens of (lp - lp_ref)."""

    _target_: str = "rlpost.losses.preference.DPOLossFn"
    """Loss class."""
    reference_policy_kl_penalty: float = checked(0.05, POSITIVE)
    """beta: the strength of the implicit KL to the reference policy."""
    preference_loss_weight: float = checked(1.0, NON_NEGATIVE)
    """w_p: weight of the preference term."""
    sft_loss_weight: float = checked(0.0, NON_NEGATIVE)
    """w_s: weight of the NLL of the chosen responses."""
    preference_average_log_probs: bool = False
    """Implicit reward from the mean instead of the sum of the response's token log-ratios."""
    sft_average_log_probs: bool = False
    """SFT term from the mean instead of the sum of the chosen response's token logprobs."""

    def check(self, path: str) -> None:
        super().check(path)
        require(self.preference_loss_weight + self.sft_loss_weight > 0, f"{path}.preference_loss_weight",
                self.preference_loss_weight, "preference_loss_weight and sft_loss_weight cannot both be 0")


@dataclass
class PreferenceLossConfig(LossConfig):
    """Bradley-Terry loss of a reward model (`loss=preference`, algo=rm): -log sigmoid(s_chosen - s_rejected)."""

    _target_: str = "rlpost.losses.preference.PreferenceLoss"
    """Loss class."""
