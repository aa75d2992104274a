"""PPO's advantages: token-level rewards, generalised advantage estimation (GAE), whitening, explained variance.

Every tensor is [B, S], aligned with input_ids like the logprobs (the value at position t is the critic's estimate
for the state that emits token t), and `mask` is 1 on the tokens the policy emitted (token_mask * sample_mask). GAE
runs backwards over each row's masked positions only: padding and, in a multi-turn episode, the environment's
tokens are skipped (the next model token's value and advantage carry over them).
"""

from __future__ import annotations

import torch


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """[B, S] rewards: the episode's reward [B] on each row's last masked token, minus kl_coef * kl [B, S] on every
    masked token. A row without a masked token gets no reward."""
    b, s = mask.shape
    out = torch.zeros(b, s, dtype=torch.float32)
    m = mask.float()
    positions = torch.arange(s)[None, :].expand(b, s)
    last = torch.where(m > 0, positions, -1).max(dim=1).values  # [B]
    has = last >= 0
    out[has, last[has]] = rewards.float()[has]
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * kl.float() * m
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, S] and 0 off the mask: A_t = sum_k (gamma*lam)^k delta_{t+k} over the row's
    masked positions, delta_t = r_t + gamma * V_next - V_t (V_next = 0 after the last), returns = A + V."""
    m = mask.float()
    r, v = rewards.float(), values.float()
    b, s = m.shape
    adv = torch.zeros(b, s)
    next_v = torch.zeros(b)
    next_a = torch.zeros(b)
    for t in range(s - 1, -1, -1):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(on, a, 0.0)
        next_v = torch.where(on, v[:, t], next_v)
        next_a = torch.where(on, a, next_a)
    return adv, (adv + v) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the whole tensor (population variance), 0 off the
    mask."""
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 for a perfect critic, 0 for a constant one (NaN when the
    returns do not vary)."""
    m = mask.float()
    n = m.sum().clamp(min=1.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return (((x - mean) * m) ** 2).sum() / n

    vr = var(returns.float())
    return float("nan") if float(vr) == 0.0 else float(1.0 - var(returns.float() - values.float()) / vr)
