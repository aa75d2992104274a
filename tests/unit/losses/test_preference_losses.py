"""DPO and Bradley-Terry losses against independent per-pair formulas, and NLL's token accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.config.schema.loss import DPOLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.clipped_pg import NLLLoss
from rlpost.losses.preference import DPOLossFn, PreferenceLoss

B, S, V = 6, 7, 11  # three pairs


def _batch(seed: int = 0) -> tuple[torch.Tensor, BatchedDataDict]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, S), generator=g)
    token_mask = torch.zeros(B, S)
    for i in range(B):  # a prompt of 2-3 tokens, then 2-4 response tokens
        start = 2 + i % 2
        token_mask[i, start : start + 2 + i % 3] = 1.0
    ref = torch.log_softmax(torch.randn(B, S, V, generator=g, dtype=torch.float64), -1)
    ref_lp = torch.zeros(B, S, dtype=torch.float64)
    ref_lp[:, 1:] = ref[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    data = BatchedDataDict(input_ids=ids, token_mask=token_mask, sample_mask=torch.tensor([1.0, 1, 1, 1, 0, 0]),
                           reference_policy_logprobs=ref_lp)
    return logits, data


def _reference_dpo(logits: torch.Tensor, data: BatchedDataDict, c: DPOLossConfig) -> tuple[float, float]:
    """(loss, accuracy), written pair by pair from the DPO paper and NeMo RL's option definitions."""
    lp_all = torch.log_softmax(logits, -1)
    pref_sum = sft_sum = correct = 0.0
    pairs = 0
    for k in range(B // 2):
        if data["sample_mask"][2 * k] == 0:
            continue
        pairs += 1
        r = []
        for i in (2 * k, 2 * k + 1):
            tot, n = 0.0, 0
            nll = 0.0
            for t in range(1, S):
                if data["token_mask"][i, t]:
                    lp = float(lp_all[i, t - 1, data["input_ids"][i, t]])
                    tot += lp - float(data["reference_policy_logprobs"][i, t])
                    nll -= lp
                    n += 1
            r.append(c.reference_policy_kl_penalty * (tot / n if c.preference_average_log_probs else tot))
            if i == 2 * k:
                sft_sum += nll / n if c.sft_average_log_probs else nll
        margin = r[0] - r[1]
        pref_sum += -math.log(1 / (1 + math.exp(-margin)))
        correct += margin > 0
    loss = c.preference_loss_weight * pref_sum / pairs + c.sft_loss_weight * sft_sum / pairs
    return loss, correct / pairs


@pytest.mark.parametrize("avg_pref,avg_sft,w_sft", [(False, False, 0.0), (True, False, 0.5), (False, True, 1.0),
                                                    (True, True, 0.2)])
def test_dpo_loss_equals_the_pairwise_formula(avg_pref: bool, avg_sft: bool, w_sft: float) -> None:
    c = DPOLossConfig(reference_policy_kl_penalty=0.3, preference_loss_weight=0.7, sft_loss_weight=w_sft,
                      preference_average_log_probs=avg_pref, sft_average_log_probs=avg_sft)
    logits, data = _batch()
    gs = data["sample_mask"].sum()
    loss, metrics = DPOLossFn(c)(logits, data, gs, torch.tensor(0.0))
    want, acc = _reference_dpo(logits, data, c)
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(acc, abs=1e-9)


def test_dpo_micro_batches_sum_to_the_global_loss_and_gradient() -> None:
    """Globally normalised: two micro-batches of whole pairs add up to the one-batch loss and gradient."""
    c = DPOLossConfig(reference_policy_kl_penalty=0.2, sft_loss_weight=0.3)
    logits, data = _batch(1)
    data["sample_mask"] = torch.ones(B)
    gs = torch.tensor(float(B))
    fn = DPOLossFn(c)
    full = logits.clone().requires_grad_(True)
    loss, _ = fn(full, data, gs, torch.tensor(0.0))
    loss.backward()
    parts = logits.clone().requires_grad_(True)
    total = sum(fn(parts[a:b], data.slice(a, b), gs, torch.tensor(0.0))[0] for a, b in ((0, 2), (2, 6)))
    total.backward()
    assert float(total) == pytest.approx(float(loss), abs=1e-9)
    assert torch.allclose(parts.grad, full.grad, atol=1e-9)


def test_dpo_at_the_reference_is_log_2_with_no_margin() -> None:
    logits, data = _batch(2)
    lp = torch.log_softmax(logits, -1)
    data["reference_policy_logprobs"][:, 1:] = lp[:, :-1].gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    loss, m = DPOLossFn(DPOLossConfig())(logits, data, data["sample_mask"].sum(), torch.tensor(0.0))
    assert float(loss) == pytest.approx(math.log(2), abs=1e-9)
    assert m["reward_margin"] == pytest.approx(0.0, abs=1e-9) and m["kl_to_reference"] == pytest.approx(0.0, abs=1e-9)


def test_bradley_terry_loss_and_accuracy() -> None:
    scores = torch.tensor([[2.0], [0.5], [-1.0], [0.0], [3.0], [-3.0]], dtype=torch.float64)
    data = BatchedDataDict(sample_mask=torch.tensor([1.0, 1, 1, 1, 0, 0]))
    loss, m = PreferenceLoss()(scores, data, torch.tensor(4.0), torch.tensor(0.0))
    want = (-math.log(1 / (1 + math.exp(-1.5))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    assert float(loss) == pytest.approx(want, abs=1e-9)
    assert m["accuracy"] == 0.5 and m["reward_margin"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="one score per sequence"):
        PreferenceLoss()(torch.zeros(6, 3, 5), data, torch.tensor(4.0), torch.tensor(0.0))


def test_pairs_must_be_whole() -> None:
    logits, data = _batch()
    with pytest.raises(ValueError, match="whole pairs"):
        DPOLossFn()(logits[:3], data.slice(0, 3), torch.tensor(3.0), torch.tensor(0.0))


def test_nll_token_accuracy_counts_greedy_hits_among_trained_tokens() -> None:
    ids = torch.tensor([[0, 1, 2, 3]])
    logits = torch.zeros(1, 4, 5)
    logits[0, 0, 1] = 5.0  # predicts token 1 at position 1: right
    logits[0, 1, 4] = 5.0  # predicts 4 where 2 comes: wrong
    logits[0, 2, 3] = 5.0  # right, but position 3 is not trained
    data = BatchedDataDict(input_ids=ids, token_mask=torch.tensor([[0.0, 1, 1, 0]]), sample_mask=torch.ones(1))
    _, m = NLLLoss()(logits, data, torch.tensor(1.0), torch.tensor(2.0))
    assert m["token_accuracy"] == pytest.approx(0.5)
