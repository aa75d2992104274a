"""GRPO advantages: per-prompt baselines and stds, reward scaling and DAPO overlong shaping.

`calculate_baseline_and_std_per_prompt` groups samples by prompt (identical prompt rows, or a [B] group id) and
gives each the mean of its group's other valid rewards (leave-one-out) or of all of them, with the matching
unbiased std; a group with one valid sample gets advantage 0. `compute_advantages` is A = r - b, divided by
std + 1e-6 where std > 0 when normalising. `grpo_advantages` and
`rloo_advantages` (leave-one-out, no std) are the named variants. tests/unit/algorithms/test_advantages.py
holds the exact formulas and the comparison with NeMo RL.
"""

from __future__ import annotations

import numpy as np
import torch

from rlpost.config.schema.grpo import RewardScalingConfig, RewardShapingConfig


def _group_ids(prompts: torch.Tensor) -> np.ndarray:
    """[B] group index per sample from prompt rows [B, P] (identical rows = one group) or group ids [B]."""
    rows = prompts.detach().cpu().numpy()
    if rows.ndim == 1:
        return np.unique(rows, return_inverse=True)[1].reshape(-1)
    return np.unique(rows.reshape(rows.shape[0], -1), axis=0, return_inverse=True)[1].reshape(-1)


def _padded_groups(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For [B] group indices: [G, n] sample indices of each group, padded with 0, and the [G, n] mask of real
    entries (n: the largest group). Members keep their order in the batch."""
    order = np.argsort(groups, kind="stable")
    sizes = np.bincount(groups)
    sizes = sizes[sizes > 0]
    starts = np.cumsum(sizes) - sizes
    width = int(sizes.max()) if sizes.size else 0
    pos = np.arange(width)[None, :]  # [1, n]
    real = pos < sizes[:, None]  # [G, n]
    index = np.where(real, order[np.minimum(starts[:, None] + pos, len(order) - 1)], 0)
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
    if rewards.numel() == 0:
        return rewards.clone(), torch.zeros_like(rewards)
    # In numpy: a step's baselines are a few dozen operations on [G, n, n] arrays of a few hundred numbers, and a
    # numpy operation costs a fraction of a torch one's dispatch, which would dominate on arrays this small.
    rewards_f = rewards.detach().to("cpu", torch.float64).numpy()  # [B]
    valid = valid_mask.detach().to("cpu", torch.float64).numpy()  # [B]
    index, real = _padded_groups(_group_ids(prompts))
    r = np.where(real, rewards_f[index], 0.0)  # [G, n] (where, not a product: a NaN reward stays in its group)
    v = np.where(real, valid[index], 0.0)  # [G, n]
    n = r.shape[1]
    # others[g, i, j] = 1 if sample j counts towards sample i's baseline (group g)
    others = np.repeat(v[:, None, :], n, axis=1)  # [G, n, n]
    if leave_one_out:
        others = others * (1.0 - np.eye(n)[None] * v[:, :, None])
    # An invalid sample of the group leaves nothing out: it gets the baseline of all valid samples.
    count = others.sum(axis=2)  # [G, n]
    b = (others @ r[:, :, None])[:, :, 0] / np.maximum(count, 1.0)  # [G, n]
    # Two-pass variance around each baseline: exactly 0 for a zero-variance group, where the one-pass
    # form leaves a residue the 1e-6 division would blow up.
    with np.errstate(invalid="ignore"):  # NaN rewards stay NaN (their group's std is then 0, below)
        sq_dev = others * np.square(r[:, None, :] - b[:, :, None])  # [G, n, n]
        var = np.where(count > 1, sq_dev.sum(axis=2) / np.maximum(count - 1, 1.0), 0.0)
        std = np.nan_to_num(np.sqrt(np.maximum(var, 0.0)), nan=0.0)
    # A group with at most one valid sample: the baseline is the reward itself (advantage 0), std 0.
    lone = (v.sum(axis=1) <= 1)[:, None]  # [G, 1]
    b = np.where(lone, r, b)
    std = np.where(lone, 0.0, std)
    baseline = np.zeros_like(rewards_f)
    out_std = np.zeros_like(rewards_f)
    baseline[index[real]] = b[real]
    out_std[index[real]] = std[real]
    return (torch.from_numpy(baseline).to(device=rewards.device, dtype=rewards.dtype),
            torch.from_numpy(out_std).to(device=rewards.device, dtype=rewards.dtype))


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
