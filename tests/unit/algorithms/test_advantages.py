"""Group baselines / stds, advantages, reward scaling and overlong shaping against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algorithms.advantages import (
    apply_overlong_reward_shaping,
    calculate_baseline_and_std_per_prompt,
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
    scale_rewards,
)
from rlpost.config.schema.grpo import RewardScalingConfig, RewardShapingConfig

T = lambda *x: torch.tensor(x, dtype=torch.float32)  # noqa: E731


def close(a: torch.Tensor, b: list[float], tol: float = 1e-6) -> None:
    assert a.tolist() == pytest.approx(b, abs=tol)


def test_leave_one_out_baseline_and_std() -> None:
    # prompts given as token rows, groups interleaved: rows 0,2,4,6 = prompt A ; 1,3,5 = prompt B
    prompts = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [1, 2], [3, 4], [1, 2]])
    rewards = T(1, 2, 0, 2, 1, 2, 0)
    b, s = calculate_baseline_and_std_per_prompt(prompts, rewards, torch.ones(7), leave_one_out=True)
    # A: sample with r=1 sees others [0,1,0] -> b=1/3, unbiased var = ((1/3)^2*2 + (2/3)^2)/2 = 1/3
    #    sample with r=0 sees others [1,0,1] -> b=2/3, var = 1/3 ; B: all 2 -> b=2, std 0
    close(b, [1 / 3, 2, 2 / 3, 2, 1 / 3, 2, 2 / 3])
    r3 = math.sqrt(1 / 3)
    close(s, [r3, 0, r3, 0, r3, 0, r3])
    adv = compute_advantages(rewards, b, s, normalize=True)
    close(adv, [(2 / 3) / (r3 + 1e-6), 0, (-2 / 3) / (r3 + 1e-6), 0, (2 / 3) / (r3 + 1e-6), 0, (-2 / 3) / (r3 + 1e-6)])
    assert torch.all(adv[[1, 3, 5]] == 0)  # zero-variance group: exactly 0


def test_plain_mean_and_unbiased_std() -> None:
    groups = torch.tensor([0, 0, 0, 0])
    b, s = calculate_baseline_and_std_per_prompt(groups, T(1, 0, 1, 0), torch.ones(4), leave_one_out=False)
    close(b, [0.5] * 4)
    close(s, [math.sqrt(1 / 3)] * 4)  # sum of squared deviations 1, / (n - 1)


def test_zero_variance_group_is_exactly_zero() -> None:
    rewards = T(0.7, 0.7, 0.7, 0.7)
    for loo in (True, False):
        b, s = calculate_baseline_and_std_per_prompt(torch.zeros(4), rewards, torch.ones(4), leave_one_out=loo)
        assert torch.all(s == 0)
        assert torch.all(compute_advantages(rewards, b, s, normalize=True) == 0)


def test_single_sample_group_and_pairs() -> None:
    groups = torch.tensor([0, 1, 1])
    rewards = T(5.0, 1.0, 0.0)
    b, s = calculate_baseline_and_std_per_prompt(groups, rewards, torch.ones(3), leave_one_out=True)
    # single sample: baseline = reward, std 0 ; pair with LOO: the other sample, std 0 (n - 2 = 0)
    close(b, [5.0, 0.0, 1.0])
    close(s, [0.0, 0.0, 0.0])
    close(compute_advantages(rewards, b, s, normalize=True), [0.0, 1.0, -1.0])
    b2, s2 = calculate_baseline_and_std_per_prompt(groups, rewards, torch.ones(3), leave_one_out=False)
    close(b2, [5.0, 0.5, 0.5])
    close(s2, [0.0, math.sqrt(0.5), math.sqrt(0.5)])
    close(
        compute_advantages(rewards, b2, s2, normalize=True),
        [0.0, 0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)],
    )


def test_valid_mask() -> None:
    groups = torch.tensor([0, 0, 0, 1, 1])
    rewards = T(1.0, 0.0, 3.0, 2.0, 4.0)
    valid = T(1, 1, 0, 1, 0)
    b, s = calculate_baseline_and_std_per_prompt(groups, rewards, valid, leave_one_out=True)
    # group 0: valid {1, 0}: b_0 = 0, b_1 = 1 ; invalid sample 2 sees both valid -> 0.5, std sqrt(0.5)
    # group 1: one valid sample -> baseline = reward for all, std 0
    close(b, [0.0, 1.0, 0.5, 2.0, 4.0])
    close(s, [0.0, 0.0, math.sqrt(0.5), 0.0, 0.0])
    b2, _ = calculate_baseline_and_std_per_prompt(groups, rewards, valid, leave_one_out=False)
    close(b2, [0.5, 0.5, 0.5, 2.0, 4.0])


def test_variants() -> None:
    groups = torch.tensor([0, 0, 0])
    rewards = T(3.0, 0.0, 0.0)
    close(grpo_advantages(groups, rewards, leave_one_out=False, normalize=False), [2.0, -1.0, -1.0])  # Dr. GRPO
    close(rloo_advantages(groups, rewards), [3.0, -1.5, -1.5])  # r - mean of the others
    # GRPO default: LOO baseline / LOO std. sample 0: others [0, 0] -> std 0 -> not divided
    # samples 1, 2: others [3, 0] -> b = 1.5, std = sqrt(4.5)
    close(grpo_advantages(groups, rewards), [3.0, -1.5 / (math.sqrt(4.5) + 1e-6), -1.5 / (math.sqrt(4.5) + 1e-6)])
    close(compute_advantages(rewards, T(1, 1, 1), T(2, 0, 2), normalize=False), [2.0, -1.0, -1.0])


def test_scale_rewards() -> None:
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    close(scale_rewards(T(-0.5, 0.25, 2.0), cfg), [-1.0, -0.5, 1.0])
    cfg2 = RewardScalingConfig(enabled=True, source_min=-2.0, source_max=2.0, target_min=0.0, target_max=10.0)
    close(scale_rewards(T(-2.0, 0.0, 1.0), cfg2), [0.0, 5.0, 7.5])
    close(scale_rewards(T(-0.5, 2.0), RewardScalingConfig(enabled=False)), [-0.5, 2.0])


def test_overlong_reward_shaping() -> None:
    cfg = RewardShapingConfig(
        enabled=True, overlong_buffer_length=20, overlong_buffer_penalty=1.0, max_response_length=100
    )
    rewards = T(1.0, 1.0, 1.0, 1.0, 0.0)
    lengths = torch.tensor([50, 80, 90, 100, 110])
    # expected length 80: exceed -30, 0, 10, 20, 30 -> penalty 0, 0, -0.5, -1, -1.5
    close(apply_overlong_reward_shaping(rewards, lengths, cfg), [1.0, 1.0, 0.5, 0.0, -1.5])
    cfg2 = RewardShapingConfig(
        enabled=True, overlong_buffer_length=10, overlong_buffer_penalty=0.5, max_response_length=40
    )
    close(apply_overlong_reward_shaping(T(0.0), torch.tensor([35]), cfg2), [-0.25])
    close(apply_overlong_reward_shaping(rewards, lengths, RewardShapingConfig(enabled=False)), rewards.tolist())


def _per_group_reference(groups: torch.Tensor, rewards: torch.Tensor, valid: torch.Tensor, loo: bool
                         ) -> tuple[list[float], list[float]]:
    """The definition, one group and one sample at a time (float64)."""
    base, std = [0.0] * len(rewards), [0.0] * len(rewards)
    for i in range(len(rewards)):
        members = [j for j in range(len(rewards)) if groups[j] == groups[i]]
        if sum(float(valid[j]) for j in members) <= 1:
            base[i] = float(rewards[i])
            continue
        counted = [j for j in members if valid[j] and not (loo and j == i and valid[i])]
        b = sum(float(rewards[j]) for j in counted) / len(counted)
        base[i] = b
        if len(counted) > 1:
            std[i] = math.sqrt(sum((float(rewards[j]) - b) ** 2 for j in counted) / (len(counted) - 1))
    return base, std


@pytest.mark.parametrize("loo", [True, False])
def test_all_groups_at_once_match_the_per_group_definition(loo: bool) -> None:
    # unequal, interleaved groups; some with no or one valid sample; repeated rewards (zero-variance groups)
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        groups = torch.randint(0, 7, (n,), generator=gen) * 11  # sparse ids
        rewards = torch.randint(0, 3, (n,), generator=gen).double() if trial % 2 else torch.rand(n, generator=gen).double()
        valid = (torch.rand(n, generator=gen) > 0.25).double()
        b, s = calculate_baseline_and_std_per_prompt(groups, rewards, valid, leave_one_out=loo)
        rb, rs = _per_group_reference(groups, rewards, valid, loo)
        assert b.tolist() == pytest.approx(rb, abs=1e-12)
        assert s.tolist() == pytest.approx(rs, abs=1e-12)


def test_a_nan_reward_stays_in_its_own_group() -> None:
    groups = torch.tensor([0, 0, 0, 1, 1])  # unequal sizes: group 1 is padded in the batched layout
    b, s = calculate_baseline_and_std_per_prompt(groups, T(float("nan"), 1, 0, 1, 0), torch.ones(5))
    assert b[:3].isnan().any()  # group 0's own business, as before
    close(b[3:], [0, 1])
    close(s[3:], [0, 0])


def test_no_samples_give_empty_baselines() -> None:
    b, s = calculate_baseline_and_std_per_prompt(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0))
    assert b.shape == (0,) and s.shape == (0,)
