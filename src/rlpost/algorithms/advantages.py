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


def _padded_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For [B] group indices: [G, n] sample indices of each group, padded with 0, and the [G, n] mask of real
    entries (n: the largest group). Members keep their order in the batch."""
    order = torch.argsort(groups, stable=True)
    sizes = torch.bincount(groups)
    sizes = sizes[sizes > 0]
    starts = torch.cumsum(sizes, 0) - sizes
    width = int(sizes.max()) if sizes.numel() else 0
    pos = torch.arange(width).unsqueeze(0)  # [1, n]
    real = pos < sizes.unsqueeze(1)  # [G, n]
    index = torch.where(real, order[(starts.unsqueeze(1) + pos).clamp(max=len(order) - 1)], 0)
    return index, real


def calculate_baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline [B] and unbiased std [B] within prompt groups (see the module docstring).

    All groups at once: each group's rewards and validity are laid out as a row of a [G, n] matrix (n: the largest
    group; padding counts as an invalid sample and is dropped at the end), so a step's many groups cost a few batched
    operations instead of a Python loop over them."""
    rewards_f = rewards.double()  # [B]
    valid = valid_mask.to(device=rewards.device, dtype=torch.float64)  # [B]
    if rewards_f.numel() == 0:
        return rewards.clone(), torch.zeros_like(rewards)
    groups = _group_ids(prompts.to(rewards.device))  # [B]
    index, real = _padded_groups(groups.cpu())
    index, real = index.to(rewards.device), real.to(rewards.device)
    r = torch.where(real, rewards_f[index], 0.0)  # [G, n] (where, not a product: a NaN reward stays in its group)
    v = torch.where(real, valid[index], 0.0)  # [G, n]
    n = r.shape[1]
    # others[g, i, j] = 1 if sample j counts towards sample i's baseline (group g)
    others = v.unsqueeze(1).expand(-1, n, -1).clone()  # [G, n, n]
    if leave_one_out:
        eye = torch.eye(n, dtype=others.dtype, device=others.device)
        others = others * (1.0 - eye.unsqueeze(0) * v.unsqueeze(2))
    # An invalid sample of the group leaves nothing out: it gets the baseline of all valid samples.
    count = others.sum(dim=2)  # [G, n]
    b = (others @ r.unsqueeze(2)).squeeze(2) / count.clamp(min=1)  # [G, n]
    # Two-pass variance around each baseline: exactly 0 for a zero-variance group, where the one-pass
    # form leaves a residue the 1e-6 division would blow up.
    sq_dev = others * (r.unsqueeze(1) - b.unsqueeze(2)).square()  # [G, n, n]
    var = torch.where(count > 1, sq_dev.sum(dim=2) / (count - 1).clamp(min=1), torch.zeros_like(b))
    std = var.clamp(min=0).sqrt().nan_to_num(0.0)
    # A group with at most one valid sample: the baseline is the reward itself (advantage 0), std 0.
    lone = (v.sum(dim=1) <= 1).unsqueeze(1)  # [G, 1]
    b = torch.where(lone, r, b)
    std = torch.where(lone, torch.zeros_like(std), std)
    baseline = torch.zeros_like(rewards_f)
    out_std = torch.zeros_like(rewards_f)
    baseline[index[real]] = b[real]
    out_std[index[real]] = std[real]
    return baseline.to(rewards.dtype), out_std.to(rewards.dtype)


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
