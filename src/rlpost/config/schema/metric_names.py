"""The metrics a training step logs, by name: what `checkpointing.metric_name` may rank checkpoints by."""

from __future__ import annotations

# What a GRPO step logs (rlpost.algorithms.grpo: `validate` as validation/*, `_step_metrics` and the
# rollout's reward counters as train/*), i.e. the names `checkpointing.metric_name` may rank by.
VAL_METRICS: tuple[str, ...] = ("accuracy", "avg_length", "reward")
TRAIN_STEP_METRICS: tuple[str, ...] = (
    "reward",
    "reward_timeouts",
    "reward_errors",
    "reward_unfinished",
    "loss",
    "grad_norm",
    "lr",
    "params_finite",
    "mean_gen_length",
    "mean_prompt_length",
    "total_num_tokens",
    "advantages/mean",
    "advantages/max",
    "advantages/min",
    "num_too_long_prompts",
    "truncated_fraction",
    "zero_variance_groups",
    "filtered_reward",
    "valid_response_tokens",
)
DYNAMIC_SAMPLING_METRICS: tuple[str, ...] = (
    "dynamic_sampling_num_discarded_valid_samples",
    "dynamic_sampling_num_gen_batches",
)
# Metrics each built-in loss returns (rlpost.losses.clipped_pg), logged as train/<name>.
LOSS_METRICS: dict[str, tuple[str, ...]] = {
    "rlpost.losses.clipped_pg.ClippedPGLossFn": (
        "loss",
        "probs_ratio",
        "probs_ratio_clamped",
        "kl_penalty",
        "token_mult_prob_error",
        "gen_kl_error",
        "policy_kl_error",
        "js_divergence_error",
        "sampling_importance_ratio",
        "num_valid_samples",
        "approx_entropy",
    ),
    "rlpost.losses.clipped_pg.NLLLoss": ("loss", "token_accuracy", "num_unmasked_tokens", "num_valid_samples"),
    "rlpost.losses.preference.DPOLossFn": ("loss", "preference_loss", "sft_loss", "kl_to_reference", "accuracy",
                                           "rewards_chosen_mean", "rewards_rejected_mean", "reward_margin",
                                           "num_valid_samples"),
    "rlpost.losses.preference.PreferenceLoss": ("loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean",
                                                "reward_margin", "num_valid_samples"),
}
SUPERVISED_TRAIN_METRICS: tuple[str, ...] = ("grad_norm", "lr", "num_tokens", "params_finite")
"""What an SFT / DPO / RM step logs besides its loss's metrics (train/<name>)."""
SUPERVISED_VAL_DROPPED: tuple[str, ...] = ("num_valid_samples", "num_unmasked_tokens")
"""Loss metrics validation does not log (counts, not means)."""


def grpo_metrics(loss_target: str, validates: bool, dynamic_sampling: bool) -> list[str] | None:
    """'val:x' / 'train:x' names a GRPO step logs; None when a custom loss makes the train metrics unknown."""
    loss = LOSS_METRICS.get(loss_target)
    if loss is None:
        return None
    val = [f"val:{m}" for m in VAL_METRICS] if validates else []
    train = list(TRAIN_STEP_METRICS) + [m for m in loss if m not in TRAIN_STEP_METRICS]
    if dynamic_sampling:
        train += DYNAMIC_SAMPLING_METRICS
    return val + [f"train:{m}" for m in train]


def supervised_metrics(loss_target: str, validates: bool) -> list[str] | None:
    """'val:x' / 'train:x' names an SFT / DPO / RM step logs; None for a custom loss."""
    loss = LOSS_METRICS.get(loss_target)
    if loss is None:
        return None
    val = [f"val:{m}" for m in loss if m not in SUPERVISED_VAL_DROPPED] if validates else []
    return val + [f"train:{m}" for m in (*loss, *SUPERVISED_TRAIN_METRICS)]
