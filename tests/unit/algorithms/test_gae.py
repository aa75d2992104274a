"""PPO's advantages (rlpost.algorithms.gae) against plain-Python references, and the critic's clipped value loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algorithms.gae import explained_variance, gae, masked_whiten, token_rewards
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.value import ClippedValueLossFn


def _random_batch(seed: int, b: int = 12, s: int = 20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards [B, S], values [B, S] and a mask with variable prompt and response lengths, right padding, holes
    (a multi-turn episode's environment tokens) and one row with no response at all."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, s)
    for i in range(b - 1):
        start = int(torch.randint(1, s // 2, (1,), generator=g))
        end = int(torch.randint(start + 1, s + 1, (1,), generator=g))
        mask[i, start:end] = 1.0
        if end - start > 4 and i % 3 == 0:  # an environment turn inside the episode
            mask[i, start + 1 : start + 3] = 0.0
    rewards = torch.randn(b, s, generator=g) * mask
    values = torch.randn(b, s, generator=g)
    return rewards, values, mask


def _reference_gae(rewards: list[float], values: list[float], mask: list[float], gamma: float, lam: float
                   ) -> list[float]:
    """GAE in plain Python over the row's masked positions, in order."""
    steps = [t for t, m in enumerate(mask) if m > 0]
    adv = [0.0] * len(mask)
    running = 0.0
    for k in range(len(steps) - 1, -1, -1):
        t = steps[k]
        next_value = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_the_plain_python_reference(gamma: float, lam: float, seed: int) -> None:
    rewards, values, mask = _random_batch(seed)
    adv, returns = gae(rewards, values, mask, gamma, lam)
    for i in range(mask.shape[0]):
        ref = _reference_gae(rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam)
        assert adv[i].tolist() == pytest.approx(ref, abs=1e-6)
        expected_returns = [(a + v) * m for a, v, m in zip(ref, values[i].tolist(), mask[i].tolist(), strict=True)]
        assert returns[i].tolist() == pytest.approx(expected_returns, abs=1e-6)
    assert float(adv[-1].abs().sum()) == 0.0  # the row without a response


def test_gamma_one_lambda_one_is_the_return_minus_the_value() -> None:
    rewards, values, mask = _random_batch(5)
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    to_go = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])  # reward-to-go
    assert torch.allclose(adv, (to_go - values) * mask, atol=1e-5)


def test_token_rewards_put_the_reward_on_the_last_response_token_and_the_kl_on_every_one() -> None:
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    kl = torch.full((3, 6), 0.5)
    r = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl, kl_coef=0.1)
    assert r[0].tolist() == pytest.approx([0, -0.05, -0.05, 1 - 0.05, 0, 0])
    assert r[1].tolist() == pytest.approx([0, 0, -0.05, 0, 2 - 0.05, 0])  # the last model token, past the hole
    assert r[2].tolist() == [0.0] * 6
    assert token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask).sum() == 3.0


def test_whitening_is_global_whatever_the_ranks_and_micro_batches() -> None:
    """Advantages are whitened over the whole batch before it is sharded: every rank's micro-batches hold the
    whole-batch values, whose pieces together have mean 0 and variance 1; whitening per micro-batch would not."""
    rewards, values, mask = _random_batch(7, b=16)
    adv, _ = gae(rewards, values, mask, 0.99, 0.95)
    whitened = masked_whiten(adv, mask)
    data = BatchedDataDict(input_ids=torch.arange(16)[:, None].expand(16, 20).clone(), advantages=whitened,
                           token_mask=mask, sample_mask=torch.ones(16))
    pieces = []
    for dp in (1, 2, 4):
        for micro in (1, 2, 4):
            got = []
            for shard in data.shard_by_batch_size(dp):
                for mb in shard.make_microbatch_iterator(micro):
                    for row in range(mb.size):
                        i = int(mb["input_ids"][row, 0])
                        assert torch.equal(mb["advantages"][row], whitened[i])
                        got.append(mb["advantages"][row][mask[i] > 0])
            pieces.append(torch.cat(got))
    for p in pieces:
        assert float(p.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(p.var(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    per_micro = torch.cat([masked_whiten(adv[i:i + 4], mask[i:i + 4])[mask[i:i + 4] > 0] for i in range(0, 16, 4)])
    assert not torch.allclose(torch.sort(per_micro).values, torch.sort(pieces[0]).values, atol=1e-3)


def test_explained_variance() -> None:
    mask = torch.ones(2, 4)
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 0.0, 1.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 7.0), returns, mask) == pytest.approx(0.0, abs=1e-6)
    assert math.isnan(explained_variance(returns, torch.ones(2, 4), mask))


def _value_data(seed: int) -> tuple[torch.Tensor, BatchedDataDict]:
    g = torch.Generator().manual_seed(seed)
    b, s = 6, 8
    head = torch.randn(b, s, 1, generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    mask[:, 0] = 0
    data = BatchedDataDict(returns=torch.randn(b, s, generator=g), values=torch.randn(b, s, generator=g) * 0.3,
                           token_mask=mask, sample_mask=torch.tensor([1.0, 1, 1, 0, 1, 1]),
                           input_ids=torch.zeros(b, s, dtype=torch.long))
    return head, data


@pytest.mark.parametrize("clip", [None, 0.2])
def test_clipped_value_loss_equals_the_formula_and_sums_over_micro_batches(clip: float | None) -> None:
    head, data = _value_data(3)
    fn = ClippedValueLossFn(clip)
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    n = m.sum()
    loss, metrics = fn(head, data, torch.tensor(5.0), n)
    v, r, old = head[:, :-1, 0], data["returns"][:, 1:], data["values"][:, 1:]
    total, clipped_count = 0.0, 0
    for i in range(6):
        for t in range(7):
            if m[i, t] == 0:
                continue
            e = float(v[i, t] - r[i, t]) ** 2
            if clip is None:
                total += 0.5 * e
                continue
            vc = float(old[i, t]) + max(-clip, min(clip, float(v[i, t] - old[i, t])))
            ec = (vc - float(r[i, t])) ** 2
            total += 0.5 * max(e, ec)
            clipped_count += abs(float(v[i, t] - old[i, t])) > clip and ec > e
    assert float(loss) == pytest.approx(total / float(n), abs=1e-6)
    assert metrics["value_clip_fraction"] == pytest.approx(clipped_count / float(n), abs=1e-6)
    if clip is not None:
        assert clipped_count > 0
    parts = [fn(head[i:i + 2], data.slice(i, i + 2), torch.tensor(5.0), n)[0] for i in range(0, 6, 2)]
    assert float(sum(parts)) == pytest.approx(float(loss), abs=1e-6)
