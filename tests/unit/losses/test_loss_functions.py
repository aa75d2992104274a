"""ClippedPGLossFn / NLLLoss against hand-computed values.

Logits are built as log-probability vectors, so the model's logprob of every target token is a chosen number;
expected values are computed here with python floats (math), never by the implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.algorithms.interfaces import LossFunction, LossType
from rlpost.config.errors import ConfigError
from rlpost.config.schema.loss import ClippedPGLossConfig, NLLLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.clipped_pg import ClippedPGLossFn, NLLLoss

V = 4
EPS = 1e-8


def logits_for(probs: list[list[float]]) -> torch.Tensor:
    """[B, T+1, V] float64 logits whose softmax at position t gives token 0 probability probs[b][t]."""
    rows = []
    for row in probs:
        pos = []
        for p in row:
            rest = (1.0 - p) / (V - 1)
            pos.append([math.log(p)] + [math.log(rest)] * (V - 1))
        pos.append([0.0] * V)  # last position predicts nothing
        rows.append(pos)
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def per_token(vals: list[list[float]]) -> torch.Tensor:
    """[B, T] python values -> [B, T+1] tensor with position 0 = 0 (the data convention)."""
    return torch.tensor([[0.0] + list(r) for r in vals], dtype=torch.float64)


def make_data(
    p_old: list[list[float]],
    p_gen: list[list[float]] | None = None,
    p_ref: list[list[float]] | None = None,
    adv: list[float] | None = None,
    token_mask: list[list[float]] | None = None,
    sample_mask: list[float] | None = None,
) -> BatchedDataDict:
    b, t = len(p_old), len(p_old[0])
    log = lambda m: [[math.log(x) for x in r] for r in m]  # noqa: E731
    adv = adv if adv is not None else [1.0] * b
    return BatchedDataDict(
        input_ids=torch.zeros(b, t + 1, dtype=torch.long),
        token_mask=per_token(token_mask or [[1.0] * t for _ in range(b)]),
        sample_mask=torch.tensor(sample_mask or [1.0] * b, dtype=torch.float64),
        advantages=per_token([[a] * t for a in adv]),
        prev_logprobs=per_token(log(p_old)),
        generation_logprobs=per_token(log(p_gen or p_old)),
        reference_policy_logprobs=per_token(log(p_ref or p_old)),
    )


def cfg(**kw: object) -> ClippedPGLossConfig:
    base: dict[str, object] = {"reference_policy_kl_penalty": 0.0}
    base.update(kw)
    return ClippedPGLossConfig(**base)  # type: ignore[arg-type]


def run(loss_cfg: ClippedPGLossConfig, probs: list[list[float]], data: BatchedDataDict, gs: float, gt: float):
    fn = ClippedPGLossFn(loss_cfg)
    loss, metrics = fn(
        logits_for(probs),
        data,
        torch.tensor(float(gs), dtype=torch.float64),
        torch.tensor(float(gt), dtype=torch.float64),
    )
    return float(loss), metrics


def test_protocol_and_loss_type() -> None:
    assert isinstance(ClippedPGLossFn(cfg()), LossFunction)
    assert isinstance(NLLLoss(), LossFunction)
    assert ClippedPGLossFn(cfg()).loss_type == LossType.TOKEN_LEVEL
    assert ClippedPGLossFn(cfg(token_level_loss=False)).loss_type == LossType.SEQUENCE_LEVEL
    assert LossType("sequence_level") is LossType.SEQUENCE_LEVEL


def test_token_level_clipping_min_and_max() -> None:
    # ratios: row0 (A=+1): 0.6/0.4=1.5 -> clipped 1.2 ; 0.3/0.5=0.6 -> unclipped side wins (-0.6 > -0.8)
    #         row1 (A=-1): 0.6/0.4=1.5 -> 1.5 (max(1.5, 1.2)) ; 0.3/0.5=0.6 -> max(0.6, 0.8) = 0.8
    probs = [[0.6, 0.3], [0.6, 0.3]]
    data = make_data(p_old=[[0.4, 0.5], [0.4, 0.5]], adv=[1.0, -1.0])
    loss, m = run(cfg(), probs, data, gs=2, gt=4)
    expected = (-1.2 + -0.6 + 1.5 + 0.8) / (4 + EPS)
    assert loss == pytest.approx(expected, rel=1e-9)
    assert m["loss"] == pytest.approx(expected, rel=1e-9)
    assert m["probs_ratio"] == pytest.approx((1.5 + 0.6 + 1.5 + 0.6) / 4, rel=1e-7)
    assert m["probs_ratio_clamped"] == pytest.approx((1.2 + 0.8 + 1.2 + 0.8) / 4, rel=1e-7)
    assert m["kl_penalty"] == 0.0
    assert m["num_valid_samples"] == 2.0


def test_asymmetric_clip_higher() -> None:
    # eps_low 0.1, eps_high 0.5: ratio 1.5 now unclipped for A>0 ; ratio 0.6 clamps to 0.9 for A<0
    probs = [[0.6], [0.3]]
    data = make_data(p_old=[[0.4], [0.5]], adv=[1.0, -1.0])
    loss, _ = run(cfg(ratio_clip_min=0.1, ratio_clip_max=0.5), probs, data, gs=2, gt=2)
    assert loss == pytest.approx((-1.5 + 0.9) / (2 + EPS), rel=1e-9)


def test_dual_clip() -> None:
    # A=-2, ratio 0.5/0.1 = 5: l = max(10, 2*1.2) = 10 ; dual clip c=3 -> min(10, 3*2) = 6
    # A=+1 row is unaffected by the dual clip: ratio 5 -> -1.2
    probs = [[0.5], [0.5]]
    data = make_data(p_old=[[0.1], [0.1]], adv=[-2.0, 1.0])
    loss, _ = run(cfg(ratio_clip_c=3.0), probs, data, gs=2, gt=2)
    assert loss == pytest.approx((6.0 - 1.2) / (2 + EPS), rel=1e-9)
    loss_nodual, _ = run(cfg(), probs, data, gs=2, gt=2)
    assert loss_nodual == pytest.approx((10.0 - 1.2) / (2 + EPS), rel=1e-9)


def test_sequence_level_reduction_and_token_mask() -> None:
    # row0: 2 valid tokens, row1: 1 valid token (second masked). A=+1, ratios 1 (p == p_old).
    probs = [[0.5, 0.25], [0.4, 0.1]]
    data = make_data(p_old=probs, adv=[1.0, 2.0], token_mask=[[1, 1], [1, 0]])
    loss, m = run(cfg(token_level_loss=False), probs, data, gs=2, gt=3)
    seq0 = (-1.0 - 1.0) / (2 + EPS)
    seq1 = (-2.0) / (1 + EPS)
    assert loss == pytest.approx((seq0 + seq1) / (2 + EPS), rel=1e-9)
    # the token-level version of the same batch weights tokens, not sequences
    loss_tok, _ = run(cfg(), probs, data, gs=2, gt=3)
    assert loss_tok == pytest.approx((-1 - 1 - 2) / (3 + EPS), rel=1e-9)
    assert m["probs_ratio"] == pytest.approx(3 / 3, rel=1e-7)  # metrics stay token means


def test_sample_mask_removes_a_sequence() -> None:
    probs = [[0.5], [0.5]]
    data = make_data(p_old=[[0.5], [0.25]], adv=[1.0, 5.0], sample_mask=[1.0, 0.0])
    loss, m = run(cfg(), probs, data, gs=1, gt=1)
    assert loss == pytest.approx(-1.0 / (1 + EPS), rel=1e-9)
    assert m["num_valid_samples"] == 1.0
    loss_s, _ = run(cfg(token_level_loss=False), probs, data, gs=1, gt=1)
    assert loss_s == pytest.approx(-1.0 / (1 + EPS) / (1 + EPS), rel=1e-12)  # inner and outer mean


@pytest.mark.parametrize(
    "kl_type, fn",
    [
        ("k1", lambda r: -r),
        ("k2", lambda r: 0.5 * r * r),
        ("k3", lambda r: math.exp(r) - 1 - r),
    ],
)
def test_kl_types(kl_type: str, fn) -> None:
    # lp = log 0.2, lp_ref = log 0.4 -> logr = log 2 ; second token lp_ref = lp - log 4 -> logr = -log 4
    probs = [[0.2, 0.4]]
    data = make_data(p_old=probs, p_ref=[[0.4, 0.1]], adv=[0.0])
    beta = 0.1
    loss, m = run(cfg(reference_policy_kl_penalty=beta, reference_policy_kl_type=kl_type), probs, data, gs=1, gt=2)
    kl = beta * (fn(math.log(2)) + fn(-math.log(4))) / (2 + EPS)
    assert loss == pytest.approx(kl, rel=1e-9)
    assert m["kl_penalty"] == pytest.approx(kl / beta, rel=1e-9)


@pytest.mark.parametrize("kl_type, expected_tok", [("k1", -10.0), ("k2", 10.0), ("k3", 10.0)])
def test_kl_input_and_output_clamps(kl_type: str, expected_tok: float) -> None:
    # logr = log(p_ref/p) = log(0.9 / 1e-12) ~ 27.5 -> input clamp 20 -> k1=-20, k2=200, k3=e^20-21 -> output clamp 10
    probs = [[1e-12]]
    data = make_data(p_old=probs, p_ref=[[0.9]], adv=[0.0])
    loss, _ = run(cfg(reference_policy_kl_penalty=1.0, reference_policy_kl_type=kl_type), probs, data, gs=1, gt=1)
    assert loss == pytest.approx(expected_tok / (1 + EPS), rel=1e-9)
    # a smaller input clamp is visible through an unsaturated output clamp: logr clamped to 2
    loss2, _ = run(
        cfg(
            reference_policy_kl_penalty=1.0,
            reference_policy_kl_type=kl_type,
            kl_input_clamp_value=2.0,
            kl_output_clamp_value=100.0,
        ),
        probs,
        data,
        gs=1,
        gt=1,
    )
    want = {"k1": -2.0, "k2": 2.0, "k3": math.exp(2) - 3}[kl_type]
    assert loss2 == pytest.approx(want / (1 + EPS), rel=1e-9)


def test_on_policy_kl_approximation_weights() -> None:
    # w_kl = exp(lp - lp_gen) = 0.4 / 0.2 = 2 ; k3 with logr = log(0.2 / 0.4)
    probs = [[0.4]]
    data = make_data(p_old=probs, p_gen=[[0.2]], p_ref=[[0.2]], adv=[0.0])
    beta = 0.5
    loss, _ = run(cfg(reference_policy_kl_penalty=beta, use_on_policy_kl_approximation=True), probs, data, 1, 1)
    r = math.log(0.5)
    assert loss == pytest.approx(beta * 2 * (math.exp(r) - 1 - r) / (1 + EPS), rel=1e-9)
    loss_off, _ = run(cfg(reference_policy_kl_penalty=beta), probs, data, 1, 1)
    assert loss_off == pytest.approx(beta * (math.exp(r) - 1 - r) / (1 + EPS), rel=1e-9)


def test_kl_sequence_level() -> None:
    probs = [[0.2, 0.2], [0.2, 0.2]]
    data = make_data(p_old=probs, p_ref=[[0.4, 0.2], [0.2, 0.1]], adv=[0.0, 0.0], token_mask=[[1, 1], [0, 1]])
    k3 = lambda r: math.exp(r) - 1 - r  # noqa: E731
    loss, _ = run(cfg(reference_policy_kl_penalty=1.0, token_level_loss=False), probs, data, gs=2, gt=3)
    seq0 = (k3(math.log(2)) + 0.0) / (2 + EPS)
    seq1 = k3(math.log(0.5)) / (1 + EPS)
    assert loss == pytest.approx((seq0 + seq1) / (2 + EPS), rel=1e-9)


def test_importance_sampling_and_truncation() -> None:
    # ratio 1 (p == p_old); IS weights exp(lp_old - lp_gen) = 0.5/0.25 = 2 and 0.5/1.0... use 0.5/0.625 = 0.8
    probs = [[0.5, 0.5]]
    data = make_data(p_old=probs, p_gen=[[0.25, 0.625]], adv=[1.0])
    loss_plain, m = run(cfg(), probs, data, 1, 2)
    assert loss_plain == pytest.approx(-2 / (2 + EPS), rel=1e-9)
    assert m["sampling_importance_ratio"] == pytest.approx((2 + 0.8) / 2, rel=1e-7)
    loss_is, _ = run(cfg(use_importance_sampling_correction=True), probs, data, 1, 2)
    assert loss_is == pytest.approx(-(2 + 0.8) / (2 + EPS), rel=1e-9)
    tis = cfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.5)
    loss_tis, m_tis = run(tis, probs, data, 1, 2)
    assert loss_tis == pytest.approx(-(1.5 + 0.8) / (2 + EPS), rel=1e-9)
    assert m_tis["sampling_importance_ratio"] == pytest.approx((1.5 + 0.8) / 2, rel=1e-7)


def test_gspo_sequence_ratio_and_weights() -> None:
    # row0 token ratios 2 and 0.5 -> geometric mean 1 -> no clip -> l = -A ; row1 ratios 1.5, 1.5 -> 1.5 -> clip 1.2
    probs = [[0.4, 0.1], [0.6, 0.3]]
    data = make_data(p_old=[[0.2, 0.2], [0.4, 0.2]], p_gen=[[0.1, 0.2], [0.4, 0.4]], adv=[1.0, 1.0])
    gspo = cfg(token_level_loss=False, sequence_level_importance_ratios=True)
    loss, m = run(gspo, probs, data, gs=2, gt=4)
    seq0 = 2 * (-1.0) / (2 + EPS)
    seq1 = 2 * (-1.2) / (2 + EPS)
    assert loss == pytest.approx((seq0 + seq1) / (2 + EPS), rel=1e-9)
    assert m["probs_ratio"] == pytest.approx((1 + 1 + 1.5 + 1.5) / 4, rel=1e-7)
    # IS weight per sequence = exp(sum_t (lp_old - lp_gen)): row0 2 * 1 = 2 ; row1 1 * 0.5 = 0.5
    loss_is, m_is = run(
        cfg(token_level_loss=False, sequence_level_importance_ratios=True, use_importance_sampling_correction=True),
        probs,
        data,
        gs=2,
        gt=4,
    )
    assert loss_is == pytest.approx((2 * seq0 + 0.5 * seq1) / (2 + EPS), rel=1e-9)
    assert m_is["sampling_importance_ratio"] == pytest.approx((2 + 2 + 0.5 + 0.5) / 4, rel=1e-7)


def test_disable_ppo_ratio_is_reinforce() -> None:
    probs = [[0.5, 0.25]]
    data = make_data(p_old=[[0.1, 0.9]], adv=[2.0])  # prev logprobs must not matter
    loss, m = run(cfg(disable_ppo_ratio=True), probs, data, 1, 2)
    assert loss == pytest.approx(-2 * (math.log(0.5) + math.log(0.25)) / (2 + EPS), rel=1e-9)
    assert m["probs_ratio"] == pytest.approx((math.log(0.5) + math.log(0.25)) / 2, rel=1e-7)


def test_diagnostic_metrics() -> None:
    probs = [[0.5, 0.2]]
    p_old, p_gen = [[0.4, 0.2]], [[0.2, 0.25]]
    data = make_data(p_old=p_old, p_gen=p_gen, adv=[0.0])
    _, m = run(cfg(), probs, data, 1, 2)
    d = [math.log(0.4) - math.log(0.2), math.log(0.2) - math.log(0.25)]  # lp_old - lp_gen
    k3 = lambda r: math.exp(r) - 1 - r  # noqa: E731
    assert m["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(x)) for x in d) / 2, rel=1e-7)
    assert m["gen_kl_error"] == pytest.approx(sum(k3(x) for x in d) / 2, rel=1e-7)
    assert m["policy_kl_error"] == pytest.approx(sum(k3(-x) for x in d) / 2, rel=1e-7)
    js = 0.0
    for a, b in ((0.4, 0.2), (0.2, 0.25)):
        mix = math.log(0.5 * a + 0.5 * b)
        js += 0.5 * k3(math.log(a) - mix) + 0.5 * k3(math.log(b) - mix)
    assert m["js_divergence_error"] == pytest.approx(js / 2, rel=1e-7)
    assert m["sampling_importance_ratio"] == pytest.approx((2.0 + 0.8) / 2, rel=1e-7)
    ent = -((0.5 / 0.2) * math.log(0.5) + (0.2 / 0.25) * math.log(0.2)) / 2
    assert m["approx_entropy"] == pytest.approx(ent, rel=1e-7)
    assert all(isinstance(v, float) for v in m.values())
    assert set(m) == {
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
    }


def test_metrics_are_globally_normalised() -> None:
    # the same micro-batch with a 4x larger global token count reports a 4x smaller loss and token means
    probs = [[0.5, 0.25]]
    data = make_data(p_old=[[0.25, 0.25]], adv=[1.0])
    _, m1 = run(cfg(), probs, data, 1, 2)
    _, m4 = run(cfg(), probs, data, 4, 8)
    for k in ("loss", "probs_ratio", "token_mult_prob_error", "approx_entropy"):
        assert m4[k] == pytest.approx(m1[k] * (2 + EPS) / (8 + EPS), rel=1e-7)
    assert m4["num_valid_samples"] == m1["num_valid_samples"] == 1.0


def test_gradient_of_token_level_loss() -> None:
    # d loss / d logits at the target = -A/Gt * ratio * (1 - p) for an unclipped ratio
    probs = [[0.5]]
    data = make_data(p_old=[[0.5]], adv=[3.0])
    logits = logits_for(probs)
    loss, _ = ClippedPGLossFn(cfg())(
        logits, data, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    )
    loss.backward()
    assert logits.grad is not None
    assert float(logits.grad[0, 0, 0]) == pytest.approx(-3.0 * (1 - 0.5) / (1 + EPS), rel=1e-9)
    assert float(logits.grad[0, 0, 1]) == pytest.approx(3.0 * (0.5 / 3) / (1 + EPS), rel=1e-9)
    assert torch.all(logits.grad[0, 1] == 0)  # the last position predicts nothing


def test_nll_loss() -> None:
    probs = [[0.5, 0.25], [0.8, 0.1]]
    data = make_data(p_old=probs, token_mask=[[1, 1], [1, 0]], sample_mask=[1.0, 1.0])
    loss, m = NLLLoss()(
        logits_for(probs), data, torch.tensor(2.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)
    )
    assert float(loss) == pytest.approx(-(math.log(0.5) + math.log(0.25) + math.log(0.8)) / (3 + EPS), rel=1e-9)
    assert m["num_valid_samples"] == 2.0
    assert m["num_unmasked_tokens"] == 3.0
    assert NLLLoss(NLLLossConfig()).loss_type == LossType.TOKEN_LEVEL


@pytest.mark.parametrize(
    "bad",
    [
        {"truncated_importance_sampling_ratio": 2.0},  # TIS without IS correction
        {"sequence_level_importance_ratios": True},  # GSPO with token-level loss
        {"sequence_level_importance_ratios": True, "token_level_loss": False, "disable_ppo_ratio": True},
        {"ratio_clip_c": 0.5},
        {"reference_policy_kl_type": "k4"},
        {"reference_policy_kl_penalty": -0.1},
        {"ratio_clip_min": 1.0},
        {"kl_input_clamp_value": 0.0},
    ],
)
def test_invalid_combinations_rejected_at_build(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ClippedPGLossFn(cfg(**bad))
    with pytest.raises(ConfigError):
        ClippedPGLossFn({"reference_policy_kl_penalty": 0.0, **bad})


def test_config_from_mapping_and_dictconfig() -> None:
    from omegaconf import OmegaConf

    fn = ClippedPGLossFn({"ratio_clip_max": 0.28, "token_level_loss": False})
    assert fn.ratio_clip_max == 0.28 and fn.loss_type == LossType.SEQUENCE_LEVEL
    fn2 = ClippedPGLossFn(OmegaConf.create({"ratio_clip_c": 3.0, "_target_": "x"}))
    assert fn2.ratio_clip_c == 3.0
    fn3 = ClippedPGLossFn(OmegaConf.structured(ClippedPGLossConfig(ratio_clip_min=0.1)))
    assert fn3.ratio_clip_min == 0.1
    with pytest.raises(ConfigError):
        ClippedPGLossFn({"no_such_option": 1})


@pytest.mark.parametrize("token_level", [True, False])
def test_accumulated_scales_turn_summed_parts_into_the_global_means(token_level: bool) -> None:
    # A batch trained in parts runs every micro-batch with both normalisers 1 (rlpost.algorithms.overlap);
    # accumulated_scales must turn the summed loss, its gradients and every metric into what the micro-batches
    # report with the batch's true global counts (Gs = 3 valid sequences, Gt = 5 valid tokens), KL on.
    loss_cfg = cfg(token_level_loss=token_level, reference_policy_kl_penalty=0.1, ratio_clip_min=0.1,
                   ratio_clip_max=0.1)
    micro = [
        ([[0.5, 0.25], [0.8, 0.1]], make_data(p_old=[[0.4, 0.3], [0.7, 0.2]], p_gen=[[0.45, 0.3], [0.6, 0.2]],
                                               p_ref=[[0.3, 0.3], [0.5, 0.5]], adv=[1.5, -0.5],
                                               token_mask=[[1, 1], [1, 0]])),
        ([[0.6, 0.2]], make_data(p_old=[[0.6, 0.3]], p_ref=[[0.2, 0.2]], adv=[2.0])),
    ]
    fn = ClippedPGLossFn(loss_cfg)
    one = torch.tensor(1.0, dtype=torch.float64)
    gs, gt = torch.tensor(3.0, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64)
    scale, metric_scales = fn.accumulated_scales(3.0, 5.0)
    for probs, data in micro:
        logits_true, logits_part = logits_for(probs), logits_for(probs)
        loss_true, m_true = fn(logits_true, data, gs, gt)
        loss_part, m_part = fn(logits_part, data, one, one)
        loss_true.backward()
        (loss_part * scale).backward()
        assert float(loss_part) * scale == pytest.approx(float(loss_true), rel=1e-7)
        assert torch.allclose(logits_part.grad, logits_true.grad, rtol=1e-7, atol=1e-12)
        assert m_true.keys() == m_part.keys()
        for k, v in m_true.items():
            assert m_part[k] * metric_scales.get(k, 1.0) == pytest.approx(v, rel=1e-7, abs=1e-12), k
    assert scale == pytest.approx(1 / (5.0 if token_level else 3.0), rel=1e-7)
