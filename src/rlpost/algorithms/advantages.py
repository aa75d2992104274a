"""GRPO advantages: per-prompt baselines and stds, reward scaling and DAPO overlong shaping.

`calculate_baseline_and_std_per_prompt` groups samples by prompt (identical prompt rows, or a [B] group id) and
gives each the mean of its group's other valid rewards (leave-one-out) or of all of them, with the matching
unbiased std; a group with one valid sample gets advantage 0. `compute_advantages` is A = r - b, divided by
std + 1e-6 where std > 0 when normalising. `grpo_advantages`, `dr_grpo_advantages` (no std division) and
`rloo_advantages` (leave-one-out, no std) are the named variants. tests/unit/algorithms/test_advantages.py
holds the exact formulas and the comparison with NeMo RL.
"""

from __future__ import annotations

import torch

from rlpost.config.schema.grpo import RewardScalingConfig, RewardShapingConfig


def _group_ids(prompts: torch.Tensor) -> torch.Tensor:
    """[B] group index per sample from prompt rows [B, P] (identical rows = one group) or group ids [B]."""
    if prompts.ndim == 1:
        return torch.unique(prompts, return_inverse=True)[1]
    return torch.unique(prompts.reshape(prompts.shape[0], -1), dim=0, return_inverse=True)[1]


def calculate_baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline [B] and unbiased std [B] within prompt groups (see the module docstring)."""
    rewards_f = rewards.double()  # [B]
    valid = valid_mask.to(torch.float64)  # [B]
    groups = _group_ids(prompts.to(rewards.device))  # [B]
    baseline = torch.zeros_like(rewards_f)
    std = torch.zeros_like(rewards_f)
    for g in torch.unique(groups).tolist():
        idx = (groups == g).nonzero(as_tuple=True)[0]  # [n_g]
        r = rewards_f[idx]  # [n_g]
        v = valid[idx]  # [n_g]
        if v.sum() <= 1:
            baseline[idx] = r
            continue
        # others[i, j] = 1 if sample j counts towards sample i's baseline
        others = v.unsqueeze(0).expand(len(idx), -1).clone()  # [n_g, n_g]
        if leave_one_out:
            others = others * (1.0 - torch.eye(len(idx), dtype=others.dtype, device=others.device) * v.unsqueeze(1))
        # An invalid sample of the group leaves nothing out: it gets the baseline of all valid samples.
        count = others.sum(dim=1)  # [n_g]
        b = (others @ r) / count  # [n_g]
        # Two-pass variance around each baseline: exactly 0 for a zero-variance group, where the one-pass
        # form leaves a residue the 1e-6 division would blow up.
        sq_dev = others * (r.unsqueeze(0) - b.unsqueeze(1)).square()  # [n_g, n_g]
        var = torch.where(count > 1, sq_dev.sum(dim=1) / (count - 1).clamp(min=1), torch.zeros_like(b))
        baseline[idx] = b
        std[idx] = var.clamp(min=0).sqrt().nan_to_num(0.0)
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


def compute_advantages(
    rewards: torch.Tensor, baseline: torch.Tensor, std: torch.Tensor, normalize: bool = True
) -> torch.Tensor:
    """A = r - b, divided by (std + 1e-6) where std > 0 when normalize. [B] -> [B]."""
    adv = rewards - baseline
    if normalize:
        nonzero = std > 0
        adv = torch.where(nonzero, adv / (std + 1e-6), adv)
    return adv


def grpo_advantages(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    leave_one_out: bool = True,
    normalize: bool = True,
) -> torch.Tensor:
    """GRPO advantages [B]: group baseline (leave-one-out by default) and std normalisation where std > 0."""
    valid_mask = torch.ones_like(rewards) if valid_mask is None else valid_mask
    baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, valid_mask, leave_one_out)
    return compute_advantages(rewards, baseline, std, normalize)


def dr_grpo_advantages(
    prompts: torch.Tensor, rewards: torch.Tensor, valid_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Dr. GRPO advantages [B]: r - group mean, no division by the std."""
    return grpo_advantages(prompts, rewards, valid_mask, leave_one_out=False, normalize=False)


def rloo_advantages(
    prompts: torch.Tensor, rewards: torch.Tensor, valid_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """RLOO advantages [B]: r - mean of the other samples of the group, no division by the std."""
    return grpo_advantages(prompts, rewards, valid_mask, leave_one_out=True, normalize=False)


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Clamp to [source_min, source_max], map affinely onto [target_min, target_max] (identity if disabled)."""
    if not cfg.enabled:
        return rewards
    if cfg.source_max <= cfg.source_min:
        raise ValueError(f"reward_scaling needs source_max > source_min, got {cfg.source_min}, {cfg.source_max}")
    clamped = rewards.clamp(cfg.source_min, cfg.source_max)
    unit = (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min)
    return cfg.target_min + unit * (cfg.target_max - cfg.target_min)


def apply_overlong_reward_shaping(
    rewards: torch.Tensor, response_lengths: torch.Tensor, cfg: RewardShapingConfig
) -> torch.Tensor:
    """DAPO soft overlong penalty: r + min(-(len - (max_len - buffer)) / buffer * penalty, 0). [B] -> [B]."""
    if not cfg.enabled:
        return rewards
    if cfg.overlong_buffer_length <= 0:
        raise ValueError(f"overlong_buffer_length must be > 0, got {cfg.overlong_buffer_length}")
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    exceed = response_lengths.to(rewards.dtype) - expected
    penalty = (-exceed / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty).clamp(max=0.0)
    return rewards + penalty
