"""CISPO (`loss=cispo`) against a plain-Python reference: the loss to 1e-6, the gradient through a constant weight,
and what sets it apart from the clipped PPO surrogate (a token past the clip keeps its gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.cispo import CISPOLossConfig
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.cispo import CISPOLossFn
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.runtime.build import build

V = 3
P = [[0.5, 0.9, 0.2], [0.05, 0.6, 0.7]]  # the policy's probability of each sampled token (token 0)
P_OLD = [[0.4, 0.1, 0.25], [0.5, 0.6, 0.3]]  # the pre-update policy's: ratios 1.25, 9, 0.8 / 0.1, 1, 2.33
ADV = [1.5, -0.7]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _logits() -> torch.Tensor:
    """[B, T+1, V] logits whose softmax gives token 0 probability P[b][t] at position t."""
    rows = [[[math.log(p)] + [math.log((1 - p) / (V - 1))] * (V - 1) for p in row] + [[0.0] * V] for row in P]
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def _data() -> BatchedDataDict:
    def shifted(vals: list[list[float]]) -> torch.Tensor:
        return torch.tensor([[0.0, *row] for row in vals], dtype=torch.float64)

    log_old = [[math.log(p) for p in row] for row in P_OLD]
    return BatchedDataDict(
        input_ids=torch.zeros(2, 4, dtype=torch.long), token_mask=shifted(MASK),
        sample_mask=torch.ones(2, dtype=torch.float64), advantages=shifted([[a] * 3 for a in ADV]),
        prev_logprobs=shifted(log_old), generation_logprobs=shifted(log_old),
        reference_policy_logprobs=shifted(log_old))


def _reference(low: float, high: float) -> tuple[float, list[list[float]]]:
    """The loss and d loss / d log p per token, in plain Python: sum of -clip(r) A log p over valid tokens / N."""
    n = sum(sum(row) for row in MASK)
    loss, grads = 0.0, []
    for b, row in enumerate(P):
        grads.append([])
        for t, p in enumerate(row):
            w = min(max(p / P_OLD[b][t], 1 - low), 1 + high)
            loss += MASK[b][t] * -w * ADV[b] * math.log(p) / n
            grads[b].append(MASK[b][t] * -w * ADV[b] / n)
    return loss, grads


def _run(fn: ClippedPGLossFn) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logits = _logits()
    n = torch.tensor(sum(sum(row) for row in MASK), dtype=torch.float64)
    loss, metrics = fn(logits, _data(), torch.tensor(2.0, dtype=torch.float64), n)
    loss.backward()
    assert logits.grad is not None
    return loss, logits.grad, metrics


@pytest.mark.parametrize("low,high", [(1.0, 4.0), (0.2, 0.28), (0.5, 0.1)])
def test_cispo_equals_its_plain_python_reference(low: float, high: float) -> None:
    loss, grad, metrics = _run(CISPOLossFn(CISPOLossConfig(ratio_clip_min=low, ratio_clip_max=high)))
    want, dlp = _reference(low, high)
    assert abs(float(loss) - want) < 1e-6
    # d loss / d logit of token 0 at (b, t) is dlp * (1 - p): the weight is a constant (stop-gradient)
    for b, row in enumerate(P):
        for t, p in enumerate(row):
            assert abs(float(grad[b, t, 0]) - dlp[b][t] * (1 - p)) < 1e-6
    assert metrics["loss"] == pytest.approx(want, abs=1e-6)


def test_a_token_past_the_clip_keeps_its_gradient_under_cispo_only() -> None:
    """Token (0, 1) has ratio 9 and a positive advantage: the clipped PPO surrogate is flat there, CISPO is not."""
    _, ppo_grad, _ = _run(ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)))
    _, cispo_grad, _ = _run(CISPOLossFn(CISPOLossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28)))
    assert float(ppo_grad[0, 1].abs().sum()) == 0.0
    assert float(cispo_grad[0, 1, 0]) < 0.0  # descending the loss raises the token's logprob


def test_loss_cispo_composes_builds_and_refuses_the_ppo_surrogates_keys() -> None:
    _, m = load_master_config(["loss=cispo", "loss_fn.ratio_clip_max=2.0"])
    assert isinstance(m.loss_fn, CISPOLossConfig) and m.loss_fn.ratio_clip_max == 2.0
    fn = build(m.loss_fn, key="loss_fn._target_")
    assert isinstance(fn, CISPOLossFn) and fn.ratio_clip_min == 1.0
    for override, key in (("loss_fn.ratio_clip_c=3.0", "loss_fn.ratio_clip_c"),
                          ("loss_fn.ratio_clip_min=1.5", "loss_fn.ratio_clip_min")):
        with pytest.raises(ConfigError) as err:
            load_master_config(["loss=cispo", override])
        assert err.value.key == key
